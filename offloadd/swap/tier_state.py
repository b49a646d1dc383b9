"""The state of one job's NVMe tier, and the primitives every part of it shares.

``JobTier`` (``offloadd.swap.tier``) is this state with its parts mixed in: eviction
(``tier_eviction``), swap IO (``tier_io``) and recovery (``tier_recovery``). What those
parts call of each other is declared here, so none of them imports another.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from offloadd.errors import OffloadError, SwapIOError
from offloadd.memory.eviction import EvictionIndex
from offloadd.memory.shards import Residency, Shard, ShardTable, SwapPlacement
from offloadd.memory.trace import AccessTrace
from offloadd.swap.manifests import JobOwner
from offloadd.swap.nvme import JobFile, SwapSpace
from offloadd.swap.scheduler import PrefetchWindow, Priority, RateMeter

PREFETCH_WINDOW = 0.25
"""Largest lookahead of learned prefetch, as a fraction of the arena (PrefetchWindow
shrinks it while prefetched shards are evicted unused). Half the arena was
measured worse when the arena holds half the working set (bench/train_step.py
``ours_half`` alone, two runs each: 360 / 347 ms per step and 150-200 prefetched
shards evicted unused, vs 342 / 319 ms and 20-26 with a quarter): the prefetched
shards crowd out state the step writes, and demand evictions take them back."""


class TierState(ABC):
    """One job's tier state: residency in flight, swap extents, traces, background work."""

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
        self.capped = False
        """The last background pass left dirty shards it would have written but for the
        write-behind's cap: the next pass is due when the writes in flight end."""
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

    # -- what the parts call of each other -----------------------------------------------

    @abstractmethod
    async def write_back(self, table: ShardTable, shard: Shard, priority: Priority) -> bool:
        """ARENA_DIRTY -> ARENA_CLEAN (``tier_io``); the write-behind's cleaning uses it."""

    @abstractmethod
    async def make_room(self, table: ShardTable, nbytes: int,
                        not_before_s: float | None = None,
                        priority: Priority = Priority.DEMAND) -> bool:
        """Evict until ``nbytes`` fit (``tier_eviction``); a read-in places its shard so."""

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

    def _set_prefetched(self, shard: Shard, prefetched: bool) -> None:
        shard.prefetched = prefetched
        if prefetched:
            self.unused_prefetches.add(shard)
        else:
            self.unused_prefetches.discard(shard)

    # -- swap extents and the manifest generations that name them -----------------------

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
