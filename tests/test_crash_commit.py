"""The flush commit of one job's NVMe tier, driven in-process against real swap files.

Issue 12, defects 1-6, and issue 13 item 3 (torn writes). A gate on the tier's
fdatasync holds a commit half-way so the test can do, deterministically, what a
busy rank does by chance: write back, evict and drop shards while a manifest is
being made durable, or disconnect the client that asked for the flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import xxhash

from offloadd.config import DaemonConfig
from offloadd.errors import SwapIOError, TornShardError
from offloadd.memory.shards import Lease, Shard
from offloadd.metrics import DaemonMetrics
from offloadd.protocol import Placed
from offloadd.service.jobs import Job
from offloadd.service.registry import JobRegistry
from offloadd.swap.nvme import SwapSpace
from offloadd.swap.scheduler import Priority
from offloadd.swap.tier import open_tier
from offloadd.swap.tier_io import chunk_seed

KIB = 1 << 10
ARENA_NBYTES = 1 << 20
CHUNK_NBYTES = 64 * KIB
SHARD_NBYTES = 150 * KIB  # three chunks, the last one short
JOB = "commit"


class Tier:
    """A SwapSpace with one job, and a gate that can hold its fdatasync calls."""

    def __init__(self, root: Path, chunk_nbytes: int = CHUNK_NBYTES) -> None:
        config = DaemonConfig(swap_dirs=[str(root / "nvme0"), str(root / "nvme1")],
                              io_engine="python", chunk_size=chunk_nbytes, mlock=False,
                              arena_hugepages="off")
        self.space = SwapSpace(config, DaemonMetrics())
        self.registry = JobRegistry(4 * ARENA_NBYTES, 1.0, lock=False)
        self.leases: dict[Shard, Lease] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.syncing = asyncio.Event()
        self.job: Job

    async def open(self, *, recover: dict[str, Any] | None = None) -> Tier:
        await self.space.open()
        real_sync = self.space.sync

        async def gated_sync(jobfile: Any) -> None:
            self.syncing.set()
            await self.gate.wait()
            await real_sync(jobfile)

        self.space.sync = gated_sync  # type: ignore[method-assign]
        self.job, _ = self.registry.open(
            JOB, ARENA_NBYTES,
            make_tier=lambda: open_tier(self.space, JOB, recovering=bool(recover)))
        if recover is not None:
            self.tier.load_manifest(self.job.table, recover)
        return self

    @property
    def tier(self) -> Any:
        return self.job.tier

    async def close(self) -> None:
        await self.space.close()
        self.registry.close()

    async def acquire(self, shard_id: str, mode: str, nbytes: int = SHARD_NBYTES) -> memoryview:
        result = self.job.alloc(0, [shard_id], [nbytes], ["uint8"], self.leases, mode)
        if not isinstance(result, Placed):
            await result
        shard = self.job.table.get(0, shard_id)
        assert shard.offset is not None
        return self.job.arena.slice(shard.offset, nbytes)

    async def put(self, shard_id: str, fill: int, nbytes: int = SHARD_NBYTES) -> None:
        view = await self.acquire(shard_id, "w", nbytes)
        view[:] = bytes([fill]) * nbytes
        self.job.release(0, [shard_id], True, self.leases)

    async def get(self, shard_id: str) -> bytes:
        view = await self.acquire(shard_id, "r")
        data = bytes(view)
        self.job.release(0, [shard_id], False, self.leases)
        return data

    async def write_back(self, shard_id: str) -> None:
        shard = self.job.table.get(0, shard_id)
        assert await self.tier.write_back(self.job.table, shard, Priority.WRITEBACK)

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.tier.manifest_path().read_text())

    def named_chunks_intact(self) -> bool:
        """Every chunk the manifest on disk names still holds bytes matching its checksum."""
        files = [f.path for f in self.tier.files]
        for entry in self.manifest()["shards"]:
            for index, (dir_index, offset, nbytes, checksum) in enumerate(entry["chunks"]):
                seed = chunk_seed(self.tier.job, entry["rank"], entry["id"], entry["version"],
                                  index)
                with open(files[dir_index], "rb") as handle:
                    handle.seek(offset)
                    if xxhash.xxh3_64_intdigest(handle.read(nbytes), seed) != checksum:
                        return False
        return True


@pytest.fixture
def tier_at(tmp_path: Path, run_async: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """run(body) with an open Tier in tmp_path; the body is an async fn of the Tier."""

    @contextmanager
    def unused() -> Iterator[None]:
        yield

    def run(body: Callable[[Tier], Any], **kwargs: Any) -> Any:
        async def scenario() -> Any:
            tier = await Tier(tmp_path, **kwargs).open()
            try:
                return await body(tier)
            finally:
                await tier.close()
        return run_async(scenario())

    with unused():
        yield run


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


# -- defects 1 and 3: what a commit names is what was synced, and it is never reused -------


def test_a_commit_names_its_snapshot_and_its_extents_survive_writes_and_drops(tier_at) -> None:
    async def body(t: Tier) -> None:
        for fill, shard_id in enumerate(["a", "b", "c"], 1):
            await t.put(shard_id, fill)
        await t.tier.flush(t.job.table, "one")
        await t.put("a", 0x22)
        await t.write_back("a")  # a@v2 on swap, not yet durable
        t.gate.clear()
        t.syncing.clear()
        flush = asyncio.ensure_future(t.tier.flush(t.job.table, "two"))
        await t.syncing.wait()  # the commit took its snapshot and is syncing
        await t.put("a", 0x33)
        await t.write_back("a")  # a@v3 replaces a@v2, which the commit names
        t.job.drop(0, ["c"])  # c's only copy, named by both manifests
        for index in range(12):  # allocations that would reuse any freed extent
            await t.put(f"new{index}", 0x40 + index)
            await t.write_back(f"new{index}")
        t.gate.set()
        await flush
        named = {entry["id"]: entry for entry in t.manifest()["shards"]}
        assert named["a"]["version"] == 2  # the snapshot, not what completed during the sync
        assert "c" in named and not any(i.startswith("new") for i in named)
        assert t.named_chunks_intact()
        for index in range(12, 24):  # after the commit: the durable manifest still holds
            await t.put(f"new{index}", 0x40 + index)
            await t.write_back(f"new{index}")
        assert t.named_chunks_intact()

    tier_at(body)


def test_a_flush_waits_for_the_write_behind_that_took_a_shard_it_listed(tier_at) -> None:
    """test_sigkill_soak's one failure: a write-behind task made before the flush ran, but
    started after the flush listed the shard dirty, took the shard's write-back; the
    flush's own write-back then found the shard busy and skipped it, nothing waited for
    the write-behind, and the manifest named the shard's previous version."""
    async def body(t: Tier) -> None:
        await t.put("a", 1)
        await t.tier.flush(t.job.table, "one")
        await t.put("a", 2)
        shard = t.job.table.get(0, "a")
        writes_open, writing = asyncio.Event(), asyncio.Event()
        real_io = t.space.io

        async def gated_io(op: str, *args: Any, **kwargs: Any) -> int | None:
            if op == "write":
                writing.set()
                await writes_open.wait()
            return await real_io(op, *args, **kwargs)  # the checksum of the bytes moved

        t.space.io = gated_io  # type: ignore[method-assign]
        # The order of one loop iteration under load: the flush task runs first and
        # lists a, the write-behind runs next and begins a's write-back, then the
        # flush's write-back of a runs and finds a busy.
        flush = asyncio.ensure_future(t.tier.flush(t.job.table, "two"))
        behind = asyncio.ensure_future(t.tier.write_back(t.job.table, shard, Priority.WRITEBACK))
        await writing.wait()
        with contextlib.suppress(asyncio.TimeoutError):  # the commit must not start yet
            await asyncio.wait_for(t.syncing.wait(), 0.5)
        writes_open.set()
        assert await behind
        await flush
        named = {entry["id"]: entry for entry in t.manifest()["shards"]}
        assert named["a"]["version"] == shard.version  # not the version flush "one" named
        assert t.named_chunks_intact()

    tier_at(body)


