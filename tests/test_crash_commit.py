"""The flush commit against real swap files, driven in-process at its dangerous moments.

A flush is: write back dirty shards, snapshot the swap placements, fdatasync,
write the manifest (temp, fsync, rename), retire the previous manifest. These
tests hold the commit inside its sync or its manifest write (a gate executor
pauses exactly that call in its thread), act on the job in that window as a busy
rank would, then recover the job from the manifest on disk as ``--recover`` does
after a crash, and read it back. Nothing is timed.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from offloadd.arena import Arena
from offloadd.config import DaemonConfig
from offloadd.jobs import Job
from offloadd.metrics import DaemonMetrics
from offloadd.nvme import SwapSpace
from offloadd.shards import Lease, Shard
from offloadd.tier import JobTier, write_atomically

KIB = 1 << 10
CHUNK_NBYTES = 64 * KIB
SHARD_NBYTES = 3 * CHUNK_NBYTES + 4 * KIB  # four chunks, striped over both dirs
ARENA_NBYTES = 4 << 20
JOB = "commit"


class GateExecutor(ThreadPoolExecutor):
    """Runs every call, but holds those ``matches`` selects until ``open()``.

    The held call waits in its worker thread, as a slow drive would keep it there,
    so the event loop serves other work in exactly that window.
    """

    def __init__(self, matches: Callable[[Any], bool]) -> None:
        super().__init__(4)
        self.matches = matches
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.killed = False
        """Set before ``opened``: the held call never runs, as if the process died."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        if not self.matches(fn):
            return super().submit(fn, *args, **kwargs)

        def held() -> Any:
            self.entered.set()
            self.opened.wait(30)
            if self.killed:
                raise RuntimeError("the process was killed before this call ran")
            return fn(*args, **kwargs)

        return super().submit(held)

    async def wait_entered(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, 30)
        assert self.entered.is_set()


def is_sync(fn: Any) -> bool:
    return getattr(fn, "__func__", None) is SwapSpace.sync


def is_manifest_write(fn: Any) -> bool:
    return fn is write_atomically


class Rank:
    """One rank of the job, using the job's API as a session does."""

    def __init__(self, job: Job, rank: int = 0) -> None:
        self.job = job
        self.rank = rank
        self.leases: dict[Shard, Lease] = {}

    async def put(self, shard_id: str, data: bytes) -> None:
        placed = self.job.alloc(self.rank, [shard_id], [len(data)], ["uint8"], self.leases, "w")
        if not hasattr(placed, "offsets"):
            placed = await placed  # type: ignore[misc]
        self.job.arena.slice(placed.offsets[0], len(data))[:] = data  # type: ignore[union-attr]
        self.job.release(self.rank, [shard_id], True, self.leases)

    async def get(self, shard_id: str) -> bytes:
        placed = self.job.acquire(self.rank, [shard_id], "r", self.leases)
        if not hasattr(placed, "offsets"):
            placed = await placed  # type: ignore[misc]
        data = bytes(self.job.arena.slice(placed.offsets[0], placed.nbytes[0]))  # type: ignore[union-attr]
        self.job.release(self.rank, [shard_id], False, self.leases)
        return data

    async def drop(self, shard_id: str) -> None:
        pending = self.job.drop(self.rank, [shard_id])
        if pending is not None:
            await pending

    async def write_back(self, shard_id: str) -> None:
        tier = self.tier
        shard = self.job.table.get(self.rank, shard_id)
        assert await tier.write_back(self.job.table, shard, tier_priority())

    @property
    def tier(self) -> JobTier:
        assert isinstance(self.job.tier, JobTier)
        return self.job.tier


def tier_priority() -> Any:
    from offloadd.scheduler import Priority

    return Priority.WRITEBACK


async def open_job(root: Path, *, recovering: bool = False) -> tuple[SwapSpace, Job]:
    config = DaemonConfig(swap_dirs=[str(root / "nvme0"), str(root / "nvme1")],
                          chunk_size=CHUNK_NBYTES, hash_threads=0, swap_size=1 << 30)
    space = SwapSpace(config, DaemonMetrics())
    await space.open()
    tier = space.tier_for(JOB, recovering=recovering)
    job = Job(JOB, Arena(JOB, ARENA_NBYTES, lock=False), tier)
    if recovering:
        manifest = json.loads(tier.manifest_path().read_text())
        tier.load_manifest(job.table, manifest)
    return space, job


async def close_job(space: SwapSpace, job: Job) -> None:
    """Stop without flushing: what a SIGKILL leaves on disk is what the files hold."""
    await space.close()
    job.arena.close()


async def recovered(root: Path, ids: list[str]) -> dict[str, bytes]:
    space, job = await open_job(root, recovering=True)
    try:
        rank = Rank(job)
        return {shard_id: await rank.get(shard_id) for shard_id in ids}
    finally:
        await close_job(space, job)


