"""Torn writes are never published (issue 13, item 3), with a real writer killed mid-lease.

A rank process leases a flushed shard for writing, scribbles half of it and is
killed with SIGKILL. Its bytes must never be read as a version: reads raise
TornShardError, a flush keeps the shard's previous version, and after the
daemon itself is killed and recovered the shard holds that version.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from offloadd.errors import TornShardError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

ARENA_NBYTES = 4 << 20
SHARD_NBYTES = 256 << 10
JOB = "torn"


def start(root: Path, name: str, *extra: str) -> PrivateDaemon:
    return PrivateDaemon.start(root / name, arena_size=2 * ARENA_NBYTES,
                               swap_dirs=[str(root / "nvme0")], extra_args=list(extra))


def connect(socket_path: str, rank: int = 0) -> OffloadClient:
    return OffloadClient.connect(socket_path, job=JOB, rank=rank, world_size=2,
                                 arena_nbytes=ARENA_NBYTES, timeout_s=30)


def test_a_writer_killed_mid_lease_tears_the_shard_and_the_flush_keeps_its_version(
        tmp_path: Path) -> None:
    before = os.urandom(SHARD_NBYTES)
    daemon = start(tmp_path, "run1")
    try:
        with connect(daemon.socket_path) as client:
            client.put("s", before)
            client.flush("before")
            writer = subprocess.Popen([sys.executable, __file__, "scribble", daemon.socket_path],
                                      stdout=subprocess.PIPE, text=True)
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "scribbled"
            writer.send_signal(signal.SIGKILL)
            writer.wait(30)
            polls = 0
            while client.stats()["sessions"] > 1 and polls < 5000:
                polls += 1  # the daemon sees the dead socket at once
            with pytest.raises(TornShardError, match="write it again"):
                client.get("s")
            client.flush("after")  # keeps the last written-back version of "s"
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(30)
    finally:
        daemon.stop()
    with start(tmp_path, "run2", "--recover") as recovered, \
            connect(recovered.socket_path) as client:
        assert client.get("s") == before


def scribble(socket_path: str) -> None:
    client = connect(socket_path, rank=0)
    lease = client.acquire("s", "w")
    lease.view[: SHARD_NBYTES // 2] = b"\xab" * (SHARD_NBYTES // 2)
    print("scribbled", flush=True)
    signal.pause()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "scribble":
    scribble(sys.argv[2])