# -- defect 2: a flush whose client goes away still commits as one unit -------------------


def test_a_cancelled_flush_finishes_its_commit_in_memory_and_on_disk(tier_at) -> None:
    async def body(t: Tier) -> None:
        await t.put("a", 1)
        await t.tier.flush(t.job.table, "one")
        await t.put("a", 2)
        used_before = t.tier.usage()[0]
        t.gate.clear()
        t.syncing.clear()
        flush = asyncio.ensure_future(t.tier.flush(t.job.table, "two"))
        await t.syncing.wait()
        flush.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await flush
        t.gate.set()
        async with t.tier.commit_lock:  # the commit runs on without its client
            pass
        assert t.manifest()["generation"] == t.tier.generation == 2
        assert t.manifest()["tag"] == "two"
        # Generation 1 is now manifest.prev.json, recovery's fallback: a@v1 stays reserved
        # beside a@v2 until generation 3 is durable, and then it is given back.
        assert t.tier.usage()[0] == 2 * used_before
        await t.put("a", 3)
        await t.tier.flush(t.job.table, "three")
        assert t.tier.usage()[0] == 2 * used_before
        assert t.named_chunks_intact()

    tier_at(body)


# -- defect 5 and issue 13 item 3: writers in flight and torn writes -----------------------


def test_a_shard_under_a_write_lease_or_torn_is_flushed_at_its_last_version(tier_at) -> None:
    async def body(t: Tier) -> None:
        await t.put("w", 1)
        await t.put("t", 2)
        await t.tier.flush(t.job.table, "one")
        await t.acquire("never", "w")  # allocated, never committed
        t.job.release(0, ["never"], False, t.leases)
        view = await t.acquire("w", "w")
        view[:100] = b"\xee" * 100  # mid-write at flush time
        torn = await t.acquire("t", "w")
        torn[:100] = b"\xdd" * 100
        t.job.release(0, ["t"], False, t.leases, torn=True)  # the writer raised
        await t.tier.flush(t.job.table, "two")
        named = {entry["id"]: entry for entry in t.manifest()["shards"]}
        assert set(named) == {"w", "t"}
        assert named["w"]["version"] == 1 and named["t"]["version"] == 1
        assert t.named_chunks_intact()
        with pytest.raises(TornShardError):
            await t.get("t")
        t.job.release(0, ["w"], True, t.leases)
        await t.put("t", 3)  # written again: readable, torn no more
        assert await t.get("t") == bytes([3]) * SHARD_NBYTES

    tier_at(body)