def manifest_ids(root: Path) -> set[str]:
    manifest = json.loads((root / "nvme0" / "offloadd" / JOB / "manifest.json").read_text())
    return {entry["id"] for entry in manifest["shards"]}


async def with_gate(gate: GateExecutor, body: Callable[[], Any]) -> Any:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(gate)
    return await body()


# -- defect 1: extents a manifest in commit names are never reused ---------------------


def test_extents_a_committing_manifest_names_are_not_reused(swap_root: Path, run_async) -> None:  # type: ignore[no-untyped-def]
    flushed = os.urandom(SHARD_NBYTES)

    async def scenario() -> None:
        space, job = await open_job(swap_root)
        rank = Rank(job)
        await rank.put("a", flushed)
        gate = GateExecutor(is_manifest_write)
        asyncio.get_running_loop().set_default_executor(gate)
        flush = asyncio.ensure_future(job.flush("one"))
        await gate.wait_entered()  # the manifest naming "a" is being written
        await rank.drop("a")  # a busy rank drops "a" and writes "c" back in that window
        await rank.put("c", os.urandom(SHARD_NBYTES))
        await rank.write_back("c")
        gate.opened.set()
        await flush
        await close_job(space, job)

    run_async(scenario())
    assert manifest_ids(swap_root) == {"a"}
    assert run_async(recovered(swap_root, ["a"])) == {"a": flushed}


def test_old_extents_stay_until_the_new_manifest_is_durable(swap_root: Path, run_async) -> None:  # type: ignore[no-untyped-def]
    first = os.urandom(SHARD_NBYTES)

    async def scenario() -> None:
        space, job = await open_job(swap_root)
        rank = Rank(job)
        await rank.put("a", first)
        await job.flush("one")
        await rank.put("a", os.urandom(SHARD_NBYTES))
        await rank.put("b", os.urandom(SHARD_NBYTES))
        gate = GateExecutor(is_manifest_write)
        asyncio.get_running_loop().set_default_executor(gate)
        flush = asyncio.ensure_future(job.flush("two"))
        await gate.wait_entered()
        # The crash comes while the second manifest is written: only the first is durable.
        # Meanwhile the busy rank rewrites "a" again and writes many new shards back.
        await rank.put("a", os.urandom(SHARD_NBYTES))
        await rank.write_back("a")
        for index in range(6):
            await rank.put(f"n{index}", os.urandom(SHARD_NBYTES))
            await rank.write_back(f"n{index}")
        gate.killed = True  # killed before the rename: the second manifest never lands
        gate.opened.set()
        await asyncio.gather(flush, return_exceptions=True)
        await close_job(space, job)

    run_async(scenario())
    assert run_async(recovered(swap_root, ["a"])) == {"a": first}


# -- defect 2: a flush whose client goes away still commits as one unit ---------------


def test_a_cancelled_flush_commits_whole(swap_root: Path, run_async) -> None:  # type: ignore[no-untyped-def]
    flushed = os.urandom(SHARD_NBYTES)

    async def scenario() -> None:
        space, job = await open_job(swap_root)
        rank = Rank(job)
        await rank.put("a", flushed)
        gate = GateExecutor(is_manifest_write)
        asyncio.get_running_loop().set_default_executor(gate)
        flush = asyncio.ensure_future(job.flush("one"))
        await gate.wait_entered()
        flush.cancel()  # the session of the flushing rank died
        await asyncio.gather(flush, return_exceptions=True)
        gate.opened.set()
        async with rank.tier.flush_lock:  # the commit ran on to its end
            assert rank.tier.generation == 1
        await rank.drop("a")
        for index in range(4):
            await rank.put(f"n{index}", os.urandom(SHARD_NBYTES))
            await rank.write_back(f"n{index}")
        await close_job(space, job)

    run_async(scenario())
    assert run_async(recovered(swap_root, ["a"])) == {"a": flushed}


# -- defect 3: the manifest names only what the sync covered --------------------------


def test_a_write_back_during_the_sync_is_not_named(swap_root: Path, run_async) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        space, job = await open_job(swap_root)
        rank = Rank(job)
        await rank.put("a", os.urandom(SHARD_NBYTES))
        gate = GateExecutor(is_sync)
        asyncio.get_running_loop().set_default_executor(gate)
        flush = asyncio.ensure_future(job.flush("one"))
        await gate.wait_entered()  # fdatasync in progress
        await rank.put("late", os.urandom(SHARD_NBYTES))
        await rank.write_back("late")  # completes after the sync began: not covered by it
        gate.opened.set()
        await flush
        await close_job(space, job)

    run_async(scenario())
    assert manifest_ids(swap_root) == {"a"}
