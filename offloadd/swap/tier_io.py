"""One job's swap IO: chunked, checksummed write-backs and read-ins, and flush.

A shard's swap copy is written in chunks striped over the swap dirs, each checksum
seeded with its place (``chunk_seed``); a flush writes back every dirty shard, syncs
what the snapshot names and commits the manifest as the job's next generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from offloadd.errors import ChecksumError, OffloadError, SwapIOError
from offloadd.memory.shards import Chunk, Residency, Shard, ShardTable, SwapPlacement, shard_kind
from offloadd.swap.manifests import (
    discard_staged,
    keep_previous_generation,
    publish_staged,
    stage_file,
)
from offloadd.swap.nvme import MANIFEST, MANIFEST_FORMAT
from offloadd.swap.scheduler import Priority
from offloadd.swap.tier_state import TierState

log = logging.getLogger(__name__)


def chunk_seed(job: str, rank: int, shard_id: str, version: int, index: int) -> int:
    """The xxh3 seed of a chunk's checksum: its job, rank, shard, version and index.

    Hazard: a checksum of the bytes alone vouches for any chunk list that points at
    intact bytes; a manifest whose lists were swapped between two shards (or versions,
    or chunks of one shard) would serve one shard's bytes as another's. Seeded with its
    place, a chunk verifies only where it was written.
    """
    return xxhash.xxh3_64_intdigest(f"{job}\0{rank}\0{shard_id}\0{version}\0{index}".encode())


PREFETCH_ROOM_RETRIES = 4
"""Times a prefetch waits for write-backs to free room before it gives up."""
T = TypeVar("T")


class TierIO(TierState):
    """JobTier's swap IO: write_back, read_in and flush (mixed into ``tier.JobTier``)."""

    # -- chunks -------------------------------------------------------------------

    def _chunk_spans(self, shard: Shard) -> list[tuple[int, int]]:
        total = shard.arena_nbytes
        return [(start, min(self.chunk_nbytes, total - start))
                for start in range(0, total, self.chunk_nbytes)]

    def _view(self, table: ShardTable, shard: Shard, start: int, nbytes: int) -> memoryview:
        assert shard.offset is not None
        return table.arena.slice(shard.offset + start, nbytes)

    async def _write_chunk(self, table: ShardTable, shard: Shard, version: int, index: int,
                           start: int, nbytes: int, priority: Priority) -> Chunk:
        dir_index = (self._stripe + index) % len(self.files)
        jobfile = self.files[dir_index]
        offset = await jobfile.alloc(nbytes)
        chunk = Chunk(dir_index, offset, nbytes, 0)
        try:
            view = self._view(table, shard, start, nbytes)
            seed = chunk_seed(self.job, shard.rank, shard.shard_id, version, index)
            checksum = await self.space.io(
                "write", jobfile, offset, view, priority, self.space.ticket_for(shard.io, priority),
                in_place=table.arena.hugepages, seed=seed)
            assert checksum is not None  # given a seed, io returns the bytes' checksum
            chunk.checksum = checksum
            self.space.counters.kind_nbytes.add(("write", shard_kind(shard.shard_id)), nbytes)
        except BaseException:
            jobfile.free(chunk)
            raise
        return chunk

    async def _read_chunk(self, table: ShardTable, shard: Shard, placement: SwapPlacement,
                          index: int, start: int, priority: Priority) -> None:
        chunk = placement.chunks[index]
        view = self._view(table, shard, start, chunk.nbytes)
        seed = (chunk_seed(self.job, shard.rank, shard.shard_id, placement.version, index)
                if placement.bound else 0)
        checksum = await self.space.io(
            "read", self.files[chunk.dir_index], chunk.offset, view, priority,
            self.space.ticket_for(shard.io, priority), in_place=table.arena.hugepages, seed=seed)
        self.space.counters.kind_nbytes.add(("read", shard_kind(shard.shard_id)), chunk.nbytes)
        if checksum != chunk.checksum:
            self.space.counters.checksum_failures += 1
            raise ChecksumError(
                f"shard {shard.shard_id!r}: swap chunk at {chunk.offset} in "
                f"{self.files[chunk.dir_index].path} failed its checksum; the swap copy is "
                "corrupt (check the drive), the shard's last flushed state is lost",
                [shard.shard_id])

    # -- write-back and read-in -----------------------------------------------------------

    async def write_back(self, table: ShardTable, shard: Shard, priority: Priority) -> bool:
        """Persist a dirty in-arena shard; False if it was busy, leased for writing, torn,
        or dropped since the caller picked it (a flush picks its shards a loop turn earlier)."""
        if shard.io is not None or shard.writer or shard.torn or not shard.in_arena:
            return False
        if table.shards.get((shard.rank, shard.shard_id)) is not shard:
            # Hazard: a flush lists dirty shards, then writes them; a peer rank's drop
            # in between frees the arena range (the residency is left as it was).
            return False
        self._begin_io(table, shard, Residency.WRITING)
        await _run_to_completion(self._write_back(table, shard, priority))
        return True

    async def _write_back(self, table: ShardTable, shard: Shard, priority: Priority) -> None:
        spans = self._chunk_spans(shard)
        version = shard.version  # no writer holds the shard while its write-back runs
        if shard.swap is not None and shard.swap.version == version:
            self.space.counters.clean_writeback_nbytes += shard.arena_nbytes
        self._stripe = (self._stripe + 1) % len(self.files)
        try:
            results = await _settle_all(
                self._write_chunk(table, shard, version, i, start, nbytes, priority)
                for i, (start, nbytes) in enumerate(spans))
            chunks = [r for r in results if isinstance(r, Chunk)]
            if len(chunks) < len(results):
                for chunk in chunks:  # a partial copy is worthless: give its extents back
                    self.files[chunk.dir_index].free(chunk)
                raise _first_error(results)
        except BaseException:
            shard.residency = Residency.ARENA_DIRTY
            self._end_io(table, shard)
            raise
        self._free_placement(shard.swap)
        shard.swap = SwapPlacement(chunks, version)
        shard.residency = Residency.ARENA_CLEAN
        self.space.counters.writeback_nbytes += shard.arena_nbytes
        self._end_io(table, shard)

    async def read_in(self, table: ShardTable, shard: Shard,
                      priority: Priority = Priority.DEMAND, not_before_s: float | None = None
                      ) -> None:
        """Bring a swapped-out shard back into the arena, verifying every chunk."""
        late = False
        while shard.io is not None and not shard.in_arena:
            if priority is Priority.DEMAND and shard in self.prefetching:
                self.space.counters.prefetch_late += 1
                self.prefetching.discard(shard)
                late = True
            self.space.hurry(shard.io, priority)  # a write-back or prefetch we wait behind
            await asyncio.shield(shard.io)
        if late:
            self._set_prefetched(shard, False)  # counted as late, not again as a hit
        if shard.in_arena or shard.swap is None:
            return
        if priority is Priority.DEMAND:
            self.space.counters.demand_reads += 1
        self._begin_io(table, shard, Residency.READING)
        await _run_to_completion(self._read_in(table, shard, priority, not_before_s))

    async def _read_in(self, table: ShardTable, shard: Shard, priority: Priority,
                       not_before_s: float | None) -> None:
        assert shard.swap is not None
        try:
            retries = PREFETCH_ROOM_RETRIES
            while not table.try_place(shard):
                if await self.make_room(table, shard.arena_nbytes, not_before_s, priority):
                    continue
                if not self.cleaning or not retries:
                    shard.residency = Residency.NVME  # room only by evicting sooner needs
                    return
                # make_room started write-backs of dirty victims for us: worth the wait.
                retries -= 1
                await asyncio.wait(list(self.cleaning.values()),
                                   return_when=asyncio.FIRST_COMPLETED)
            placement = shard.swap
            results = await _settle_all(
                self._read_chunk(table, shard, placement, index, start, priority)
                for index, start in enumerate(_chunk_starts(placement.chunks)))
            if any(isinstance(r, BaseException) for r in results):
                raise _first_error(results)
        except BaseException:
            if shard.offset is not None:
                table.unplace(shard)
            shard.residency = Residency.NVME
            raise
        finally:
            self._end_io(table, shard)
        shard.residency = Residency.ARENA_CLEAN
        if placement.reads:
            self.space.counters.reread_nbytes += placement.nbytes
        placement.reads += 1
        self._set_prefetched(shard, priority is Priority.PREFETCH)
        if shard.prefetched:
            table.touch(shard)  # about to be used: not the LRU victim of the next prefetch

    # -- flush ---------------------------------------------------------------------------

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
        self._raise_if_failed()
        # Dirty shards are written while the IO in flight (write-behind, reads)
        # finishes; a shard whose IO left it dirty (a failed write-back) goes after.
        busy = [s for s in table.shards.values() if s.io is not None]
        results = await self._write_back_dirty(table, busy)
        results += await self._write_back_dirty(table, [])
        # Hazard: the commit renames a manifest; were it cancelled with its client
        # half-way, the file on disk and the in-memory generations would disagree.
        await _run_to_completion(self._commit(table, tag))
        skipped = [s.shard_id for s in table.shards.values() if s.writer or s.torn]
        if skipped:
            log.warning("event=flush_kept_last_version job=%s shards=%s", self.job, skipped[:8])
        return sum(1 for ok in results if ok)

    async def _commit(self, table: ShardTable, tag: str | None) -> None:
        """Snapshot, sync exactly what it names, write the manifest, retire the old one.

        Every placement the snapshot names is tagged with the new generation
        before the first await, so no write-back, eviction or drop while the
        sync runs can free (and reuse) its extents. A shard under a write lease
        or torn is named at its last written-back version; a shard never written
        back is not named at all.
        """
        async with self.commit_lock:
            self._raise_if_failed()
            gen = self.generation + 1
            named = [(s, s.swap) for s in table.shards.values() if s.swap is not None]
            placements = [placement for _s, placement in named]
            self._name_in_gen(gen, placements)
            manifest = self._manifest(table, named, tag, gen)
            try:
                for dir_index in sorted({c.dir_index for p in placements for c in p.chunks}):
                    await self.space.sync(self.files[dir_index])
            except SwapIOError as exc:
                raise self._fail_stop(table, placements, exc) from exc
            await self._write_manifest(table, placements, manifest, gen)
            # The generation before stays on disk as manifest.prev.json, recovery's
            # fallback, so its extents stay reserved; the one before that is retired.
            retired, self.generation = self.generation - 1, gen
            self._release_gen(retired)

    async def _write_manifest(self, table: ShardTable, placements: list[SwapPlacement],
                              manifest: bytes, gen: int) -> None:
        """Stage the new manifest, then publish it with a rename.

        A failure while staging (ENOSPC, EIO writing the temp file) leaves the last
        manifest in force and the synced data intact: this generation is dropped and
        a later flush retries. Only a failure of the rename or of the directory's
        fsync leaves unknown which manifest is on disk, and fail-stops the job.
        """
        loop = asyncio.get_running_loop()
        path = self.manifest_path()
        dir_fd = self.files[0].dir_fd  # the job's dir, checked (offloadd.swap.swapdirs)
        try:
            await loop.run_in_executor(None, keep_previous_generation, dir_fd)
            await loop.run_in_executor(None, stage_file, dir_fd, MANIFEST, manifest)
        except OSError as exc:
            self._release_gen(gen)  # never durable: free what only it named
            await loop.run_in_executor(None, discard_staged, dir_fd, MANIFEST)
            raise SwapIOError(
                f"job {self.job!r}: writing its manifest in {path.parent} failed ({exc}); the "
                f"last flush (generation {self.generation}) stands and no data is lost. Free "
                "space there and flush again") from exc
        try:
            await loop.run_in_executor(None, publish_staged, dir_fd, MANIFEST)
        except OSError as exc:
            raise self._fail_stop(
                table, placements, SwapIOError(f"publishing the manifest failed: {exc}")) from exc

    def _fail_stop(self, table: ShardTable, placements: list[SwapPlacement],
                   error: SwapIOError) -> SwapIOError:
        """A sync failed: what the swap files hold since the last flush may be lost.

        Every generation keeps its extents (the manifest on disk may be the old
        or the new one), the shards the failed snapshot named stay dirty in the
        arena, and the job writes no more manifests.
        """
        unsure = set(map(id, placements))
        for shard in table.shards.values():
            if (shard.swap is not None and id(shard.swap) in unsure
                    and shard.residency is Residency.ARENA_CLEAN and not shard.torn):
                shard.residency = Residency.ARENA_DIRTY
                table.note_changed(shard)
        self.failed = SwapIOError(
            f"job {self.job!r}: {error.message}; data written to swap since the last flush "
            f"(generation {self.generation}) may be lost, so this job writes no more manifests. "
            "Check the drive, then restart the daemon with --recover to resume from the last "
            "flush", error.shard_ids)
        log.error("event=flush_fail_stop job=%s error=%r", self.job, self.failed.message)
        return self.failed

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise SwapIOError(self.failed.message, self.failed.shard_ids)

    async def _write_back_dirty(self, table: ShardTable, busy: list[Shard]) -> list[bool]:
        """Write back every dirty shard not held by a writer, while ``busy`` IO ends."""
        dirty = [s for s in table.shards.values()
                 if s.residency is Residency.ARENA_DIRTY and not s.writer and s.io is None]
        writes = asyncio.gather(*(self._write_back_listed(table, s) for s in dirty))
        waits = [asyncio.shield(s.io) for s in busy if s.io is not None]
        if waits:
            await asyncio.wait(waits)
        return list(await writes)

    async def _write_back_listed(self, table: ShardTable, shard: Shard) -> bool:
        """Write back a shard the flush listed dirty, or wait for the write-back that took it.

        Hazard: the flush lists its dirty shards in one loop turn and their write-backs
        start in the next; a write-behind queued ahead of them (a peer's release, handled
        after the flush was spawned) runs in between and takes a listed shard. Were that
        shard skipped as busy, the commit would name its previous version while the new
        one is still being written (``test_sigkill_soak``: after a completed flush,
        recovery found one shard a version older than that flush saw).
        """
        written = False
        while shard.io is not None:
            await asyncio.shield(shard.io)
            written = shard.residency is not Residency.ARENA_DIRTY
        if shard.residency is not Residency.ARENA_DIRTY:
            return written  # the write-behind persisted it (or a peer dropped it)
        return await self.write_back(table, shard, Priority.WRITEBACK)

    def manifest_path(self) -> Path:
        return self.files[0].path.parent / MANIFEST

    def _manifest(self, table: ShardTable, named: list[tuple[Shard, SwapPlacement]],
                  tag: str | None, gen: int) -> bytes:
        shards = [
            {"rank": s.rank, "id": s.shard_id, "nbytes": s.nbytes, "dtype": s.dtype,
             "version": placement.version,
             "chunks": [[c.dir_index, c.offset, c.nbytes, c.checksum]
                        for c in placement.chunks]}
            for s, placement in named
        ]
        return json.dumps({
            "format": MANIFEST_FORMAT, "job": self.job, "owner": self.owner_record(),
            "tag": tag, "created": time.time(),
            "generation": gen, "arena_nbytes": table.arena.nbytes,
            "chunk_nbytes": self.chunk_nbytes,
            "dirs": [str(f.dir.path) for f in self.files], "shards": shards,
        }).encode()


def _chunk_starts(chunks: list[Chunk]) -> list[int]:
    """Byte offset of each chunk inside its shard: the chunks say it, not today's chunk size."""
    starts, start = [], 0
    for chunk in chunks:
        starts.append(start)
        start += chunk.nbytes
    return starts


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
