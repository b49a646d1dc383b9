"""Limits per client against the real daemon: each a typed error naming its config key and
a count in offloadd_limit_rejections_total{limit}."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import call, error_code, hello, is_closed, raw_socket, read_reply, start_daemon
from test_daemon_metrics import scrape, value
from test_daemon_sessions import as_uid, open_to_everyone

from offloadd import protocol as p
from offloadd.config import DaemonConfig
from offloadd.errors import LimitExceededError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

NOBODY = 65534


def limited_daemon(tmp_path: Path, toml: str, **kwargs) -> PrivateDaemon:
    config = tmp_path / "offloadd.toml"
    config.write_text(toml)
    return start_daemon(None, extra_args=["--config", str(config)], **kwargs)


def rejections(daemon: PrivateDaemon, limit: str) -> float:
    return value(scrape(daemon), "offloadd_limit_rejections_total", limit=limit)


def refused_with(sock, knob: str) -> None:
    reply, _fds = read_reply(sock)
    assert error_code(reply) == "limit", reply
    assert knob in reply.message  # type: ignore[union-attr]


def test_invalid_limit_names_the_knob() -> None:
    with pytest.raises(ValueError, match="max_sessions_per_uid"):
        DaemonConfig(max_sessions_per_uid=0)
    with pytest.raises(ValueError, match="max_partial_frame_nbytes"):
        DaemonConfig(max_partial_frame_nbytes=64 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
def test_sessions_per_uid_and_per_node(tmp_path: Path) -> None:
    toml = f"allowed_uids = [{NOBODY}]\nmax_sessions = 4\nmax_sessions_per_uid = 3\n"
    with limited_daemon(tmp_path, toml, arena_size="32MiB") as daemon:
        open_to_everyone(daemon)
        mine = [raw_socket(daemon.socket_path) for _ in range(3)]
        assert isinstance(hello(mine[0], "limits-job"), p.HelloOk)
        fourth = raw_socket(daemon.socket_path)
        refused_with(fourth, "max_sessions_per_uid")
        assert is_closed(fourth)

        def two_connections() -> str:
            first = OffloadClient.connect(daemon.socket_path, job="nobody-job")
            try:
                OffloadClient.connect(daemon.socket_path, job="nobody-job")
            except LimitExceededError as exc:
                return f"refused: {exc}"
            finally:
                first.close()
            return "both connected"

        assert "max_sessions in the daemon config" in as_uid(NOBODY, two_connections)
        mine.pop().close()
        again = raw_socket(daemon.socket_path)  # a freed slot is reusable
        assert isinstance(hello(again, "limits-job"), p.HelloOk)
        assert rejections(daemon, "max_sessions_per_uid") == 1
        assert rejections(daemon, "max_sessions") == 1


def test_request_limits(tmp_path: Path) -> None:
    toml = ("hello_timeout_s = 0.5\nmax_ids_per_request = 8\nmax_shards_per_job = 10\n"
            "max_partial_frame_nbytes = 4096\n")
    with limited_daemon(tmp_path, toml, arena_size="32MiB") as daemon:
        idle = raw_socket(daemon.socket_path)  # says nothing: closed after hello_timeout_s
        refused_with(idle, "hello_timeout_s")
        assert is_closed(idle)

        sock = raw_socket(daemon.socket_path)
        assert isinstance(hello(sock, "req-job"), p.HelloOk)
        ids = [f"s{i}" for i in range(9)]
        assert error_code(call(sock, p.Alloc(2, ids, [64] * 9, ["uint8"] * 9))) == "limit"
        assert isinstance(call(sock, p.Alloc(3, ids[:8], [64] * 8, ["uint8"] * 8)), p.Placed)
        assert isinstance(call(sock, p.Alloc(4, ids[:8], [64] * 8, ["uint8"] * 8)), p.Placed)
        reply = call(sock, p.Acquire(5, ["n1", "n2", "n3"], "w", [64] * 3, ["uint8"] * 3))
        assert error_code(reply) == "limit" and "max_shards_per_job" in reply.message
        assert isinstance(call(sock, p.Alloc(6, ["n1", "n2"], [64] * 2, ["uint8"] * 2)),
                          p.Placed)
        sock.sendall(p.HEADER.pack(8192) + b"\0" * 100)  # a frame longer than the limit
        refused_with(sock, "max_partial_frame_nbytes")
        assert is_closed(sock)
        for knob in ("hello_timeout_s", "max_ids_per_request", "max_shards_per_job",
                     "max_partial_frame_nbytes"):
            assert rejections(daemon, knob) == 1, knob


def test_prefetches_per_job(tmp_path: Path, swap_root: Path) -> None:
    config = tmp_path / "offloadd.toml"
    config.write_text("max_prefetches_per_job = 2\n")
    daemon = PrivateDaemon.start(tmp_path / "d", arena_size="32MiB",
                                 swap_dirs=[str(swap_root)], extra_args=["--config", str(config)])
    with daemon, OffloadClient.connect(daemon.socket_path, job="pf",
                                       arena_nbytes=1 << 20) as client:
        for index in range(6):  # 6 x 256 KiB through a 1 MiB arena: some live in swap
            client.put(f"s{index}", bytes([index]) * (256 << 10))
        with pytest.raises(LimitExceededError, match="max_prefetches_per_job"):
            client.prefetch([f"s{i}" for i in range(3)])
        client.prefetch(["s0", "s1"])
        assert client.get("s0") == bytes([0]) * (256 << 10)


def nobody_daemon(tmp_path: Path, toml: str, **kwargs) -> PrivateDaemon:
    daemon = limited_daemon(tmp_path, f"allowed_uids = [{NOBODY}]\n{toml}", **kwargs)
    open_to_everyone(daemon)
    return daemon


def as_nobody_until_refused(socket_path: str, attempts: int, open_one) -> str:
    """In a child running as ``nobody``: call ``open_one(socket_path, index)`` until it is
    refused; return 'refused after N: <message>' or 'never refused'."""
    def attack() -> str:
        held = []
        for index in range(attempts):
            try:
                held.append(open_one(socket_path, index))
            except LimitExceededError as exc:
                return f"refused after {index}: {exc}"
        return "never refused"

    return as_uid(NOBODY, attack)


def tiny_job(socket_path: str, index: int) -> OffloadClient:
    return OffloadClient.connect(socket_path, job=f"tiny-{index}", arena_nbytes=4096)


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
def test_jobs_and_descriptors_per_uid(tmp_path: Path) -> None:
    """Tiny jobs from one uid stop at its cap (jobs, then descriptors: a connection and an
    arena's two each); another uid's hello still works, and the refusal names the knob."""
    with nobody_daemon(tmp_path, "max_jobs_per_uid = 5\n", arena_size="32MiB") as daemon:
        outcome = as_nobody_until_refused(daemon.socket_path, 100, tiny_job)
        assert outcome.startswith("refused after 5:") and "max_jobs_per_uid" in outcome, outcome
        with OffloadClient.connect(daemon.socket_path, job="root-job", arena_nbytes=4096) as c:
            c.put("x", b"ok")
        assert rejections(daemon, "max_jobs_per_uid") == 1
    (tmp_path / "fds").mkdir()
    with nobody_daemon(tmp_path / "fds", "max_fds_per_uid = 9\n", arena_size="32MiB") as daemon:
        outcome = as_nobody_until_refused(daemon.socket_path, 100, tiny_job)
        # 3 jobs hold 9 descriptors (a connection, an arena's memfd and its mmap's copy
        # each); the 4th connection would be the 10th
        assert outcome.startswith("refused after 3:") and "max_fds_per_uid" in outcome, outcome
        with OffloadClient.connect(daemon.socket_path, job="root-job", arena_nbytes=4096) as c:
            c.put("x", b"ok")
        assert rejections(daemon, "max_fds_per_uid") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
def test_shards_and_metadata_per_uid_span_jobs(tmp_path: Path) -> None:
    """Shards with long ids across two jobs of one uid stop at the uid's metadata cap
    (~400 bytes a shard plus its id), then at its shard cap; other uids are not charged."""
    toml = "max_shards_per_uid = 12\nmax_metadata_nbytes_per_uid = 6000\n"
    with nobody_daemon(tmp_path, toml, arena_size="32MiB") as daemon:
        def fill() -> str:
            one = OffloadClient.connect(daemon.socket_path, job="m1", arena_nbytes=1 << 20)
            two = OffloadClient.connect(daemon.socket_path, job="m2", arena_nbytes=1 << 20)
            one.alloc([f"{'a' * 200}{i}" for i in range(6)], 64)  # 6 x ~601 bytes
            try:
                two.alloc([f"{'b' * 200}{i}" for i in range(6)], 64)  # 12 x 601 > 6000
            except LimitExceededError as exc:
                two.alloc([f"s{i}" for i in range(4)], 64)  # short ids still fit: 5214
                try:
                    two.alloc([f"t{i}" for i in range(3)], 64)  # 13 shards > 12
                except LimitExceededError as second:
                    return f"{exc} | {second}"
            return "never refused"

        outcome = as_uid(NOBODY, fill)
        assert "max_metadata_nbytes_per_uid" in outcome and "max_shards_per_uid" in outcome, \
            outcome
        with OffloadClient.connect(daemon.socket_path, job="root-job", arena_nbytes=1 << 20) as c:
            c.alloc([f"r{i}" for i in range(12)], 64)


def test_queued_optimizer_steps_per_uid(tmp_path: Path) -> None:
    """20 optimizer steps sent in one write with max_queued_steps_per_uid = 2: two are
    taken (one runs, one waits), the others are refused with the knob's name."""
    import numpy as np

    with limited_daemon(tmp_path, "max_queued_steps_per_uid = 2\n", arena_size="32MiB") as daemon, \
            OffloadClient.connect(daemon.socket_path, job="steps", arena_nbytes=4 << 20) as c:
        for suffix in ("master", "exp_avg", "exp_avg_sq", "grad"):
            c.put(f"u.{suffix}", np.zeros(1 << 16, np.float32))
        sock = raw_socket(daemon.socket_path, timeout_s=60)
        assert isinstance(hello(sock, "steps"), p.HelloOk)
        sock.sendall(b"".join(p.encode_frame(p.OptimizerStep(rid, "u", rid, 1e-3, 0.9, 0.999,
                                                             1e-8)) for rid in range(1, 21)))
        replies = [read_reply(sock)[0] for _ in range(20)]
        ok = [r for r in replies if isinstance(r, p.Ok)]
        refused = [r for r in replies if isinstance(r, p.ErrorReply)]
        assert len(ok) == 2 and len(refused) == 18, replies
        assert all(r.code == "limit" and "max_queued_steps_per_uid" in r.message for r in refused)
        c.optimizer_step("u", step=3, lr=1e-3)  # the count went back down


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
def test_pending_request_bytes_per_uid(tmp_path: Path) -> None:
    """Connections of one uid each holding a partial frame stop at the uid's cap on
    buffered bytes; the connection over it is closed with the knob's name; another
    uid's connection is unaffected."""
    with nobody_daemon(tmp_path, "max_pending_nbytes_per_uid = 8192\n",
                       arena_size="32MiB") as daemon:
        def hold_partial_frames() -> str:
            socks = [raw_socket(daemon.socket_path) for _ in range(3)]
            for sock in socks:
                sock.sendall(p.HEADER.pack(4000) + b"\0" * 3000)  # never completed
            reply, _fds = read_reply(socks[2])
            return reply.message if isinstance(reply, p.ErrorReply) else repr(reply)

        assert "max_pending_nbytes_per_uid" in as_uid(NOBODY, hold_partial_frames)
        mine = raw_socket(daemon.socket_path)
        mine.sendall(p.HEADER.pack(9000) + b"\0" * 8000)
        assert isinstance(hello(raw_socket(daemon.socket_path), "root-job"), p.HelloOk)
        assert rejections(daemon, "max_pending_nbytes_per_uid") == 1


def test_distinct_ranks_per_job(tmp_path: Path) -> None:
    """Per-rank state is bounded: a job takes at most max_ranks_per_job distinct ranks,
    however large the world_size its ranks claim; a known rank still reattaches."""
    with limited_daemon(tmp_path, "max_ranks_per_job = 4\n", arena_size="32MiB") as daemon:
        socks = [raw_socket(daemon.socket_path) for _ in range(6)]
        for rank in range(4):
            assert isinstance(hello(socks[rank], "ranks", rank=rank, world_size=1 << 30),
                              p.HelloOk)
        reply = hello(socks[4], "ranks", rank=1000, world_size=1 << 30)
        assert error_code(reply) == "limit" and "max_ranks_per_job" in reply.message
        socks[0].close()
        assert isinstance(hello(socks[5], "ranks", rank=0, world_size=1 << 30), p.HelloOk)
