"""One job's view of the NVMe tier: eviction, read-in, write-back, prefetch and flush.

Every transition of a shard's residency happens in one small method of ``JobTier``:
``write_back`` (ARENA_DIRTY -> WRITING -> ARENA_CLEAN) and ``read_in`` (NVME ->
READING -> ARENA_CLEAN) in ``tier_io``, ``evict`` (ARENA_CLEAN -> NVME) in
``tier_eviction``. While IO is in flight the shard holds a pin and an ``io`` future,
so it is never chosen as a victim and a writer waits for the write-back to finish.
This module holds what decides when to read ahead: traces, hints, queued steps.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from offloadd.errors import OffloadError
from offloadd.memory.eviction import predicted_next_use
from offloadd.memory.shards import Shard, ShardTable
from offloadd.memory.trace import AccessTrace
from offloadd.swap.nvme import PREFETCH_HORIZON_S
from offloadd.swap.scheduler import Priority
from offloadd.swap.tier_eviction import TierEviction
from offloadd.swap.tier_io import TierIO
from offloadd.swap.tier_recovery import TierRecovery

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


MAX_PREFETCH_TASKS = 16
STEPS_READ_AHEAD = 1
"""Queued optimizer steps whose state is read in before the worker gets to them."""


class JobTier(TierEviction, TierIO, TierRecovery):
    """Implements jobs.SwapTier for one job."""

    def usage(self) -> tuple[int, int]:
        """(bytes of swap extents holding this job's chunks, bytes of its swap files)."""
        return (sum(f.allocator.used_nbytes for f in self.files),
                sum(f.allocator.capacity for f in self.files))

    def next_use_s(self, shard: Shard) -> float:
        return predicted_next_use(self.traces, self.expected, shard)

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

    # -- dropped shards and closing ---------------------------------------------------

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
