"""Ended, flushed jobs' swap files: kept for --recover, counted against their owner and
their swap dir, listed by node_status, and deleted without `offloadd gc` (after the
retention, or when the owner needs the room). Real daemon, real files."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import call, raw_socket, start_daemon

from offloadd import protocol as p
from offloadd.errors import LimitExceededError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

MIB = 1 << 20


def node_status(daemon: PrivateDaemon) -> dict:
    reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
    assert isinstance(reply, p.StatsOk), reply
    return reply.stats


def swap_daemon(tmp_path: Path, swap: Path, toml: str) -> PrivateDaemon:
    config = tmp_path / "offloadd.toml"
    config.write_text(f"swap_size = \"64MiB\"\n{toml}")
    return start_daemon(tmp_path / "d", arena_size="64MiB",
                        extra_args=["--config", str(config), "--swap-dir", str(swap)])


def flush_and_end(daemon: PrivateDaemon, job: str, nbytes: int) -> None:
    with OffloadClient.connect(daemon.socket_path, job=job, arena_nbytes=16 * MIB) as client:
        client.put_many({f"s{i}": bytes([i + 1]) * (4 * MIB) for i in range(nbytes // (4 * MIB))})
        client.flush(job)
        client.close_job()


def job_dir(swap: Path, job: str) -> Path:
    return swap / "offloadd" / job


def test_ended_jobs_swap_counts_against_its_owner_and_is_reclaimed(
        tmp_path: Path, swap_root: Path) -> None:
    with swap_daemon(tmp_path, swap_root, "max_swap_nbytes_per_uid = \"20MiB\"\n") as daemon:
        flush_and_end(daemon, "first", 4 * MIB)
        status = node_status(daemon)
        kept = status["retained"]["first"]
        assert kept["uid"] == 0 and kept["nbytes"] >= 4 * MIB and kept["expires_in_s"] > 0
        assert status["node"]["swap"]["retained_nbytes"] == kept["nbytes"]
        # The kept file stays reserved in its dir's budget.
        assert status["node"]["swap"]["dirs"][0]["reserved_nbytes"] == kept["nbytes"]
        assert job_dir(swap_root, "first").exists()
        shown = subprocess.run([sys.executable, "-m", "offloadd", "status", "--socket",
                                daemon.socket_path], capture_output=True, text=True, timeout=60)
        assert "ended job first (uid 0)" in shown.stdout, shown.stdout + shown.stderr
        # The same owner needs the room: its oldest ended job goes, not the new flush
        # (4 MiB kept, its file cut to what its manifest names, + 16 MiB > 20 MiB).
        flush_and_end(daemon, "second", 16 * MIB)
        status = node_status(daemon)
        assert "first" not in status["retained"] and "second" in status["retained"]
        assert not job_dir(swap_root, "first").exists()
        # More than the cap with nothing left to reclaim: refused, naming the knob.
        with OffloadClient.connect(daemon.socket_path, job="third",
                                   arena_nbytes=32 * MIB) as client:
            client.put_many({f"s{i}": bytes([i + 1]) * (4 * MIB) for i in range(6)})
            with pytest.raises(LimitExceededError, match="max_swap_nbytes_per_uid"):
                client.flush("too-much")
        assert daemon.process.poll() is None


def test_ended_jobs_swap_is_deleted_after_the_retention(tmp_path: Path, swap_root: Path) -> None:
    with swap_daemon(tmp_path, swap_root, "flushed_job_retention_s = 0.5\n") as daemon:
        flush_and_end(daemon, "short", 4 * MIB)
        assert job_dir(swap_root, "short").exists()
        deadline = time.monotonic() + 30
        while node_status(daemon)["retained"]:
            assert time.monotonic() < deadline, "the retained job was never reclaimed"
            time.sleep(0.1)
        assert not job_dir(swap_root, "short").exists()
        assert node_status(daemon)["node"]["swap"]["dirs"][0]["reserved_nbytes"] == 0
