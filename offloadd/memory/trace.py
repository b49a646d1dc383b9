"""What each rank will need next: its learned access trace and the eviction order it drives.

- ``AccessTrace`` records one rank's acquire order over a step; during the
  next step it predicts which shards come next and when (seconds from now),
  which drives both prefetch and furthest-next-use eviction.
- ``pick_victims`` orders eviction candidates: clean before dirty, furthest
  next use first, least recently used when no trace knows the shard (and most
  recently used among optimizer state: ``untraced_next_use``).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable

from offloadd.memory.shards import Residency, Shard

MAX_CURSOR_SKIP = 16
"""Trace entries one record may skip; a step's async optimizer steps (two units of five
shards in flight) can land on either side of step_begin."""
OVERDUE_ENTRIES = 2 * MAX_CURSOR_SKIP
"""How far (in trace entries) the cursor may pass a shard's position, the shard not yet
used this step, before the trace stops expecting it this step (``AccessTrace``)."""


class AccessTrace:
    """One rank's shard order over the previous step, replayed to predict the current one."""

    def __init__(self) -> None:
        self.previous: list[tuple[Shard, float]] = []
        self.previous_s = 0.0
        self.positions: dict[str, list[int]] = {}
        """Indices into ``previous`` by shard id, not by object: a shard dropped and
        re-created within the step (the engine drops consumed gradients) is the same
        shard to the trace, so its next use stays known instead of looking unused."""
        self.current: list[tuple[Shard, float]] = []
        self.seen: dict[str, int] = {}
        """Accesses of each shard id this step: the first ``seen`` of its positions in
        ``previous`` are done, whatever the cursor passed."""
        self.step_started = time.monotonic()
        self.cursor = 0
        self.misses = 0
        """Consecutive records whose learned position lay too far past the cursor."""

    def begin_step(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.current:
            self.previous = self.current
            self.previous_s = max(now - self.step_started, self.current[-1][1])
            self.positions = {}
            for index, (shard, _t) in enumerate(self.previous):
                self.positions.setdefault(shard.shard_id, []).append(index)
        self.current = []
        self.seen = {}
        self.step_started = now
        self.cursor = 0
        self.misses = 0

    def record(self, shard: Shard, now: float) -> None:
        self.current.append((shard, now - self.step_started))
        self.seen[shard.shard_id] = self.seen.get(shard.shard_id, 0) + 1
        positions = self.positions.get(shard.shard_id)
        if not positions:
            return
        index = bisect.bisect_left(positions, self.cursor)
        if index == len(positions):
            return
        target = positions[index]
        # An access out of its learned place (an async optimizer step that ran before
        # step_begin this time, after it last time) must not drag the cursor far ahead:
        # every prediction after it would be off by most of a step. Far matches count
        # as misses; only a run of them (the order really changed) moves the cursor.
        if target - self.cursor > MAX_CURSOR_SKIP and self.misses < MAX_CURSOR_SKIP:
            self.misses += 1
            return
        self.misses = 0
        self.cursor = target + 1

    @property
    def known(self) -> bool:
        return bool(self.previous)

    def knows(self, shard: Shard) -> bool:
        """The last step used ``shard``: its next use can be predicted."""
        return shard.shard_id in self.positions

    def _elapsed_at_cursor(self) -> float:
        return self.previous[self.cursor - 1][1] if self.cursor else 0.0

    def _next_position(self, shard_id: str, positions: list[int]) -> int:
        """Index into ``positions`` of the shard's next use: the first the cursor has not
        passed, or an overdue one.

        Hazard: the cursor follows the rank's own accesses, and they do not keep the
        last step's order with the daemon's queued optimizer steps exactly. A step
        queued a little later than last time (the oldest in flight took longer) has
        its state's positions passed by the rank's next parameter reads, and taken
        for done, the state was predicted unused until the next step: the furthest,
        it was evicted just before its step read it (S1 of bench/scale.py: 1.3-2.4 GB
        of such state read twice a step, most of it read ahead and evicted unused).
        A position passed less than ``OVERDUE_ENTRIES`` ago by a shard used fewer
        times this step is overdue: needed now.
        """
        index = bisect.bisect_left(positions, self.cursor)
        seen = self.seen.get(shard_id, 0)
        if seen < index:
            return bisect.bisect_left(positions, self.cursor - OVERDUE_ENTRIES, seen, index)
        return index

    def next_use_s(self, shard: Shard) -> float:
        """Predicted seconds until ``shard`` is used again (inf if the trace never uses
        it; zero or less if overdue)."""
        return self.next_use_at(shard) - self._elapsed_at_cursor()

    def next_use_at(self, shard: Shard) -> float:
        """``next_use_s`` plus the elapsed time at the cursor, which all of the rank's
        shards share: it changes only when the cursor passes one of the shard's
        positions (or passes it by ``OVERDUE_ENTRIES``) and when the shard is used, so
        the eviction index can keep shards ordered by it."""
        positions = self.positions.get(shard.shard_id)
        if not positions:
            return math.inf
        index = self._next_position(shard.shard_id, positions)
        if index < len(positions):
            return self.previous[positions[index]][1]
        return self.previous_s + self.previous[positions[0]][1]  # next step

    def upcoming(self, window_nbytes: int, horizon_s: float) -> Iterable[tuple[Shard, float]]:
        """Shards expected next, in order, within a byte window and a time horizon."""
        here = self._elapsed_at_cursor()
        total = 0
        count = len(self.previous)
        for step in range(count):
            index = self.cursor + step
            wrapped = index >= count
            shard, at = self.previous[index % count]
            due = (self.previous_s if wrapped else 0.0) + at - here
            if due > horizon_s or total >= window_nbytes:
                return
            total += shard.arena_nbytes
            yield shard, due


UNTRACED_S = 1e12
"""Next use of a shard no trace knows: beyond any traced one (a step is seconds)."""
UNTRACED_STATE_S = 4 * UNTRACED_S
"""Next use of optimizer state no trace knows, before its last use is added: far
enough beyond ``UNTRACED_S`` that half of it (``tier_eviction._clean_floor``) still lies beyond
every other untraced shard, so a clean one of those is not evicted for it."""


def untraced_next_use(shard: Shard) -> float:
    """Next use of a shard while its rank has no trace (the first step).

    Least recently used first is right for parameters: the backward reads them in
    the reverse of the forward's order, and the next forward in the forward's. It is
    wrong for optimizer state, updated once a step: the state the backward has just
    stepped is next used a step later, after every parameter and every state not yet
    stepped, and among stepped state the most recently stepped is needed last. Least
    recently used evicted the parameters (clean, so first) and kept the stepped state,
    and the next forward read the parameters back: the second step read 1.9x the bytes
    that do not fit, the third 1.1x (tests/_zero_steps.py, 36 units, arena 3/8 of the
    working set; 1.4-1.5x in the second step with this rule and ``tier_eviction._clean_floor``
    applied to prefetches). Optimizer state therefore comes first, most recently used first:
    ``UNTRACED_STATE_S`` + its last use, against ``UNTRACED_S`` for the rest. Exact in a
    float while the clock stays below 2**52.
    """
    return UNTRACED_STATE_S + shard.last_use if shard.optimizer_state else UNTRACED_S


def victim_key(shard: Shard, next_use_s: float) -> tuple[int, float, int]:
    """Sort key: clean first, then furthest next use, then least recently used."""
    dirty = 0 if shard.residency is Residency.ARENA_CLEAN else 1
    return (dirty, -next_use_s, shard.last_use)


def pick_victims(candidates: Iterable[tuple[Shard, float]], need_nbytes: int,
                 not_before_s: float | None = None) -> list[Shard]:
    """Enough evictable shards to free ``need_nbytes``, in eviction order.

    With ``not_before_s`` (used by prefetch), a shard needed sooner than that is
    never chosen: evicting it to bring in something needed later is a loss.
    """
    ranked = sorted(
        ((victim_key(shard, next_use), shard) for shard, next_use in candidates
         if not_before_s is None or next_use > not_before_s),
        key=lambda item: item[0],
    )
    chosen, total = [], 0
    for _key, shard in ranked:
        if total >= need_nbytes:
            break
        chosen.append(shard)
        total += shard.arena_nbytes
    return chosen