# -- defect 6: a failed fdatasync is fail-stop for the job ---------------------------------


def test_a_failed_sync_keeps_shards_dirty_and_writes_no_more_manifests(tier_at) -> None:
    async def body(t: Tier) -> None:
        await t.put("a", 1)
        await t.tier.flush(t.job.table, "one")
        first = t.manifest()
        await t.put("a", 2)
        t.space.sync_fault_nth = 1
        with pytest.raises(SwapIOError, match="writes no more manifests"):
            await t.tier.flush(t.job.table, "two")
        assert t.job.table.get(0, "a").residency.value == "arena_dirty"
        with pytest.raises(SwapIOError, match="--recover"):
            await t.tier.flush(t.job.table, "three")  # no sync fault left: still refused
        assert t.manifest() == first
        assert await t.get("a") == bytes([2]) * SHARD_NBYTES  # nothing lost in the arena

    tier_at(body)


# -- defect 4: recovery uses the geometry the manifest recorded ----------------------------


def test_recovery_under_another_chunk_size_reads_the_recorded_geometry(
        tmp_path: Path, run_async: Callable[..., Any]) -> None:
    payloads = {f"s{i}": os.urandom(SHARD_NBYTES - 999 * i) for i in range(4)}

    async def write() -> dict[str, Any]:
        t = await Tier(tmp_path, chunk_nbytes=CHUNK_NBYTES).open()
        for shard_id, payload in payloads.items():
            view = await t.acquire(shard_id, "w", len(payload))
            view[:] = payload
            t.job.release(0, [shard_id], True, t.leases)
        await t.tier.flush(t.job.table, "geometry")
        manifest = t.manifest()
        await t.close()
        return manifest

    async def recover(manifest: dict[str, Any]) -> None:
        t = await Tier(tmp_path, chunk_nbytes=4 * CHUNK_NBYTES).open(recover=manifest)
        try:
            for shard_id, payload in payloads.items():
                view = await t.acquire(shard_id, "r", len(payload))
                assert bytes(view) == payload
                t.job.release(0, [shard_id], False, t.leases)
        finally:
            await t.close()

    manifest = run_async(write())
    assert manifest["chunk_nbytes"] == CHUNK_NBYTES
    run_async(recover(manifest))
    broken = json.loads(json.dumps(manifest))
    broken["chunk_nbytes"] = 2 * CHUNK_NBYTES  # chunks no longer tile the shards

    async def refuse() -> None:
        with pytest.raises(ValueError, match="geometry"):
            await Tier(tmp_path, chunk_nbytes=CHUNK_NBYTES).open(recover=broken)

    run_async(refuse())
