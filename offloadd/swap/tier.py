"""One job's view of the NVMe tier: eviction, read-in, write-back, prefetch and flush.

Every transition of a shard's residency happens here, each in one small
method: ``write_back`` (ARENA_DIRTY -> WRITING -> ARENA_CLEAN), ``evict``
(ARENA_CLEAN -> NVME), ``read_in`` (NVME -> READING -> ARENA_CLEAN). While
IO is in flight the shard holds a pin and an ``io`` future, so it is never
chosen as a victim and a writer waits for the write-back to finish.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable, Container, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from offloadd.errors import ChecksumError, OffloadError, OverBudgetError, SwapIOError
from offloadd.memory.arena import align_up
from offloadd.memory.eviction import (
    SYNC_SLICE,
    EvictionIndex,
    contiguous_victims,
    predicted_next_use,
)
from offloadd.memory.shards import Chunk, Residency, Shard, ShardTable, SwapPlacement, shard_kind
from offloadd.memory.trace import AccessTrace
from offloadd.swap.manifests import (
    JobOwner,
    discard_staged,
    keep_previous_generation,
    publish_staged,
    stage_file,
)
from offloadd.swap.nvme import (
    MANIFEST,
    MANIFEST_FORMAT,
    PREFETCH_HORIZON_S,
    READABLE_FORMATS,
    JobFile,
)
from offloadd.swap.scheduler import PrefetchWindow, Priority, RateMeter

if TYPE_CHECKING:
    from offloadd.swap.nvme import SwapSpace

log = logging.getLogger(__name__)




def open_tier(space: SwapSpace, job: str, *, recovering: bool = False,
              owner_record: Callable[[], dict[str, Any] | None] | None = None) -> JobTier:
    """A job's swap tier over its files in every swap dir of ``space``; ``owner_record``
    gives the job's owner as its manifests record it (``offloadd.service.auth``)."""
    tier = JobTier(space, job, space.job_files(job, recovering=recovering))
    if owner_record is not None:
        tier.owner_record = owner_record
    space.adopt(job, tier, recovering=recovering)
    return tier


def chunk_seed(job: str, rank: int, shard_id: str, version: int, index: int) -> int:
    """The xxh3 seed of a chunk's checksum: its job, rank, shard, version and index.

    Hazard: a checksum of the bytes alone vouches for any chunk list that points at
    intact bytes; a manifest whose lists were swapped between two shards (or versions,
    or chunks of one shard) would serve one shard's bytes as another's. Seeded with its
    place, a chunk verifies only where it was written.
    """
    return xxhash.xxh3_64_intdigest(f"{job}\0{rank}\0{shard_id}\0{version}\0{index}".encode())
