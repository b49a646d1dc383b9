"""Scheduling for the swap tier's IO (what to read ahead is ``offloadd.memory.trace``'s).

- ``IOQueue`` admits swap IO with demand reads ahead of prefetches ahead of
  write-backs, keeping at most ``depth`` requests in flight.
- ``PrefetchWindow`` sizes the learned prefetch's lookahead from how many
  prefetched shards were evicted before their use.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import math
import time


class Priority(enum.IntEnum):
    DEMAND = 0  # a rank is blocked on this read
    PREFETCH = 1  # predicted use; worthless if late, harmful if it delays demand
    WRITEBACK = 2  # eviction or flush of dirty bytes


class IOTicket:
    """The swap IO of one residency transition (one shard's write-back or read).

    A request that waits for the transition (a demand read of a shard being
    written back) raises the ticket: its chunks still waiting at the gate or in
    the engine's queue then run as that request would. Without it, a demand read
    would wait behind a write-back that waits behind every other write-back.
    """

    def __init__(self, priority: Priority) -> None:
        self.priority = priority
        self.at_gate: set[asyncio.Future[None]] = set()
        self.in_engine: set[asyncio.Future[None]] = set()


class IOQueue:
    """A priority gate in front of the IO engine."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.in_flight = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    async def enter(self, priority: Priority, ticket: IOTicket | None = None) -> None:
        if self.in_flight < self.depth and not self._waiting:
            self.in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if ticket is not None:
            priority = min(priority, ticket.priority)
            ticket.at_gate.add(waiter)
        heapq.heappush(self._waiting, (int(priority), next(self._seq), waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # we were admitted just as we were cancelled
            raise
        finally:
            if ticket is not None:
                ticket.at_gate.discard(waiter)

    def raise_priority(self, ticket: IOTicket, priority: Priority) -> None:
        """Waiters of the ticket get a second, more urgent place; leave() skips the stale one."""
        for waiter in ticket.at_gate:
            if not waiter.done():
                heapq.heappush(self._waiting, (int(priority), next(self._seq), waiter))

    def leave(self) -> None:
        self.in_flight -= 1
        while self._waiting and self.in_flight < self.depth:
            _prio, _seq, waiter = heapq.heappop(self._waiting)
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)


class PrefetchWindow:
    """Lookahead of learned prefetch, as a fraction of the arena, steered by waste.

    A prefetched shard evicted before its use was read for nothing, and is read
    again on demand. In a small arena (state several times the arena) a fixed
    window of a quarter of it did that to about half of all prefetches, nearly
    doubling the bytes read per step (bench/scale.py, 22 M params, arena 0.4x the
    state: 464-532 MB read per step with the window, 255-282 MB without). So the
    window shrinks 4x after a period (a rank's step) that wasted more than
    ``waste_limit`` of its prefetches, and doubles back (up to ``largest``) after
    one that wasted none.
    """

    def __init__(self, largest: float, *, smallest: float = 1 / 64, waste_limit: float = 0.1,
                 min_issued: int = 8) -> None:
        if not 0 < smallest <= largest <= 1:
            raise ValueError(f"prefetch window bounds must satisfy 0 < {smallest} <= "
                             f"{largest} <= 1")
        self.largest, self.smallest = largest, smallest
        self.fraction = largest
        self.waste_limit, self.min_issued = waste_limit, min_issued
        self.issued = self.wasted = 0
        """Prefetches started and prefetched shards evicted unused, this period."""

    def update(self) -> float:
        """End a period once it saw ``min_issued`` prefetches; returns the fraction."""
        if self.issued < self.min_issued:
            return self.fraction
        if self.wasted > self.waste_limit * self.issued:
            self.fraction = max(self.smallest, self.fraction / 4)
        elif not self.wasted:
            self.fraction = min(self.largest, self.fraction * 2)
        self.issued = self.wasted = 0
        return self.fraction


class RateMeter:
    """Bytes per second of a stream of events, an exponentially weighted average with
    time constant ``tau_s`` (recent seconds count most; an idle stream decays to 0)."""

    def __init__(self, tau_s: float = 1.0) -> None:
        self.tau_s = tau_s
        self.rate = 0.0
        self.updated = time.monotonic()

    def _decay(self, now: float) -> None:
        self.rate *= math.exp(-(now - self.updated) / self.tau_s)
        self.updated = now

    def add(self, nbytes: int, now: float | None = None) -> None:
        self._decay(time.monotonic() if now is None else now)
        self.rate += nbytes / self.tau_s

    def bytes_per_s(self, now: float | None = None) -> float:
        self._decay(time.monotonic() if now is None else now)
        return self.rate
