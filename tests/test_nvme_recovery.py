"""Crashes around the NVMe tier: the daemon killed after a flush, a restart without
``--recover``, and a rank killed while it holds leases.

Each test runs real daemon and rank processes and kills them with SIGKILL, so no
clean-up code of the victim runs. Bytes are compared by digest; nothing is timed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.errors import ShardExistsError, UnknownShardError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

MIB = 1 << 20
ARENA_NBYTES = 16 * MIB
JOB = "recovery"



def swap_dirs(root: Path) -> list[str]:
    return [str(root / "nvme0"), str(root / "nvme1")]


def start(root: Path, name: str, *extra: str) -> PrivateDaemon:
    return PrivateDaemon.start(root / name, arena_size=ARENA_NBYTES, swap_dirs=swap_dirs(root),
                               extra_args=list(extra))


def connect(daemon: PrivateDaemon, job: str = JOB, rank: int = 0) -> OffloadClient:
    return OffloadClient.connect(daemon.socket_path, job=job, rank=rank, world_size=2,
                                 arena_nbytes=ARENA_NBYTES, timeout_s=30)


def kill_daemon(daemon: PrivateDaemon) -> None:
    daemon.process.send_signal(signal.SIGKILL)
    assert daemon.process.wait(30) == -signal.SIGKILL
    daemon.stop()


@contextlib.contextmanager
def stopped_cleanly(daemon: PrivateDaemon) -> Iterator[PrivateDaemon]:
    try:
        yield daemon
    finally:
        alive = daemon.process.poll() is None
        code = daemon.stop()
        assert alive, f"the daemon died; log:\n{Path(daemon.log_path).read_text()[-3000:]}"
        assert code == 0


def write(client: OffloadClient, digests: dict[str, bytes], shard_id: str, nbytes: int) -> None:
    data = os.urandom(nbytes)
    client.put(shard_id, data)
    digests[shard_id] = hashlib.sha256(data).digest()


def read_digests(client: OffloadClient, ids: list[str]) -> dict[str, bytes]:
    found = {}
    for shard_id in ids:
        with client.acquire(shard_id) as lease:
            found[shard_id] = hashlib.sha256(lease.view).digest()
    return found


# -- daemon crash after a flush ------------------------------------------------------


def write_flush_then_scribble(daemon: PrivateDaemon, flushed: dict[str, bytes], tag: str,
                              round_index: int) -> None:
    """Write shards 3x the arena and flush; then overwrite and add shards until many of
    the post-flush versions were written back to swap (new extents), and do not flush."""
    with connect(daemon) as client:
        sizes = [4 * MIB - 4096 * (i % 3) - 17 * i for i in range(12)]
        for index, nbytes in enumerate(sizes):
            write(client, flushed, f"s{index}", nbytes)
        client.flush(tag)
        flushed_stats = client.stats()["swap"]
        after: dict[str, bytes] = {}
        for index in range(0, 12, 2):
            write(client, after, f"s{index}", sizes[index])  # new versions, same ids
        for index in range(6):
            write(client, after, f"new{round_index}.{index}", 3 * MIB + index)
        scribbled = client.stats()["swap"]
        # The post-flush bytes really reached the swap files (copy-on-write extents).
        assert scribbled["writeback_nbytes"] - flushed_stats["writeback_nbytes"] >= 8 * MIB
        assert all(after[i] != flushed[i] for i in after if i in flushed)


def check_recovered(daemon: PrivateDaemon, flushed: dict[str, bytes], round_index: int) -> None:
    with connect(daemon) as client:
        stats = client.stats()
        assert stats["num_shards"] == len(flushed)
        assert stats["residency"]["nvme"] == len(flushed)
        assert read_digests(client, sorted(flushed)) == flushed
        for index in range(6):
            with pytest.raises(UnknownShardError):
                client.get(f"new{round_index}.{index}")  # written after the flush: gone


def test_kill_after_flush_then_recover_restores_exactly_the_flush(swap_root: Path) -> None:
    flushed: dict[str, bytes] = {}
    first = start(swap_root, "run1")
    write_flush_then_scribble(first, flushed, "step-1", 1)
    kill_daemon(first)

    second = start(swap_root, "run2", "--recover")
    check_recovered(second, flushed, 1)
    # A second crash cycle on the recovered job: its extents, the deferred frees of the
    # old manifest and the new manifest must all stay consistent.
    write_flush_then_scribble(second, flushed, "step-2", 2)
    kill_daemon(second)

    with stopped_cleanly(start(swap_root, "run3", "--recover")) as third:
        check_recovered(third, flushed, 2)
        with connect(third) as client:  # the recovered job is fully usable
            write(client, flushed, "s0", 4 * MIB)
            client.flush("step-3")
            assert read_digests(client, sorted(flushed)) == flushed


def test_restart_without_recover_refuses_the_old_job_at_hello(swap_root: Path) -> None:
    with stopped_cleanly(start(swap_root, "run1")) as first, connect(first) as client:
        write(client, {}, "s0", MIB)
        client.flush("kept")
    with stopped_cleanly(start(swap_root, "run2")) as second:
        with pytest.raises(ShardExistsError) as refused:
            connect(second)
        message = refused.value.message
        assert "--recover" in message and "offloadd gc" in message and JOB in message
        with connect(second, job="another-job") as other:  # the daemon serves other jobs
            digests: dict[str, bytes] = {}
            write(other, digests, "x", MIB + 1)
            assert read_digests(other, ["x"]) == digests


# -- rank crash while holding leases ---------------------------------------------------


def test_killed_rank_frees_its_leases_and_leaves_data_intact(swap_root: Path) -> None:
    with stopped_cleanly(start(swap_root, "run")) as daemon:
        digests: dict[str, bytes] = {}
        with connect(daemon, rank=1) as setup:
            for index in range(8):  # 2x the arena: half of them on swap
                write(setup, digests, f"s{index}", 4 * MIB - index * 5000)
        rank = subprocess.Popen([sys.executable, __file__, "hold", daemon.socket_path],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert rank.stdout is not None
            line = rank.stdout.readline()
            assert line.strip() == "holding", rank.stderr.read() if rank.stderr else line
            with connect(daemon, rank=0) as observer:
                assert observer.stats()["leased_nbytes"] > 0
                os.kill(rank.pid, signal.SIGKILL)
                rank.wait(30)
                deadline_polls = 0
                while observer.stats()["sessions"] > 1 and deadline_polls < 2000:
                    deadline_polls += 1  # the daemon notices the dead socket at once
                stats = observer.stats()
                assert stats["sessions"] == 1
                assert stats["leased_nbytes"] == 0
        finally:
            if rank.poll() is None:
                rank.kill()
            rank.communicate()
        with connect(daemon, rank=1) as survivor:
            intact = {i: d for i, d in digests.items() if i != "s2"}  # s2 was leased for writing
            assert read_digests(survivor, sorted(intact)) == intact
            with survivor.acquire("s2", "w") as lease:  # the writer's lease is gone too
                lease.view[:5] = b"fresh"
            assert survivor.get("s2")[:5] == b"fresh"
            assert survivor.stats()["leased_nbytes"] == 0


def hold_leases(socket_path: str) -> None:
    """Rank 1: lease shards (read and write), leave an acquire of swapped shards in flight,
    scribble on the write lease, say "holding" and wait to be killed."""
    from offloadd import protocol as p

    client = connect_raw(socket_path)
    readers = client.acquire_many(["s7", "s6"], "r")  # resident
    writer = client.acquire("s2", "w")  # read in from swap; 12 of 16 MiB leased now
    writer.view[:4096] = b"\xff" * 4096
    client._send(p.Acquire(0, ["s0"], "r"))  # a swap read likely in flight when we die
    print("holding", flush=True)
    assert readers and writer
    signal.pause()


def connect_raw(socket_path: str) -> OffloadClient:
    return OffloadClient.connect(socket_path, job=JOB, rank=1, world_size=2,
                                 arena_nbytes=ARENA_NBYTES, timeout_s=30)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "hold":
    hold_leases(sys.argv[2])
