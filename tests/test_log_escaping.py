"""Values a client chooses cannot forge log fields: a flush tag and a shard id holding spaces,
``=``, quotes, backslashes and line breaks each come back, from a real daemon's log, as one
field of exactly one record, parsed by a logfmt reader written here (Go's logfmt rules)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import call, hello, raw_socket

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from offloadd.ops.logs import logfmt_value
from trainer.client import OffloadClient

FORGED = "ts=2026-01-01T00:00:00.000Z level=error logger=offloadd event=forged job=victim"
HOSTILE_TAG = 'step 7 event=forged job=victim "q\\" \t\n' + FORGED
"""A flush tag the daemon accepts (no '/', 1..128 chars) that holds every forging trick."""
HOSTILE_SHARD = 's event=forged tag=x="y"\r\n' + FORGED + "\u2028 \x1b[2K"

_SHORT_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "r": "\r", "t": "\t"}


def _unquote(text: str, start: int) -> tuple[str, int]:
    """The quoted value that starts at ``text[start] == '"'``; returns it and the index after."""
    out, index = [], start + 1
    while True:
        char = text[index]
        if char == '"':
            return "".join(out), index + 1
        if char != "\\":
            out.append(char)
            index += 1
            continue
        kind = text[index + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(kind)
        if width is None:
            out.append(_SHORT_ESCAPES[kind])
            index += 2
        else:
            out.append(chr(int(text[index + 2:index + 2 + width], 16)))
            index += 2 + width


def parse_logfmt(line: str) -> list[tuple[str, str]]:
    """One logfmt record's ``(key, value)`` pairs in order (a key without ``=`` has "")."""
    pairs, index = [], 0
    while index < len(line):
        if line[index] == " ":
            index += 1
            continue
        end = index
        while end < len(line) and line[end] not in " =":
            end += 1
        key = line[index:end]
        if end == len(line) or line[end] == " ":
            pairs.append((key, ""))
            index = end
            continue
        if end + 1 < len(line) and line[end + 1] == '"':
            value, index = _unquote(line, end + 1)
        else:
            index = end + 1
            while index < len(line) and line[index] != " ":
                index += 1
            value = line[end + 1:index]
        pairs.append((key, value))
    return pairs


def records(daemon: PrivateDaemon) -> list[list[tuple[str, str]]]:
    # Split on "\n" only: str.splitlines would also split at a raw U+2028 a value forged.
    text = Path(daemon.log_path).read_text(errors="replace")
    return [parse_logfmt(line) for line in text.split("\n") if line]


def records_of(daemon: PrivateDaemon, event: str) -> list[dict[str, str]]:
    found = []
    for pairs in records(daemon):
        events = [value for key, value in pairs if key == "event"]
        if event in events:
            keys = [key for key, _value in pairs]
            assert len(events) == 1 and len(keys) == len(set(keys)), f"forged fields: {pairs}"
            found.append(dict(pairs))
    return found


def assert_nothing_forged(daemon: PrivateDaemon) -> None:
    for pairs in records(daemon):
        assert pairs[0][0] == "ts", f"a record that is no record: {pairs}"
        assert ("event", "forged") not in pairs, f"a forged field: {pairs}"


def wait_for(condition, what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def test_the_parser_reads_back_what_the_rule_writes() -> None:
    for value in (HOSTILE_TAG, HOSTILE_SHARD, "", "plain", "a\\b", "\U000e0001", "=", '"'):
        assert parse_logfmt(f"k={logfmt_value(value)} next=1") == [("k", value), ("next", "1")]


def test_a_flush_tag_comes_back_as_one_field_of_one_record(swap_root: Path) -> None:
    assert 0 < len(HOSTILE_TAG) <= 128 and "/" not in HOSTILE_TAG
    swap_dirs = [str(swap_root / "nvme0")]
    first = PrivateDaemon.start(swap_root / "run1", arena_size=16 << 20, swap_dirs=swap_dirs)
    try:
        client = OffloadClient.connect(first.socket_path, job="tagged", arena_nbytes=4 << 20,
                                       timeout_s=30)
        client.put("w", b"weights")
        client.flush(HOSTILE_TAG)
        # Killed while the job is live: the restart recovers it and logs its flush tag.
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(30)
        client.close()
    finally:
        first.stop()
    second = PrivateDaemon.start(swap_root / "run2", arena_size=16 << 20, swap_dirs=swap_dirs,
                                 extra_args=["--recover"])
    try:
        recovered = records_of(second, "job_recovered")
        assert [record["job"] for record in recovered] == ["tagged"], recovered
        assert recovered[0]["tag"] == HOSTILE_TAG
        assert_nothing_forged(second)
    finally:
        assert second.stop() == 0


def test_a_shard_id_comes_back_as_one_field_of_one_record(daemon: PrivateDaemon,
                                                          job: str) -> None:
    sock = raw_socket(daemon.socket_path)
    assert isinstance(hello(sock, job), p.HelloOk)
    reply = call(sock, p.Acquire(2, [HOSTILE_SHARD], "w", [64], ["uint8"]))
    assert isinstance(reply, p.Placed), reply
    sock.close()  # a writer that dies logs event=writer_disconnected with the shard id

    def logged() -> list[dict[str, str]]:
        return [record for record in records_of(daemon, "writer_disconnected")
                if record.get("job") == job]

    wait_for(logged, "the writer's disconnect was logged")
    assert [record["shard"] for record in logged()] == [HOSTILE_SHARD]
    assert_nothing_forged(daemon)


@pytest.mark.parametrize("value", [HOSTILE_TAG, HOSTILE_SHARD, "a b", "k=v", "", "\x00"])
def test_every_value_is_one_token_on_one_line(value: str) -> None:
    written = logfmt_value(value)
    assert "\n" not in written and "\r" not in written and "\u2028" not in written
    assert written.isprintable()
    assert parse_logfmt("k=" + written) == [("k", value)]
