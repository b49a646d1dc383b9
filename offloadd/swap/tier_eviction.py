"""One job's eviction: making room in its arena and the background write-back.

``make_room`` picks victims in the order of ``offloadd.memory.eviction`` (a clean
shard needed soon is kept over dirty state needed much later, ``_clean_floor``);
dirty victims are written back in the background (write-behind), never on the
time of the request that needs their room.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections.abc import Container
from typing import Any

from offloadd.errors import OffloadError, OverBudgetError
from offloadd.memory.arena import align_up
from offloadd.memory.eviction import SYNC_SLICE, EvictionIndex, contiguous_victims
from offloadd.memory.shards import Residency, Shard, ShardTable
from offloadd.swap.scheduler import Priority
from offloadd.swap.tier_state import TierState

log = logging.getLogger(__name__)

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
STEP_ROOM_WAIT_S = 10.0
"""How long make_room waits for an optimizer step's pins or leases to end before it
reports over budget (``JobTier.room_changed``)."""


def room_report(table: ShardTable, steps_running: bool) -> str:
    """Where a job's arena went, for an over-budget error: what is leased, pinned by a
    batch being made resident, withheld, free (and in how large a piece: free bytes in
    pieces smaller than the request cannot take it)."""
    allocator = table.arena.allocator
    pinned = sum(shard.arena_nbytes for shard in table.shards.values()
                 if shard.pins and shard.in_arena and not shard.leased)
    return (f"arena {table.arena.nbytes}, leased {table.leased_nbytes()}, pinned {pinned}, "
            f"withheld {allocator.withheld_nbytes}, free {allocator.free_nbytes} of which "
            f"{allocator.largest_free()} in one piece"
            + ("; an optimizer step of the job holds some of it" if steps_running else ""))


class TierEviction(TierState):
    """JobTier's eviction: evict, make_room and the write-behind (mixed into ``tier.JobTier``)."""

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
        if table.arena.restore_withheld() and allocator.largest_free() >= need:
            return True  # the node had room again for pages it had been short of
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
                        f"({room_report(table, self.steps_running())}); "
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
        """Start writing back the window's dirty shards; once none is left to write,
        evict them all. Whether some are (still) being written back.

        Hazard: a window's clean shards evicted while others in it were still being
        written were lost when the next pick chose another window (the write-behind made
        other shards clean meanwhile, and clean ones rank first): the request's shard
        went elsewhere, and they were read back for nothing (hypothesis found a layout
        where 19 of 20 runs did; tests/test_eviction_window.py)."""
        waiting = False
        for shard in window:
            if shard in self.cleaning:
                waiting = True
            elif shard.residency is Residency.ARENA_DIRTY:
                self._start_cleaning(table, shard)
                waiting = True
        if not waiting:
            for shard in window:
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
        (tests/test_zero_init_rss.py; the first step of a daemon without its native module
        imports torch on the worker, seconds on a loaded host). The wait is bounded: the
        step's own batch may be waiting for room the ranks hold, and then this is over
        budget after all.
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
        self.capped = room <= 0
        if self.capped:
            return
        index = self._index(table)
        if index.backlog > SYNC_SLICE:  # re-key off this release's callback, then pass
            self._start_catch_up(table, index)
            return
        # The dirty shards needed soonest stay dirty: they may be written again
        # before they are ever evicted, and a write-back of them would be wasted.
        excess = index.candidate_nbytes(True, skip=self.cleaning) - table.arena.nbytes // 4
        self.capped = excess > room
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
        wrote = False
        try:
            wrote = await self.write_back(table, shard, Priority.WRITEBACK)
            if wrote:
                self.cleaned.add(shard)
        except OffloadError as exc:
            log.warning("event=writeback_failed job=%s shard=%s error=%r",
                        self.job, shard.shard_id, exc.message)
            self.background_error = exc
        finally:
            del self.cleaning[shard]
        # The next pass, when the writes in flight have ended: releases arrived while the
        # drive was busy, or the last pass stopped at the cap. Hazard: without the cap
        # here, a burst of releases during a full write-behind left its shards dirty
        # until a request needed their room and waited for their writes
        # (tests/test_write_behind.py). Only after a write that was made: a shard
        # write_back skips (busy, torn) would otherwise be picked again at once, forever.
        if not self.cleaning and (self.dirtied_nbytes or (self.capped and wrote)):
            self._clean_background(table)

    def _raise_background_error(self) -> None:
        """Hand a failed write-back to one request that needs room it cannot get.

        The shard stays dirty (nothing is lost) and a later request retries it.
        Raised only once no write-back is in flight, so a request whose room came
        from another write-back is not failed for a shard it never asked about.
        """
        error, self.background_error = self.background_error, None
        if error is not None:
            raise error


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
