"""The eviction index: a job's eviction candidates in victim order, without a table scan.

The swap tier's acquire slow path needs the next victims (clean before dirty,
furthest next use first, least recently used among equals; see
``scheduler.pick_victims``). Scanning every shard for them costs milliseconds per
request once a job has 100k shards, so the candidates are kept in heaps, one per
(rank, clean/dirty), and a pick pops only the entries it returns.

- **Changes are noted, not applied.** Whatever can change a shard's candidacy or
  key (lease, release, touch, placement, pins, IO, a trace's cursor) adds the
  shard to ``ShardTable.changed``, a set add on the request path. ``sync`` re-keys
  those shards before each pick, so the cost lands on eviction, not on acquire.
  A backlog larger than ``SYNC_SLICE`` (a step's worth of accesses, or every shard
  when the index is made) is worked off by ``catch_up`` a slice at a time, yielding
  to the loop: re-keying 200k shards at once holds it for about a second.
- **Heaps with lazy deletion.** Each candidate has exactly one live entry
  (``entries``); a re-keyed or lost candidate leaves its old entry behind, which
  picks skip and ``_compact`` clears once garbage outnumbers live entries.
- **Next use without a rescan.** A rank's next uses all shrink together as its
  trace's cursor advances, so a heap is keyed by ``AccessTrace.next_use_at`` (the
  next use on the trace's own clock), which changes only for the shards the cursor
  passes; ranks are merged on the real ``next_use_s``.

The order is the one ``pick_victims`` gives a scan of the table, ties included
(equal keys keep the table's order, the shards' ``serial``), except where two next
uses that differ on the trace's clock round to the same float once the cursor's
time is subtracted.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Container, Iterable
from operator import itemgetter

from offloadd.memory.shards import IN_ARENA, Residency, Shard, ShardTable
from offloadd.memory.trace import OVERDUE_ENTRIES, AccessTrace, untraced_next_use

Entry = tuple[float, int, int, int, Shard, bool]
"""(-next_use_at, last_use, serial, push sequence, shard, dirty): a heap entry."""

COMPACT_MIN_ENTRIES = 1024
SYNC_SLICE = 2048
"""Shards re-keyed per slice of ``catch_up`` (a few ms of loop time)."""
_shard_of = itemgetter(0)


def predicted_next_use(traces: dict[int, AccessTrace], expected: Container[Shard],
                       shard: Shard, *, trace_clock: bool = False) -> float:
    """Seconds until ``shard`` is used again: -inf for a queued optimizer step's
    shard (``expected``), its rank's trace once it knows one, else the untraced rule.
    ``trace_clock``: on the trace's own clock instead (``AccessTrace.next_use_at``, the
    index's key); the other two are the same on either clock."""
    if shard in expected:
        return -math.inf
    trace = traces.get(shard.rank)
    if trace is None or not trace.known:
        return untraced_next_use(shard)
    return trace.next_use_at(shard) if trace_clock else trace.next_use_s(shard)


