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
from offloadd.embedded import PrivateDaemon
from offloadd.errors import LimitExceededError
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
