"""Attacks on the daemon's bookkeeping, done as a hostile or careless client would: forged
log lines, hellos that leave mid-way, trickled frames, idle admin connections, one rank's
close_job. Each against a real daemon process over real sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _uids import become
from conftest import call, error_code, hello, is_closed, raw_socket, read_reply, start_daemon
from test_daemon_sessions import as_uid, open_to_everyone, serve

from offloadd import protocol as p
from offloadd.config import default_socket_path
from offloadd.errors import UntrustedDaemonError
from offloadd.ops.embedded import PrivateDaemon
from offloadd.ops.status import DaemonUnreachableError, query_node_status
from offloadd.protocol import DAEMON_UID_ENV, expected_daemon_uid
from trainer.client import AsyncOffloadClient, OffloadClient

NOBODY = 65534
OTHER = 65533
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="peers with other uids need root")

FORGED = "ts=2026-01-01T00:00:00.000Z level=error logger=offloadd.service.lifecycle event=forged"


def daemon_with(tmp_path: Path, toml: str, arena_size: str = "256MiB") -> PrivateDaemon:
    config = tmp_path / "offloadd.toml"
    config.write_text(toml)
    return start_daemon(tmp_path / "d", arena_size=arena_size,
                        extra_args=["--config", str(config)])


def node_status(daemon: PrivateDaemon) -> dict:
    reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
    assert isinstance(reply, p.StatsOk), reply
    return reply.stats


def wait_for(condition, what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def log_lines(daemon: PrivateDaemon) -> list[str]:
    return Path(daemon.log_path).read_text(errors="replace").splitlines()


# -- job names and log records ---------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "evil\n" + FORGED,                     # a newline: a second, forged log record
    "evil\r" + FORGED,
    "evil\u2028" + FORGED,                 # a Unicode line separator
    "evil event=job_freed",                # a space: a forged key=value field
    "\x1b[2Kcleared",                      # terminal escapes
    "\u20ac" * 100,                        # 100 characters, 300 bytes: past every name limit
    "j" * 129,
])
def test_a_job_name_that_is_no_plain_name_is_refused_with_a_typed_error(
        daemon: PrivateDaemon, name: str) -> None:
    sock = raw_socket(daemon.socket_path)
    reply = hello(sock, name)
    assert error_code(reply) == "invalid", reply
    assert "job name must be" in reply.message
    assert isinstance(hello(sock, "plain-name_1.2:x@y+z"), p.HelloOk)  # the same connection
    assert not any(line.startswith(FORGED) for line in log_lines(daemon))


def test_a_shard_id_with_a_newline_cannot_forge_a_log_record(daemon: PrivateDaemon,
                                                              job: str) -> None:
    sock = raw_socket(daemon.socket_path)
    assert isinstance(hello(sock, job), p.HelloOk)
    shard = "s\n" + FORGED
    assert isinstance(call(sock, p.Acquire(2, [shard], "w", [64], ["uint8"])), p.Placed)
    sock.close()  # a writer that dies logs event=writer_disconnected with the shard id
    wait_for(lambda: any("event=writer_disconnected" in line and job in line
                         for line in log_lines(daemon)), "the writer's disconnect was logged")
    lines = log_lines(daemon)
    assert not any(line.startswith(FORGED) for line in lines)
    assert any(f'shard="s\\n{FORGED}"' in line for line in lines)
    assert all(line.startswith("ts=") for line in lines if line.strip())


# -- hellos that leave and connections that idle ---------------------------------------------


def test_a_hello_at_the_hello_timeout_is_answered_and_an_abandoned_one_leaks_nothing(
        tmp_path: Path) -> None:
    # A 192 MiB arena takes longer to make (mlock, populate: ~0.4 s) than hello_timeout_s,
    # so a hello read in time is still being served when its hello timer fires. (On a
    # loaded machine the daemon may read a hello only after its timer: a fair refusal.)
    toml = "job_linger_s = 0.2\nhello_timeout_s = 0.2\n"
    with daemon_with(tmp_path, toml, arena_size="1GiB") as daemon:
        for index in range(2):
            sock = raw_socket(daemon.socket_path)
            reply = hello(sock, f"slow-{index}", arena_nbytes=192 << 20)
            assert isinstance(reply, p.HelloOk) or "hello_timeout_s" in reply.message, reply
            sock.close()
        for index in range(2):  # clients that leave while their arena is made
            sock = raw_socket(daemon.socket_path)
            sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, f"left-{index}", 0, 1,
                                                0, "cpu", 192 << 20)))
            sock.close()

        def all_freed() -> bool:
            stats = node_status(daemon)
            return not stats["jobs"] and stats["node"]["reserved_nbytes"] == 0

        wait_for(all_freed, "every abandoned job was freed")
        with OffloadClient.connect(daemon.socket_path, job="left-0",
                                   arena_nbytes=192 << 20) as again:
            again.put("x", b"fresh")  # the name and the budget are free again
            assert again.get("x") == b"fresh"


def test_a_trickled_frame_is_dropped_after_frame_timeout_s(tmp_path: Path) -> None:
    toml = "frame_timeout_s = 0.5\nhello_timeout_s = 60\n"
    with (daemon_with(tmp_path, toml) as daemon,
          OffloadClient.connect(daemon.socket_path, job="witness") as witness):
        witness.put("w", b"alive")
        sock = raw_socket(daemon.socket_path)
        assert isinstance(hello(sock, "slow"), p.HelloOk)
        sock.sendall(p.HEADER.pack(1 << 20) + b"\0" * 100)  # a frame that never ends
        for _ in range(3):
            sock.sendall(b"\0")  # a byte now and then does not restart the clock
            time.sleep(0.1)
        reply, _fds = read_reply(sock)
        assert error_code(reply) == "limit" and "frame_timeout_s" in reply.message, reply
        assert is_closed(sock)
        assert witness.get("w") == b"alive"


def test_node_status_does_not_keep_an_admin_connection_open_for_ever(tmp_path: Path) -> None:
    with daemon_with(tmp_path, "hello_timeout_s = 0.5\n") as daemon:
        sock = raw_socket(daemon.socket_path)
        assert isinstance(call(sock, p.NodeStatus(1)), p.StatsOk)
        assert isinstance(call(sock, p.NodeStatus(2)), p.StatsOk)  # an active one may ask on
        reply, _fds = read_reply(sock)  # then it idles: closed hello_timeout_s later
        assert error_code(reply) == "limit" and "hello_timeout_s" in reply.message, reply
        assert is_closed(sock)


def test_a_connection_left_without_a_job_by_close_job_is_closed_after_the_hello_timeout(
        tmp_path: Path) -> None:
    with daemon_with(tmp_path, "hello_timeout_s = 0.5\n") as daemon:
        sock = raw_socket(daemon.socket_path)
        assert isinstance(hello(sock, "done"), p.HelloOk)
        assert isinstance(call(sock, p.CloseJob(2)), p.Ok)
        reply, _fds = read_reply(sock)  # it says no new hello: closed, no slot held for ever
        assert error_code(reply) == "limit" and "hello_timeout_s" in reply.message, reply
        assert is_closed(sock)


# -- one rank's close_job ------------------------------------------------------------------


def test_one_ranks_close_job_keeps_the_linger_for_a_peer_that_crashes(
        daemon: PrivateDaemon, job: str) -> None:
    payload = os.urandom(4096)
    rank0 = OffloadClient.connect(daemon.socket_path, job=job, rank=0, world_size=2)
    rank1 = OffloadClient.connect(daemon.socket_path, job=job, rank=1, world_size=2)
    rank1.put("b", payload)
    rank0.close_job()  # rank 0 is done
    for _crash in range(2):  # rank 1 crashes, restarts, reattaches, crashes again
        rank1.close()
        assert job in node_status(daemon)["jobs"]
        rank1 = OffloadClient.connect(daemon.socket_path, job=job, rank=1, world_size=2)
        assert rank1.get("b") == payload
    rank1.close_job()  # the last rank is done: freed at once
    assert job not in node_status(daemon)["jobs"]


# -- a restart keeps who owns a job --------------------------------------------------------


@needs_root
def test_a_restart_keeps_who_owns_a_job_and_its_secret(tmp_path: Path, swap_root: Path) -> None:
    config = tmp_path / "offloadd.toml"
    config.write_text(f"allowed_uids = [{NOBODY}, {OTHER}]\n")
    payload = os.urandom(100_000)

    def as_owner(secret: str, action) -> str:
        def run() -> str:
            os.environ[p.JOB_SECRET_ENV] = secret
            with OffloadClient.connect(daemon.socket_path, job="owned") as client:
                return action(client)
        return run

    def write(client: OffloadClient) -> str:
        client.put("x", payload)
        client.flush("one")
        return "flushed"

    def read(client: OffloadClient) -> str:
        return "match" if client.get("x") == payload else "other bytes"

    extra = ["--config", str(config)]
    with PrivateDaemon.start(None, swap_dirs=[str(swap_root)], extra_args=extra) as daemon:
        open_to_everyone(daemon)
        assert as_uid(NOBODY, as_owner("s3cret", write)) == "flushed"
    with PrivateDaemon.start(None, swap_dirs=[str(swap_root)],
                             extra_args=[*extra, "--recover"]) as daemon:
        open_to_everyone(daemon)
        # The first hello after the restart claims nothing: another uid is refused...
        refused = as_uid(OTHER, as_owner("s3cret", read))
        assert refused.startswith("denied:") and f"belongs to uid {NOBODY}" in refused, refused
        # ... and so is the owner's uid without the job's secret ...
        refused = as_uid(NOBODY, as_owner("guess", read))
        assert refused.startswith("denied:") and "job secret" in refused, refused
        # ... while the owner with it reads its shards, byte for byte.
        assert as_uid(NOBODY, as_owner("s3cret", read)) == "match"
        manifest = (swap_root / "offloadd" / "owned" / "manifest.json").read_text()
        assert "s3cret" not in manifest  # the secret is kept only as a salted digest


# -- socket squatting --------------------------------------------------------------------------


@contextmanager
def squatter(uid: int = NOBODY) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """A process of ``uid`` listening first on a socket path in a world-writable sticky dir
    (as /tmp is); yields the path and a function returning what its first connection sent
    until that connection closed."""
    shared = tempfile.mkdtemp(prefix="offloadd-squat-")
    os.chmod(shared, 0o1777)
    path = os.path.join(shared, "offloadd.sock")
    ready_read, ready_write = os.pipe()
    report_read, report_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            become(uid)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(path)
            server.listen(8)
            os.write(ready_write, b"r")
            server.settimeout(30)
            conn, _addr = server.accept()
            conn.settimeout(10)
            data = b""
            while chunk := conn.recv(1 << 16):
                data += chunk
            os.write(report_write, data[:4096])
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(report_write)
    assert os.read(ready_read, 1) == b"r", "the squatter did not listen"

    def received() -> bytes:
        with os.fdopen(report_read, "rb") as report:
            return report.read()

    try:
        yield path, received
    finally:
        os.waitpid(pid, 0)
        os.close(ready_read)
        os.unlink(path)
        os.rmdir(shared)


@needs_root
def test_clients_send_nothing_to_a_socket_another_uid_squats(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(p.JOB_SECRET_ENV, "s3cret")
    monkeypatch.delenv(DAEMON_UID_ENV, raising=False)
    with squatter() as (path, received):
        with pytest.raises(UntrustedDaemonError, match=f"runs as uid {NOBODY}"):
            OffloadClient.connect(path, job="victim", timeout_s=10)
        assert received() == b""
    with squatter() as (path, received):
        with pytest.raises(UntrustedDaemonError, match=f"runs as uid {NOBODY}"):
            asyncio.run(AsyncOffloadClient.connect(path, job="victim", timeout_s=10))
        assert received() == b""
    with squatter() as (path, received):  # gc would delete what a fake status leaves out
        with pytest.raises(DaemonUnreachableError, match=f"runs as uid {NOBODY}"):
            query_node_status(path)
        assert received() == b""
    # The reference: told that the daemon runs as that uid, the client trusts it and sends
    # its hello, secret included; so the check above is what kept the secret home.
    with squatter() as (path, received):
        with pytest.raises(OSError):  # the squatter never answers
            OffloadClient.connect(path, job="victim", timeout_s=1, daemon_uid="nobody")
        assert b"s3cret" in received()


@needs_root
def test_serve_on_a_squatted_socket_exits_1_naming_the_squatter() -> None:
    with squatter() as (path, _received):
        process = serve("--socket", path, "--arena-size", "8MiB")
        _out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert f"uid {NOBODY}) is listening on {path}" in err


def test_the_daemon_uid_is_configurable_by_number_or_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DAEMON_UID_ENV, str(OTHER))
    assert expected_daemon_uid() == OTHER
    assert expected_daemon_uid("nobody") == NOBODY  # the argument wins
    monkeypatch.setenv(DAEMON_UID_ENV, "no-such-user-here")
    with pytest.raises(ValueError, match=DAEMON_UID_ENV):
        expected_daemon_uid()


@needs_root
def test_the_default_socket_is_in_a_runtime_dir_not_in_tmp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", f"/run/user/{NOBODY}")
    assert default_socket_path() == "/run/offloadd/offloadd.sock"  # root: the node daemon's
    expected = ("/run/offloadd/offloadd.sock" if os.path.isdir("/run/offloadd")
                else f"/run/user/{NOBODY}/offloadd.sock")
    assert as_uid(NOBODY, default_socket_path) == expected  # a user: its own runtime dir
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/offloadd-test")  # systemd's RuntimeDirectory=
    assert default_socket_path() == "/run/offloadd-test/offloadd.sock"