class EvictionIndex:
    """Eviction candidates of one job's table (see the module docstring)."""

    def __init__(self, table: ShardTable, traces: dict[int, AccessTrace],
                 expected: Container[Shard] = ()) -> None:
        self.table = table
        self.traces = traces
        self.expected = expected
        """Shards a queued optimizer step will use (``JobTier.expect``): next use -inf,
        so they are picked last, and never by a pick with a floor."""
        self.heaps: dict[tuple[int, bool], list[Entry]] = {}
        self.entries: dict[Shard, Entry] = {}
        self.nbytes = {False: 0, True: 0}
        """Arena bytes of the clean and of the dirty candidates (exact after ``sync``)."""
        self._sequence = itertools.count()
        self.changed: set[Shard] = set(table.shards.values())
        table.changed = self.changed

    # -- keeping up with the table ----------------------------------------------------

    def note_trace_moved(self, trace: AccessTrace, start: int, stop: int) -> None:
        """The trace's cursor passed ``previous[start:stop]``: those shards' next uses
        moved, and those of the entries it is now ``OVERDUE_ENTRIES`` past (no longer
        overdue, ``AccessTrace._next_position``).

        The trace holds the shard objects it saw; ``_refresh`` finds the live shard of
        one that was dropped and made again under its id.
        """
        self.changed.update(map(_shard_of, trace.previous[start:stop]))
        self.changed.update(map(_shard_of, trace.previous[
            max(0, start - OVERDUE_ENTRIES):max(0, stop - OVERDUE_ENTRIES)]))

    def note_trace_shards(self, trace: AccessTrace) -> None:
        """A step begins: every shard the trace names has a new next use."""
        self.changed.update(map(_shard_of, trace.previous))
        self.changed.update(map(_shard_of, trace.current))

    @property
    def backlog(self) -> int:
        """Shards noted as changed and not yet re-keyed."""
        return len(self.changed)

    async def catch_up(self) -> None:
        """Re-key the backlog ``SYNC_SLICE`` shards at a time, yielding between slices,
        until what is left is one slice (the pick's own ``sync`` takes that)."""
        changed = self.changed
        while len(changed) > SYNC_SLICE:
            for _ in range(SYNC_SLICE):
                self._refresh(changed.pop())
            await asyncio.sleep(0)

    def sync(self) -> None:
        """Re-key every shard noted as changed since the last pick."""
        for shard in self.changed:
            self._refresh(shard)
        self.changed.clear()
        garbage = sum(map(len, self.heaps.values())) - len(self.entries)
        if garbage > max(len(self.entries), COMPACT_MIN_ENTRIES):
            self._compact()

    def _candidate(self, shard: Shard) -> bool:
        return (shard.io is None and shard.residency in IN_ARENA and not shard.pins
                and not shard.leased
                and self.table.shards.get((shard.rank, shard.shard_id)) is shard)

    def _refresh(self, shard: Shard) -> None:
        live = self.table.shards.get((shard.rank, shard.shard_id))
        if live is not shard:  # dropped; one made again under its id has its own key
            self._forget(shard)
            if live is None:
                return
            shard = live
        old = self.entries.pop(shard, None)
        if old is not None:
            self.nbytes[old[5]] -= shard.arena_nbytes
        if not self._candidate(shard):
            return
        dirty = shard.residency is Residency.ARENA_DIRTY
        neg_at = -self._next_use_at(shard)
        if old is not None and old[0] == neg_at and old[1] == shard.last_use and old[5] == dirty:
            entry = old  # unchanged: its entry is still in place
        else:
            entry = (neg_at, shard.last_use, shard.serial, next(self._sequence), shard, dirty)
            heapq.heappush(self.heaps.setdefault((shard.rank, dirty), []), entry)
        self.entries[shard] = entry
        self.nbytes[dirty] += shard.arena_nbytes

    def _forget(self, shard: Shard) -> None:
        old = self.entries.pop(shard, None)
        if old is not None:
            self.nbytes[old[5]] -= shard.arena_nbytes

    def _compact(self) -> None:
        for key, heap in self.heaps.items():
            live = [entry for entry in heap if self.entries.get(entry[4]) is entry]
            heapq.heapify(live)
            self.heaps[key] = live

    def _next_use_at(self, shard: Shard) -> float:
        return predicted_next_use(self.traces, self.expected, shard, trace_clock=True)

    def next_use_s(self, shard: Shard) -> float:
        return predicted_next_use(self.traces, self.expected, shard)

    # -- picks ------------------------------------------------------------------------

    def pick(self, dirty: bool, need_nbytes: int, *, floor: float | None = None,
             above: float | None = None, skip: Container[Shard] = ()
             ) -> list[tuple[Shard, float]]:
        """Clean (or dirty) candidates in victim order, with their next use, until their
        bytes reach ``need_nbytes``: ``pick_victims`` over a scan's candidates.

        ``floor``: only shards next used at or after it; ``above``: only after it
        (a prefetch's ``not_before_s``); ``skip``: shards passed over uncounted.
        """
        self.sync()
        heaps = [heap for (_rank, is_dirty), heap in self.heaps.items() if is_dirty == dirty]
        taken: list[tuple[list[Entry], Entry]] = []
        chosen: list[tuple[Shard, float]] = []
        total = 0
        try:
            while total < need_nbytes:
                best = self._best_head(heaps)
                if best is None:
                    break
                heap, entry, next_use = best
                if (floor is not None and next_use < floor) or (
                        above is not None and next_use <= above):
                    break  # every later candidate is needed at least as soon
                taken.append((heap, heapq.heappop(heap)))
                shard = entry[4]
                if shard in skip:
                    continue
                chosen.append((shard, next_use))
                total += shard.arena_nbytes
        finally:
            for heap, entry in taken:
                heapq.heappush(heap, entry)
        return chosen

    def _best_head(self, heaps: list[list[Entry]]
                   ) -> tuple[list[Entry], Entry, float] | None:
        """The rank heads' first victim: furthest real next use, then LRU, then table order."""
        best: tuple[list[Entry], Entry, float] | None = None
        best_key: tuple[float, int, int] | None = None
        for heap in heaps:
            while heap and (self.entries.get(heap[0][4]) is not heap[0]
                            or not self._candidate(heap[0][4])):
                # A stale entry (its shard was re-keyed or is no candidate), or a change
                # nobody noted: never hand out a leased, pinned or busy shard.
                entry = heapq.heappop(heap)
                if self.entries.get(entry[4]) is entry:
                    self._refresh(entry[4])
            if not heap:
                continue
            entry = heap[0]
            next_use = self.next_use_s(entry[4])
            key = (-next_use, entry[1], entry[2])
            if best_key is None or key < best_key:
                best, best_key = (heap, entry, next_use), key
        return best

    def furthest_next_use(self, dirty: bool) -> float | None:
        """The latest next use among the clean (dirty) candidates; None if there are none."""
        first = self.pick(dirty, 1)
        return first[0][1] if first else None

    def candidate_nbytes(self, dirty: bool, skip: Iterable[Shard] = ()) -> int:
        """Arena bytes of the clean (dirty) candidates, less those of ``skip``."""
        self.sync()
        skipped = sum(s.arena_nbytes for s in skip
                      if (entry := self.entries.get(s)) is not None and entry[5] == dirty)
        return self.nbytes[dirty] - skipped


