"""One job's view of the NVMe tier: eviction, read-in, write-back, prefetch and flush.

Every transition of a shard's residency happens here, each in one small
method: ``write_back`` (ARENA_DIRTY -> WRITING -> ARENA_CLEAN), ``evict``
(ARENA_CLEAN -> NVME), ``read_in`` (NVME -> READING -> ARENA_CLEAN). While
IO is in flight the shard holds a pin and an ``io`` future, so it is never
chosen as a victim and a writer waits for the write-back to finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from pathlib import Path
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from offloadd.errors import ChecksumError, OverBudgetError, OffloadError
from offloadd.nvme import MANIFEST, MANIFEST_FORMAT, PREFETCH_HORIZON_S, Chunk, JobFile, SwapPlacement
from offloadd.scheduler import AccessTrace, Priority, pick_victims
from offloadd.shards import Residency, Shard, ShardTable

if TYPE_CHECKING:
    from offloadd.nvme import SwapSpace

log = logging.getLogger(__name__)
MAX_PREFETCH_TASKS = 16
T = TypeVar("T")


class JobTier:
    """Implements jobs.SwapTier for one job."""

    def __init__(self, space: SwapSpace, job: str, files: list[JobFile]) -> None:
        self.space = space
        self.job = job
        self.files = files
        self.chunk_nbytes = space.config.chunk_size
        self.traces: dict[int, AccessTrace] = {}
        self.room_lock = asyncio.Lock()
        self.flush_lock = asyncio.Lock()
        self.deferred: list[SwapPlacement] = []
        self.prefetching: set[Shard] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._stripe = 0

    # -- chunks -------------------------------------------------------------------

    def _chunk_spans(self, shard: Shard) -> list[tuple[int, int]]:
        total = shard.arena_nbytes
        return [(start, min(self.chunk_nbytes, total - start))
                for start in range(0, total, self.chunk_nbytes)]

    def _view(self, table: ShardTable, shard: Shard, start: int, nbytes: int) -> memoryview:
        assert shard.offset is not None
        return table.arena.slice(shard.offset + start, nbytes)

    async def _write_chunk(self, table: ShardTable, shard: Shard, index: int, start: int,
                           nbytes: int, priority: Priority) -> Chunk:
        dir_index = (self._stripe + index) % len(self.files)
        jobfile = self.files[dir_index]
        offset = await jobfile.alloc(nbytes)
        chunk = Chunk(dir_index, offset, nbytes, 0)
        try:
            view = self._view(table, shard, start, nbytes)
            chunk.checksum = await self.space.checksum(view)
            await self.space.io("write", jobfile, offset, view, priority)
        except BaseException:
            jobfile.free(chunk)
            raise
        return chunk

    async def _read_chunk(self, table: ShardTable, shard: Shard, chunk: Chunk, start: int,
                          priority: Priority) -> None:
        view = self._view(table, shard, start, chunk.nbytes)
        await self.space.io("read", self.files[chunk.dir_index], chunk.offset, view, priority)
        if await self.space.checksum(view) != chunk.checksum:
            self.space.counters.checksum_failures += 1
            raise ChecksumError(
                f"shard {shard.shard_id!r}: swap chunk at {chunk.offset} in "
                f"{self.files[chunk.dir_index].path} failed its checksum; the swap copy is "
                "corrupt (check the drive), the shard's last flushed state is lost",
                [shard.shard_id])

    def _free_placement(self, placement: SwapPlacement | None) -> None:
        if placement is None:
            return
        if placement.in_manifest:
            self.deferred.append(placement)  # the last flush still names these extents
            return
        for chunk in placement.chunks:
            self.files[chunk.dir_index].free(chunk)

    # -- residency transitions ----------------------------------------------------------

    def _begin_io(self, shard: Shard, state: Residency) -> None:
        shard.io = asyncio.get_running_loop().create_future()
        shard.pins += 1
        shard.residency = state

    @staticmethod
    def _end_io(shard: Shard) -> None:
        shard.pins -= 1
        future, shard.io = shard.io, None
        if future is not None and not future.done():
            future.set_result(None)

    async def write_back(self, table: ShardTable, shard: Shard, priority: Priority) -> bool:
        """Persist a dirty in-arena shard; False if it was busy or leased for writing."""
        if shard.io is not None or shard.writer or not shard.in_arena:
            return False
        self._begin_io(shard, Residency.WRITING)
        await _run_to_completion(self._write_back(table, shard, priority))
        return True

    async def _write_back(self, table: ShardTable, shard: Shard, priority: Priority) -> None:
        spans = self._chunk_spans(shard)
        self._stripe = (self._stripe + 1) % len(self.files)
        try:
            results = await _settle_all(
                self._write_chunk(table, shard, i, start, nbytes, priority)
                for i, (start, nbytes) in enumerate(spans))
            chunks = [r for r in results if isinstance(r, Chunk)]
            if len(chunks) < len(results):
                for chunk in chunks:  # a partial copy is worthless: give its extents back
                    self.files[chunk.dir_index].free(chunk)
                raise _first_error(results)
        except BaseException:
            shard.residency = Residency.ARENA_DIRTY
            self._end_io(shard)
            raise
        self._free_placement(shard.swap)
        shard.swap = SwapPlacement(chunks, shard.version)
        shard.residency = Residency.ARENA_CLEAN
        self.space.counters.writeback_nbytes += shard.arena_nbytes
        self._end_io(shard)

    async def evict(self, table: ShardTable, shard: Shard, priority: Priority) -> None:
        reason = "clean"
        if shard.residency is Residency.ARENA_DIRTY:
            if not await self.write_back(table, shard, priority):
                return
            reason = "writeback"
        if not shard.evictable or shard.residency is not Residency.ARENA_CLEAN:
            return  # leased or dirtied again while we wrote it back
        table.unplace(shard)
        shard.residency = Residency.NVME
        if shard.prefetched:
            shard.prefetched = False
            self.space.counters.prefetch_wasted += 1
        self.space.counters.evictions.add((reason,))

    def next_use_s(self, shard: Shard) -> float:
        trace = self.traces.get(shard.rank)
        return trace.next_use_s(shard) if trace is not None and trace.known else math.inf

    async def make_room(self, table: ShardTable, nbytes: int,
                        not_before_s: float | None = None,
                        priority: Priority = Priority.DEMAND) -> bool:
        """Evict until one free extent of ``nbytes`` exists; waits on IO in flight if needed.

        Returns False only for a prefetch (``not_before_s`` set) that would have to
        evict something needed sooner. Raises OverBudgetError when leases and pins
        hold so much of the arena that waiting cannot help.
        """
        need = max(nbytes, 1)
        allocator = table.arena.allocator
        while True:
            async with self.room_lock:
                if allocator.largest_free() >= need:
                    return True
                candidates = [(s, self.next_use_s(s)) for s in table.shards.values()
                              if s.evictable]
                victims = pick_victims(candidates, need - allocator.free_nbytes
                                       if allocator.free_nbytes < need else need, not_before_s)
                if victims:
                    await asyncio.gather(*(self.evict(table, v, priority) for v in victims))
                    continue
                if not_before_s is not None:
                    return False
                progress = [s.io for s in table.shards.values() if s.io is not None
                            and (s.residency is Residency.WRITING or s.offset is not None)]
            if not progress:
                raise OverBudgetError(
                    f"job {self.job!r}: no evictable shard can make room for {need} bytes "
                    f"(arena {table.arena.nbytes}, leased {table.leased_nbytes()}); release "
                    "leases or acquire fewer shards at once")
            await asyncio.wait([asyncio.shield(f) for f in progress],
                               return_when=asyncio.FIRST_COMPLETED)

    async def read_in(self, table: ShardTable, shard: Shard,
                      priority: Priority = Priority.DEMAND, not_before_s: float | None = None
                      ) -> None:
        """Bring a swapped-out shard back into the arena, verifying every chunk."""
        while shard.io is not None and not shard.in_arena:
            if priority is Priority.DEMAND and shard in self.prefetching:
                self.space.counters.prefetch_late += 1
                self.prefetching.discard(shard)
            await asyncio.shield(shard.io)
        if shard.in_arena or shard.swap is None:
            return
        if priority is Priority.DEMAND:
            self.space.counters.demand_reads += 1
        self._begin_io(shard, Residency.READING)
        await _run_to_completion(self._read_in(table, shard, priority, not_before_s))

    async def _read_in(self, table: ShardTable, shard: Shard, priority: Priority,
                       not_before_s: float | None) -> None:
        assert shard.swap is not None
        try:
            while not table.try_place(shard):
                if not await self.make_room(table, shard.arena_nbytes, not_before_s, priority):
                    shard.residency = Residency.NVME
                    return
            results = await _settle_all(
                self._read_chunk(table, shard, chunk, start, priority)
                for chunk, (start, _n) in zip(shard.swap.chunks, self._chunk_spans(shard)))
            if any(isinstance(r, BaseException) for r in results):
                raise _first_error(results)
        except BaseException:
            if shard.offset is not None:
                table.unplace(shard)
            shard.residency = Residency.NVME
            raise
        finally:
            self._end_io(shard)
        shard.residency = Residency.ARENA_CLEAN
        shard.prefetched = priority is Priority.PREFETCH

    # -- learned and explicit prefetch ------------------------------------------------

    def step_begin(self, table: ShardTable, rank: int) -> None:
        self.traces.setdefault(rank, AccessTrace()).begin_step()

    def note_access(self, table: ShardTable, shard: Shard) -> None:
        trace = self.traces.get(shard.rank)
        if trace is not None:
            trace.record(shard, time.monotonic())
        if shard.prefetched:
            shard.prefetched = False
            self.space.counters.prefetch_hits += 1
        self.prefetching.discard(shard)

    def after_access(self, table: ShardTable, rank: int) -> None:
        trace = self.traces.get(rank)
        if trace is None or not trace.known:
            return
        horizon = min(PREFETCH_HORIZON_S, max(trace.previous_s, 0.05))
        for shard, due in trace.upcoming(table.arena.nbytes // 2, horizon):
            if len(self.tasks) >= MAX_PREFETCH_TASKS:
                return
            self._start_prefetch(table, shard, due)

    def prefetch(self, table: ShardTable, shards: list[Shard], deadline_s: float) -> None:
        for shard in shards:
            self._start_prefetch(table, shard, max(deadline_s, 0.0))

    def _start_prefetch(self, table: ShardTable, shard: Shard, due_s: float) -> None:
        if shard.in_arena or shard.io is not None or shard.swap is None:
            return
        self.space.counters.prefetch_issued += 1
        self.prefetching.add(shard)
        task = asyncio.ensure_future(self._prefetch(table, shard, due_s))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _prefetch(self, table: ShardTable, shard: Shard, due_s: float) -> None:
        try:
            await self.read_in(table, shard, Priority.PREFETCH, not_before_s=due_s)
        except OffloadError as exc:  # the demand read will retry and report it
            log.warning("event=prefetch_failed job=%s shard=%s error=%r",
                        self.job, shard.shard_id, exc.message)
        finally:
            if not shard.in_arena:
                self.prefetching.discard(shard)

    def note_stall(self, rank: int, seconds: float) -> None:
        self.space.counters.stall_seconds.add((self.job, str(rank)), seconds)

    # -- flush and recovery -----------------------------------------------------------

    async def flush(self, table: ShardTable, tag: str | None) -> int:
        async with self.flush_lock:
            try:
                written = await self._flush(table, tag)
            except BaseException:
                self.space.counters.flushes.add(("error",))
                raise
            self.space.counters.flushes.add(("ok",))
            return written

    async def _flush(self, table: ShardTable, tag: str | None) -> int:
        busy = [s.io for s in table.shards.values() if s.io is not None]
        if busy:
            await asyncio.wait([asyncio.shield(f) for f in busy])
        dirty = [s for s in table.shards.values()
                 if s.residency is Residency.ARENA_DIRTY and not s.writer]
        results = await asyncio.gather(*(self.write_back(table, s, Priority.WRITEBACK)
                                         for s in dirty))
        loop = asyncio.get_running_loop()
        for jobfile in self.files:
            await loop.run_in_executor(None, os.fdatasync, jobfile.fd)
        manifest = self._manifest(table, tag)
        await loop.run_in_executor(None, write_atomically, self.manifest_path(), manifest)
        self._retire_old_manifest(table)
        skipped = [s.shard_id for s in table.shards.values() if s.writer]
        if skipped:
            log.warning("event=flush_skipped_writers job=%s shards=%s", self.job, skipped[:8])
        return sum(1 for ok in results if ok)

    def manifest_path(self) -> Path:
        return self.files[0].path.parent / MANIFEST

    def _manifest(self, table: ShardTable, tag: str | None) -> bytes:
        shards = [
            {"rank": s.rank, "id": s.shard_id, "nbytes": s.nbytes, "dtype": s.dtype,
             "version": s.swap.version,
             "chunks": [[c.dir_index, c.offset, c.nbytes, c.checksum] for c in s.swap.chunks]}
            for s in table.shards.values() if s.swap is not None
        ]
        return json.dumps({
            "format": MANIFEST_FORMAT, "job": self.job, "tag": tag, "created": time.time(),
            "arena_nbytes": table.arena.nbytes, "chunk_nbytes": self.chunk_nbytes,
            "dirs": [str(f.dir.path) for f in self.files], "shards": shards,
        }).encode()

    def _retire_old_manifest(self, table: ShardTable) -> None:
        deferred, self.deferred = self.deferred, []
        for placement in deferred:
            placement.in_manifest = False
            self._free_placement(placement)
        for shard in table.shards.values():
            if shard.swap is not None:
                shard.swap.in_manifest = True

    def load_manifest(self, table: ShardTable, manifest: dict[str, Any]) -> int:
        dirs = [str(f.dir.path) for f in self.files]
        if manifest["dirs"] != dirs or manifest["format"] != MANIFEST_FORMAT:
            raise ValueError(f"manifest of job {self.job!r} names swap dirs {manifest['dirs']}, "
                             f"daemon has {dirs}; start with the same --swap-dir list")
        for entry in manifest["shards"]:
            shard = table.create(entry["rank"], entry["id"], entry["nbytes"], entry["dtype"])
            chunks = [Chunk(*c) for c in entry["chunks"]]
            for chunk in chunks:
                self.files[chunk.dir_index].allocator.reserve(chunk.offset, chunk.nbytes)
            shard.swap = SwapPlacement(chunks, entry["version"], in_manifest=True)
            shard.version = entry["version"]
        return len(manifest["shards"])

    def forget(self, table: ShardTable, shard: Shard) -> None:
        self._free_placement(shard.swap)
        shard.swap = None
        self.prefetching.discard(shard)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for jobfile in self.files:
            jobfile.close()


async def _settle_all(coros: Iterable[Awaitable[T]]) -> list[T | BaseException]:
    """Run every chunk IO to its end, failed or not, and return results or exceptions.

    Hazard: plain ``gather`` returns at the first failure while sibling chunks are
    still in flight; the caller would then free an arena range (or swap extent)
    that the kernel is still reading into or writing from.
    """
    return await asyncio.gather(*coros, return_exceptions=True)


def _first_error(results: list[Any]) -> BaseException:
    errors = [r for r in results if isinstance(r, BaseException)]
    # An OffloadError says more to the client than a cancellation of its sibling.
    return next((e for e in errors if isinstance(e, OffloadError)), errors[0])


async def _run_to_completion(transition: Awaitable[None]) -> None:
    """Run a residency transition in its own task that the caller cannot cancel.

    Hazard: a transition owns IO in flight on arena memory. If a rank dies
    mid-acquire, its session's task is cancelled; were the transition cancelled
    with it, it would unplace an arena range the kernel is still filling. The
    caller still sees its cancellation at once; the transition finishes on its own
    and leaves the shard in a consistent state.
    """
    task = asyncio.ensure_future(transition)
    task.add_done_callback(_consume_orphan_result)
    await asyncio.shield(task)


def _consume_orphan_result(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved; whoever awaited it (if anyone) got it already


def write_atomically(path: Path, data: bytes) -> None:
    """Write temp, fsync, rename, fsync the directory: the old or the new file, never half."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