MAX_PREFETCH_TASKS = 16
PREFETCH_WINDOW = 0.25
"""Largest lookahead of learned prefetch, as a fraction of the arena (PrefetchWindow
shrinks it while prefetched shards are evicted unused). Half the arena was
measured worse when the arena holds half the working set (bench/train_step.py
``ours_half`` alone, two runs each: 360 / 347 ms per step and 150-200 prefetched
shards evicted unused, vs 342 / 319 ms and 20-26 with a quarter): the prefetched
shards crowd out state the step writes, and demand evictions take them back."""
LAST_RESORT = -sys.float_info.max
"""A floor that keeps only the shards of queued optimizer steps (next use -inf) out of a
pick: make_room takes them only once nothing else can make room."""
DIRTY_EVICTION_COST = 2
"""Evicting a dirty shard costs a write and a read back, a clean one only the read."""
WINDOW_SLACK = 4
"""make_room frees one contiguous range from victims within the first this many times
the request's bytes of candidates (``JobTier._window``): the next use of such a victim
is a little sooner than that of the first, and a range freed whole is not lost to
fragmentation."""
WRITE_AHEAD_S = 0.1
"""The background write-back keeps clean the victims for this much eviction ahead, at
the rate evictions ran lately (bounded by ``write_behind_nbytes``)."""
STEPS_READ_AHEAD = 1
"""Queued optimizer steps whose state is read in before the worker gets to them."""
STEP_ROOM_WAIT_S = 10.0
"""How long make_room waits for an optimizer step's pins or leases to end before it
reports over budget (``JobTier.room_changed``)."""
PREFETCH_ROOM_RETRIES = 4
"""Times a prefetch waits for write-backs to free room before it gives up."""
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
        self.commit_lock = asyncio.Lock()
        """Held by one commit at a time, even after the flush that started it was cancelled."""
        self.generation = 0
        """Generation of the durable manifest on disk (0: none yet)."""
        self.named: dict[int, list[SwapPlacement]] = {}
        """Placements named by each manifest generation that is durable or being committed."""
        self.failed: SwapIOError | None = None
        """A failed sync: the job is fail-stopped and writes no more manifests."""
        self.prefetching: set[Shard] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.cleaning: dict[Shard, asyncio.Task[None]] = {}
        """Background write-backs in flight, started by make_room (write-behind)."""
        self.cleaned: set[Shard] = set()
        """Shards the write-behind cleaned, for the eviction reason label."""
        self.background_error: OffloadError | None = None
        self.dirtied_nbytes = 0
        """Bytes released dirty since the last background write-back pass."""
        self.index: EvictionIndex | None = None
        """Eviction candidates in victim order, made on the first eviction (``_index``)."""
        self.in_io: set[Shard] = set()
        self.catching_up: asyncio.Task[None] | None = None
        """Re-keying a large backlog of the index before a background write-back pass."""
        """Shards with a read or write-back in flight (``_begin_io`` to ``_end_io``)."""
        self._stripe = 0
        self.owner_record: Callable[[], dict[str, Any] | None] = lambda: None
        """The job's owner as its manifests record it (set by ``open_tier``)."""
        self.recovered_owner: JobOwner | None = None
        """The owner the recovered manifest recorded (None: a format-1 manifest)."""
        self.prefetch_window = PrefetchWindow(PREFETCH_WINDOW)
        self.expected: set[Shard] = set()
        """Shards of queued optimizer steps, not leased yet (``expect``)."""
        self.room_event = asyncio.Event()
        """Set by ``note_room`` (a lease ended, a batch unpinned)."""
        self.steps_running: Callable[[], bool] = lambda: False
        """Whether an optimizer step of the job holds pins or leases (set by ``jobs.Job``)."""
        self.pending_steps: dict[Shard, list[Shard]] = {}
        """Queued optimizer steps in the order the worker runs them (the service is FIFO
        within a job), by their first shard: the state each reads (``_read_ahead``)."""
        self.evictions = RateMeter()
        """Bytes evicted per second lately (sizes the write-behind's reserve)."""
        self.unused_prefetches: set[Shard] = set()
        """Prefetched shards in the arena not used yet: no other prefetch evicts them."""

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
            chunk.checksum = await self.space.checksum(view, seed)
            await self.space.io("write", jobfile, offset, view, priority,
                                self.space.ticket_for(shard.io, priority))
            self.space.counters.kind_nbytes.add(("write", shard_kind(shard.shard_id)), nbytes)
        except BaseException:
            jobfile.free(chunk)
            raise
        return chunk

    async def _read_chunk(self, table: ShardTable, shard: Shard, placement: SwapPlacement,
                          index: int, start: int, priority: Priority) -> None:
        chunk = placement.chunks[index]
        view = self._view(table, shard, start, chunk.nbytes)
        await self.space.io("read", self.files[chunk.dir_index], chunk.offset, view, priority,
                            self.space.ticket_for(shard.io, priority))
        self.space.counters.kind_nbytes.add(("read", shard_kind(shard.shard_id)), chunk.nbytes)
        seed = (chunk_seed(self.job, shard.rank, shard.shard_id, placement.version, index)
                if placement.bound else 0)
        if await self.space.checksum(view, seed) != chunk.checksum:
            self.space.counters.checksum_failures += 1
            raise ChecksumError(
                f"shard {shard.shard_id!r}: swap chunk at {chunk.offset} in "
                f"{self.files[chunk.dir_index].path} failed its checksum; the swap copy is "
                "corrupt (check the drive), the shard's last flushed state is lost",
                [shard.shard_id])

    def _free_placement(self, placement: SwapPlacement | None) -> None:
        """Give a shard's old swap copy back, once no manifest names it."""
        if placement is None:
            return
        if not placement.needed:
            self.space.counters.writeback_unneeded_nbytes += placement.nbytes
        placement.released = True
        if placement.gens:
            return  # a durable or in-commit manifest names these extents: _release_gen frees
        for chunk in placement.chunks:
            self.files[chunk.dir_index].free(chunk)

    def _name_in_gen(self, gen: int, placements: list[SwapPlacement]) -> None:
        for placement in placements:
            placement.gens.add(gen)
            placement.needed = True
        self.named[gen] = placements

    def _release_gen(self, gen: int) -> None:
        """Manifest ``gen`` is retired (or never became durable): free what only it named."""
        for placement in self.named.pop(gen, []):
            placement.gens.discard(gen)
            if placement.released and not placement.gens:
                for chunk in placement.chunks:
                    self.files[chunk.dir_index].free(chunk)

    # -- residency transitions ----------------------------------------------------------

    def _begin_io(self, table: ShardTable, shard: Shard, state: Residency) -> None:
        shard.io = asyncio.get_running_loop().create_future()
        shard.pins += 1
        shard.residency = state
        self.in_io.add(shard)
        table.note_changed(shard)

    def _end_io(self, table: ShardTable, shard: Shard) -> None:
        shard.pins -= 1
        self.in_io.discard(shard)
        table.note_changed(shard)
        future, shard.io = shard.io, None
        if future is not None and not future.done():
            future.set_result(None)

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

    def evict(self, table: ShardTable, shard: Shard) -> None:
        """ARENA_CLEAN -> NVME: give the arena range back; the swap copy is current."""
        assert shard.evictable and shard.residency is Residency.ARENA_CLEAN
        table.unplace(shard)
        shard.residency = Residency.NVME
        if shard.swap is not None:
            shard.swap.needed = True
        if shard.prefetched:
            self._set_prefetched(shard, False)
            self.space.counters.prefetch_wasted += 1
            self.prefetch_window.wasted += 1
        self.evictions.add(shard.arena_nbytes)
        reason = "writeback" if shard in self.cleaned else "clean"
        self.cleaned.discard(shard)
        self.space.counters.evictions.add((reason,))

    def usage(self) -> tuple[int, int]:
        """(bytes of swap extents holding this job's chunks, bytes of its swap files)."""
        return (sum(f.allocator.used_nbytes for f in self.files),
                sum(f.allocator.capacity for f in self.files))

    def next_use_s(self, shard: Shard) -> float:
        return predicted_next_use(self.traces, self.expected, shard)

    async def make_room(self, table: ShardTable, nbytes: int,
                        not_before_s: float | None = None,
                        priority: Priority = Priority.DEMAND) -> bool:
        """Evict clean shards until one free extent of ``nbytes`` exists.

        Dirty shards are never written back on the caller's time: ``_clean`` starts
        write-backs of the next victims in the background, and this waits for
        them. Returns False only for a prefetch (``not_before_s`` set) that would
        have to wait or evict something needed sooner. Raises OverBudgetError when
        leases and pins hold so much of the arena that waiting cannot help, and
        the error of a failed background write-back to the caller waiting on it.
        """
        need = max(nbytes, 1)
        allocator = table.arena.allocator
        if allocator.largest_free() >= need:
            return True
        # One request at a time picks victims and waits; the others queue on the lock
        # instead of all waking on every completed write-back and picking again.
        async with self.room_lock:
            index = self._index(table)
            while allocator.largest_free() < need:
                if index.backlog > SYNC_SLICE:
                    await index.catch_up()  # yields: the room may have come meanwhile
                    continue
                shortfall = need - allocator.free_nbytes if allocator.free_nbytes < need else need
                floor = _clean_floor(index, not_before_s)
                # Hazard: two prefetches (two ranks' read-ahead, say) that may each evict
                # what is needed later than their own shard take each other's shards in
                # turn, each read again and again while their next uses stay close.
                skip = self.unused_prefetches if not_before_s is not None else ()
                window = self._window(table, index, align_up(need), floor, not_before_s, skip)
                if window is not None:
                    if not self._free_window(table, window):
                        continue  # its shards were all clean: the range is free now
                    if not_before_s is not None:
                        return False
                    progress = self._io_progress(table) + list(self.cleaning.values())
                    await asyncio.wait([asyncio.shield(f) for f in progress],
                                       return_when=asyncio.FIRST_COMPLETED)
                    continue
                victims = index.pick(False, shortfall, floor=floor, skip=skip)
                for victim, _next_use in victims:
                    self.evict(table, victim)
                if victims or allocator.largest_free() >= need:
                    continue  # room now, or freed ranges that may need more to merge
                if (self.background_error is not None and not self.cleaning
                        and not_before_s is None):
                    self._raise_background_error()  # no write-back left that could help
                self._clean(table, shortfall, not_before_s, floor)
                if not_before_s is not None:
                    return False
                progress = self._io_progress(table) + list(self.cleaning.values())
                if not progress and floor is not None:
                    # No write-back can help: a clean shard needed soon is the only room.
                    victims = index.pick(False, shortfall)
                    for victim, _next_use in victims:
                        self.evict(table, victim)
                    if victims:
                        continue
                if not progress and await self.room_changed():
                    continue  # a lease or a batch's pins ended meanwhile: pick again
                if not progress:
                    raise OverBudgetError(
                        f"job {self.job!r}: no evictable shard can make room for {need} bytes "
                        f"(arena {table.arena.nbytes}, leased {table.leased_nbytes()}); "
                        "release leases or acquire fewer shards at once")
                # Nothing we wait on needs this lock: write-backs and reads into placed
                # ranges finish on their own, so holding it cannot deadlock.
                await asyncio.wait([asyncio.shield(f) for f in progress],
                                   return_when=asyncio.FIRST_COMPLETED)
        return True

    def _window(self, table: ShardTable, index: EvictionIndex, need: int,
                floor: float | None, not_before_s: float | None,
                skip: Container[Shard]) -> list[Shard] | None:
        """Victims that free one range of ``need`` bytes (``contiguous_victims``) among
        the first ``WINDOW_SLACK`` times ``need`` of clean, then dirty, candidates in
        victim order, as the pick below would take them; None: pick as before."""
        if self.background_error is not None:
            return None  # the pick below reports a failed write-back before retrying
        slack = need * WINDOW_SLACK
        ranked = [shard for shard, _t in index.pick(False, slack, floor=floor, skip=skip)]
        ranked += [shard for shard, next_use in index.pick(True, slack, above=not_before_s,
                                                           skip=self.cleaning)
                   if next_use > -math.inf]  # not a queued step's state (see _clean)
        if not ranked and not self.cleaning:
            return None
        return contiguous_victims(table, ranked, need, pending=self.cleaning)

    def _free_window(self, table: ShardTable, window: list[Shard]) -> bool:
        """Evict the window's clean shards, start writing back its dirty ones; whether
        some are (still) being written back."""
        waiting = False
        for shard in window:
            if shard in self.cleaning:
                waiting = True
            elif shard.residency is Residency.ARENA_DIRTY:
                self._start_cleaning(table, shard)
                waiting = True
            else:
                self.evict(table, shard)
        return waiting

    def note_room(self) -> None:
        """A lease ended or a batch unpinned its shards: they may be evictable now."""
        self.room_event.set()

    async def room_changed(self) -> bool:
        """Whether a lease ended or a batch unpinned while an optimizer step of the job
        holds shards, within ``STEP_ROOM_WAIT_S``; False at once when none does.

        Hazard: no IO in flight and nothing evictable is not always over budget. The
        shards held may belong to the daemon itself: a queued optimizer step's batch is
        pinned while it is made resident, then leased while its kernel runs, and ends by
        itself. An arena a few shards larger than one step (12-16 MiB, 2 MiB shards)
        failed a rank's acquire with "leased 0" while only such a step held the room
        (tests/test_zero_init_rss.py; the first step of a daemon imports torch on the
        worker, seconds on a loaded host). The wait is bounded: the step's own batch
        may be waiting for room the ranks hold, and then this is over budget after all.
        When only ranks hold the room it is reported at once, as before.
        """
        if not self.steps_running():
            return False
        self.room_event.clear()
        try:
            await asyncio.wait_for(self.room_event.wait(), STEP_ROOM_WAIT_S)
        except asyncio.TimeoutError:
            return False
        return True

    def _index(self, table: ShardTable) -> EvictionIndex:
        if self.index is None:
            self.index = EvictionIndex(table, self.traces, self.expected)
        return self.index

    def _io_progress(self, table: ShardTable) -> list[asyncio.Future[Any]]:
        """IO in flight whose end may free room (``in_io``, not a pass over the table).

        A write-behind shard is waited on through its task, not its ``io`` future:
        the task is done only after it recorded its error for us to raise.
        """
        cleaning = self.cleaning
        return [shard.io for shard in self.in_io
                if shard.io is not None and shard not in cleaning
                and (shard.offset is not None or shard.residency is Residency.WRITING)
                and table.shards.get((shard.rank, shard.shard_id)) is shard]

    def _clean(self, table: ShardTable, shortfall: int, not_before_s: float | None,
               floor: float | None) -> None:
        """Write back the next dirty victims in the background (write-behind).

        Keeps ``shortfall`` plus ``write_ahead_nbytes`` of victims clean or being cleaned
        (clean ones count from ``floor`` on, as make_room takes them), so that a stream
        of requests finds clean victims and the drive sees many writes in flight
        instead of one per request. A prefetch (``not_before_s``) writes back only
        what is needed later than its own shard; a shard a queued optimizer step
        will use (next use -inf) is written back only for the shortfall itself.
        """
        if self.background_error is not None:
            return  # report the failure before retrying: a full drive must not spin
        index = self._index(table)
        target = shortfall + self.write_ahead_nbytes(table)
        ready = self._cleaning_nbytes()
        ready += sum(s.arena_nbytes for s, _t in index.pick(False, target - ready, floor=floor))
        furthest: float | None = None
        for shard, next_use in index.pick(True, target - ready, above=not_before_s,
                                          skip=self.cleaning):
            furthest = next_use if furthest is None else furthest
            # Beyond the shortfall, only what make_room would take before a clean shard:
            # a dirty shard needed much sooner than the furthest is likely written again
            # (its step updates it) before anything needs its room.
            if ready >= shortfall and next_use < furthest / DIRTY_EVICTION_COST:
                break
            ready += shard.arena_nbytes
            self._start_cleaning(table, shard)

    def _start_cleaning(self, table: ShardTable, shard: Shard) -> None:
        task = asyncio.ensure_future(self._clean_one(table, shard))
        self.cleaning[shard] = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _cleaning_nbytes(self) -> int:
        """Arena bytes of the background write-backs in flight."""
        return sum(s.arena_nbytes for s in self.cleaning)

    def write_behind_nbytes(self, table: ShardTable) -> int:
        return min(table.arena.nbytes // 4, self.space.queue.depth * self.chunk_nbytes)

    def write_ahead_nbytes(self, table: ShardTable) -> int:
        """Victims the write-behind keeps clean ahead of make_room, beyond a shortfall.

        None once a rank's trace is known: its read-ahead (learned prefetch, a queued
        optimizer step's state) asks for room before the shard is used, and the
        write-backs that room takes are started then, exactly what it evicts. Any
        reserve beyond that is a guess at which dirty shard goes next, and with
        furthest-next-use eviction the state a step just updated is always next in
        line: it was cleaned as it was made, then a clean shard was evicted instead
        and the step updated it again (``tests/_zero_steps.py``, half the working set
        as arena: 1.5-2.3x the least bytes written with a 4 MiB or a predicted reserve,
        1.1-1.3x without; bench/scale.py --sweep: a quarter of the arena as reserve
        wrote all the state every step, 357 MB where 24 MB did not fit). Before any
        trace: what evictions took in the last ``WRITE_AHEAD_S`` at their recent rate,
        at least one chunk, at most ``write_behind_nbytes``.
        """
        if any(trace.known for trace in self.traces.values()):
            return 0
        ahead = int(self.evictions.bytes_per_s() * WRITE_AHEAD_S)
        return min(self.write_behind_nbytes(table), max(self.chunk_nbytes, ahead))

    def note_dirty(self, table: ShardTable, nbytes: int) -> None:
        """A writer released ``nbytes`` of new versions: maybe start background write-back.

        Once the job's shards outgrow its arena, eviction is certain, and the dirty
        shards next in the eviction order will have to be written: they are written
        while the drive has room rather than when a request is waiting for their
        arena range. Passes are batched (one per ``write_behind_nbytes / 4`` dirtied)
        to keep releases cheap.
        """
        self.dirtied_nbytes += nbytes
        if self.dirtied_nbytes >= self.write_behind_nbytes(table) // 4:
            self._clean_background(table)

    def _clean_background(self, table: ShardTable) -> None:
        self.dirtied_nbytes = 0
        if not table.overcommitted() or self.background_error is not None:
            return
        if not self.write_ahead_nbytes(table):
            return  # the ranks' read-ahead asks for room ahead of use (write_ahead_nbytes)
        room = self.write_behind_nbytes(table) - self._cleaning_nbytes()
        if room <= 0:
            return
        index = self._index(table)
        if index.backlog > SYNC_SLICE:  # re-key off this release's callback, then pass
            self._start_catch_up(table, index)
            return
        # The dirty shards needed soonest stay dirty: they may be written again
        # before they are ever evicted, and a write-back of them would be wasted.
        excess = index.candidate_nbytes(True, skip=self.cleaning) - table.arena.nbytes // 4
        for shard, _t in index.pick(True, min(room, excess), skip=self.cleaning):
            self._start_cleaning(table, shard)

    def _start_catch_up(self, table: ShardTable, index: EvictionIndex) -> None:
        if self.catching_up is not None:
            return
        self.catching_up = asyncio.ensure_future(self._catch_up_and_clean(table, index))
        self.tasks.add(self.catching_up)
        self.catching_up.add_done_callback(self.tasks.discard)

    async def _catch_up_and_clean(self, table: ShardTable, index: EvictionIndex) -> None:
        try:
            await index.catch_up()
        finally:
            self.catching_up = None
        self._clean_background(table)

    async def _clean_one(self, table: ShardTable, shard: Shard) -> None:
        try:
            if await self.write_back(table, shard, Priority.WRITEBACK):
                self.cleaned.add(shard)
        except OffloadError as exc:
            log.warning("event=writeback_failed job=%s shard=%s error=%r",
                        self.job, shard.shard_id, exc.message)
            self.background_error = exc
        finally:
            del self.cleaning[shard]
        if not self.cleaning and self.dirtied_nbytes:
            self._clean_background(table)  # releases arrived while the drive was busy

    def _raise_background_error(self) -> None:
        """Hand a failed write-back to one request that needs room it cannot get.

        The shard stays dirty (nothing is lost) and a later request retries it.
        Raised only once no write-back is in flight, so a request whose room came
        from another write-back is not failed for a shard it never asked about.
        """
        error, self.background_error = self.background_error, None
        if error is not None:
            raise error

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

    def _set_prefetched(self, shard: Shard, prefetched: bool) -> None:
        shard.prefetched = prefetched
        if prefetched:
            self.unused_prefetches.add(shard)
        else:
            self.unused_prefetches.discard(shard)

    # -- learned and explicit prefetch ------------------------------------------------

    def step_begin(self, table: ShardTable, rank: int) -> None:
        trace = self.traces.setdefault(rank, AccessTrace())
        self.prefetch_window.update()
        if self.index is not None:  # every next use the trace knows is about to change
            self.index.note_trace_shards(trace)
        trace.begin_step()

    def note_access(self, table: ShardTable, shard: Shard, traced: bool = True) -> None:
        if traced:
            self._record(shard)
        if shard.prefetched:
            self._set_prefetched(shard, False)
            self.space.counters.prefetch_hits += 1
        self.prefetching.discard(shard)

    def _record(self, shard: Shard) -> None:
        trace = self.traces.get(shard.rank)
        if trace is not None:
            cursor = trace.cursor
            trace.record(shard, time.monotonic())
            if self.index is not None:
                self.index.changed.add(shard)  # one more use this step: not overdue
                if trace.cursor != cursor:
                    self.index.note_trace_moved(trace, cursor, trace.cursor)

    def after_access(self, table: ShardTable, rank: int) -> None:
        trace = self.traces.get(rank)
        if trace is None or not trace.known:
            return
        horizon = min(PREFETCH_HORIZON_S, max(trace.previous_s, 0.05))
        window = int(table.arena.nbytes * self.prefetch_window.fraction)
        for shard, due in trace.upcoming(window, horizon):
            if len(self.tasks) >= MAX_PREFETCH_TASKS:
                return
            self._start_prefetch(table, shard, due)

    def prefetch(self, table: ShardTable, shards: list[Shard], deadline_s: float) -> None:
        """A rank's hint. Once the rank's trace knows a shard, its learned prefetch reads
        it when it comes into the window, in the rank's order: a hint would read it now
        whatever the arena holds (hints name every unit in a bucket, far more than
        a small arena holds, and each read in would evict the hint before it)."""
        for shard in shards:
            trace = self.traces.get(shard.rank)
            if trace is not None and trace.knows(shard):
                continue
            self._start_prefetch(table, shard, max(deadline_s, 0.0))

    def _start_prefetch(self, table: ShardTable, shard: Shard, due_s: float) -> None:
        if shard.in_arena or shard.io is not None or shard.swap is None:
            return
        self.space.counters.prefetch_issued += 1
        self.prefetch_window.issued += 1
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

    def hurry(self, shard: Shard) -> None:
        """A rank is blocked on this shard's IO in flight: run it as a demand."""
        self.space.hurry(shard.io, Priority.DEMAND)

    def note_stall(self, rank: int, seconds: float) -> None:
        self.space.counters.stall_seconds.add((self.job, str(rank)), seconds)

    # -- queued optimizer steps ------------------------------------------------------

    def expect(self, table: ShardTable, rank: int, shards: list[Shard], reads: list[Shard],
               due_s: float) -> None:
        """An optimizer step of ``rank`` was queued: it will lease ``shards`` in about
        ``due_s`` seconds, once the worker gets to it.

        The accesses are recorded in the rank's trace now, in the rank's program order
        (the worker's own acquire is not recorded, ``Job.acquire_for_step``). Until the
        step holds its leases, the shards are the last eviction candidates: the trace
        alone would think a queued step's state already used once its cursor passed
        where the last step's worker reached it, and evict it (or write its gradient
        back) for the next step. The ``reads`` of the next ``STEPS_READ_AHEAD`` steps
        to run are read in ahead of the worker, so that one step's Adam overlaps the
        next one's reads; reading every queued step's state at once took the arena
        room the ranks' parameters needed, which were then read twice.
        """
        for shard in reads:  # not the param: the kernel overwrites it, reading nothing
            self._record(shard)
        for shard in shards:
            self.expected.add(shard)
            table.note_changed(shard)
        self.after_access(table, rank)
        self.pending_steps[shards[0]] = reads
        self._read_ahead(table)

    def unexpect(self, table: ShardTable, shards: list[Shard]) -> None:
        """The step leased ``shards`` (or failed): they are ordinary candidates again."""
        for shard in shards:
            if shard in self.expected:
                self.expected.discard(shard)
                table.note_changed(shard)
        if self.pending_steps.pop(shards[0], None) is not None:
            self._read_ahead(table)

    def _read_ahead(self, table: ShardTable) -> None:
        for reads in itertools.islice(self.pending_steps.values(), STEPS_READ_AHEAD):
            for shard in reads:
                self._start_prefetch(table, shard, 0.0)

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

    def load_manifest(self, table: ShardTable, manifest: dict[str, Any]) -> int:
        dirs = [str(f.dir.path) for f in self.files]
        if manifest["format"] not in READABLE_FORMATS:
            raise ValueError(f"manifest of job {self.job!r} has format {manifest['format']!r}; "
                             f"this offloadd reads formats {list(READABLE_FORMATS)}")
        if manifest["dirs"] != dirs:
            raise ValueError(f"manifest of job {self.job!r} names swap dirs {manifest['dirs']}, "
                             f"daemon has {dirs}; start with the same --swap-dir list")
        bound = manifest["format"] >= 2
        if bound and manifest["owner"] is not None:  # null: a tier that served no hello
            self.recovered_owner = JobOwner.from_record(manifest["owner"])
        gen = int(manifest.get("generation", 1))
        entries = [(entry, [Chunk(*c) for c in entry["chunks"]]) for entry in manifest["shards"]]
        for entry, chunks in entries:
            check_geometry(self.job, entry, chunks, manifest["chunk_nbytes"])
        # New copies keep the geometry the manifest recorded: one chunk size per job.
        self.chunk_nbytes = manifest["chunk_nbytes"]
        placements = []
        for entry, chunks in entries:
            shard = table.create(entry["rank"], entry["id"], entry["nbytes"], entry["dtype"])
            for chunk in chunks:
                self.files[chunk.dir_index].allocator.reserve(chunk.offset, chunk.nbytes)
            if chunks:  # a manifest of an older daemon may list never-written shards
                shard.swap = SwapPlacement(chunks, entry["version"], bound=bound)
                placements.append(shard.swap)
            shard.version = entry["version"]
        self._name_in_gen(gen, placements)
        self.generation = gen
        return len(manifest["shards"])

    def forget(self, table: ShardTable, shard: Shard) -> None:
        self._free_placement(shard.swap)
        shard.swap = None
        self.prefetching.discard(shard)
        self.expected.discard(shard)
        self.unused_prefetches.discard(shard)
        self.cleaned.discard(shard)

    async def quiesce(self) -> None:
        """Wait out every IO on the job's files (before they are closed).

        Hazard: a flush's write-backs and commit run in tasks of their own that outlive
        the request (``_run_to_completion``); a rank that disconnects mid-flush cancels
        only its request. Closing the files under them would send their writes to closed
        descriptor numbers, which the next opened file may reuse.
        """
        while self.cleaning or self.tasks or self.in_io or self.commit_lock.locked():
            waits: list[Awaitable[Any]] = [*self.cleaning.values(), *self.tasks]
            waits += [asyncio.shield(s.io) for s in self.in_io if s.io is not None]
            if self.commit_lock.locked():
                waits.append(self._commit_ended())
            await asyncio.gather(*waits, return_exceptions=True)

    async def _commit_ended(self) -> None:
        async with self.commit_lock:
            pass

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for jobfile in self.files:
            jobfile.close()


def _chunk_starts(chunks: list[Chunk]) -> list[int]:
    """Byte offset of each chunk inside its shard: the chunks say it, not today's chunk size."""
    starts, start = [], 0
    for chunk in chunks:
        starts.append(start)
        start += chunk.nbytes
    return starts


def check_geometry(job: str, entry: dict[str, Any], chunks: list[Chunk],
                   chunk_nbytes: int) -> None:
    """Refuse a manifest entry whose chunks do not tile its shard in ``chunk_nbytes`` steps."""
    if not chunks:
        return
    arena_nbytes = align_up(max(entry["nbytes"], 1))
    expected = [min(chunk_nbytes, arena_nbytes - start)
                for start in range(0, arena_nbytes, chunk_nbytes)]
    if [c.nbytes for c in chunks] != expected:
        raise ValueError(
            f"manifest of job {job!r}: shard {entry['id']!r} has chunks of "
            f"{[c.nbytes for c in chunks][:4]} bytes, not the {chunk_nbytes}-byte geometry the "
            "manifest records; the manifest is corrupt, restore it or reclaim the job with "
            "`offloadd gc`")


def _clean_floor(index: EvictionIndex, not_before_s: float | None) -> float | None:
    """Soonest next use a clean victim may have, or None for any.

    Clean-first alone evicts a clean shard needed in milliseconds (a prefetched
    one, a parameter the backward reads again) ahead of dirty state needed only at
    the next step's optimizer, so the clean one is read back in the same step.
    Furthest-next-use alone writes back a dirty shard needed a step from now
    rather than drop a clean one needed most of a step from now, though both
    are read back before their use: the write is the difference. Evicting costs a
    dirty shard a write and a read, a clean one a read, so a clean shard is kept
    only when it is needed sooner than half the furthest dirty candidate's next use.
    A prefetch also keeps its own bound (``not_before_s``): the later of the two.
    """
    # >= in the pick. With no trace yet, half the furthest stepped optimizer state
    # (scheduler.UNTRACED_STATE_S) lies beyond every other untraced shard, so a clean
    # parameter stays while stepped state can be written back; before any step,
    # half of UNTRACED_S lies below them all and clean-first applies.
    furthest = index.furthest_next_use(dirty=True)
    if furthest is None or furthest == -math.inf:
        # no dirty candidate but a queued step's: not its clean shards
        return LAST_RESORT if not_before_s is None else not_before_s
    floor = furthest / DIRTY_EVICTION_COST
    return floor if not_before_s is None else max(floor, not_before_s)


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