def contiguous_victims(table: ShardTable, ranked: list[Shard], need: int,
                       pending: Iterable[Shard] = ()) -> list[Shard] | None:
    """The shards to free for one free range of ``need`` bytes, taken from ``ranked``
    (victims in order of preference): a contiguous run of free ranges and ranked shards,
    the one whose worst-ranked shard comes first, then the fewest bytes; None if
    the ranked shards make no such run. ``pending`` (write-backs in flight for an
    earlier pick) rank first: their cost is paid.

    Freeing victims in next-use order alone fragments an arena of shards of two sizes
    (bf16 params and gradients beside fp32 state): a 2 B/element victim freed for a
    4 B/element shard leaves a hole that fits nothing bigger, and the next victims are
    taken until two holes happen to meet. In S1 a tenth of the arena stood free in
    holes of half the size every request needed (bench/README.md, "fragmentation").
    """
    rank_of: dict[Shard, int] = {shard: -1 for shard in pending}
    for index, shard in enumerate(ranked):
        rank_of.setdefault(shard, index)
    allocator = table.arena.allocator
    best: tuple[tuple[int, int], list[Shard]] | None = None
    for shard, rank in rank_of.items():
        if best is not None and rank > best[0][0]:
            break  # every run around a later shard ranks worse than the best one
        if shard.offset is None:
            continue
        run, worst, start, end = [shard], rank, shard.offset, shard.offset + shard.arena_nbytes
        while True:
            start -= allocator.free_ending_at(start)
            end += allocator.free_at(end)
            if end - start >= need:
                break
            left = table.placed_ending_at.get(start)
            right = table.placed_at.get(end)
            options = [s for s in (left, right) if s is not None and s in rank_of]
            if not options:
                break
            grown = min(options, key=rank_of.__getitem__)
            run.append(grown)
            worst = max(worst, rank_of[grown])
            if grown is left:
                start -= grown.arena_nbytes
            else:
                end += grown.arena_nbytes
        if end - start >= need:
            cost = (worst, sum(s.arena_nbytes for s in run))
            if best is None or cost < best[0]:
                best = (cost, run)
    return best[1] if best is not None else None
