"""Jobs: a job's arena and shard table, and the operations ranks run on them.

Each operation has a synchronous fast path (everything it needs is already in
the arena) that answers without creating a task, and an asynchronous slow
path used only when the swap tier must evict or read first. The daemon's
per-request cost is therefore a dict lookup and an allocator call, not a
task switch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from offloadd.errors import (
    InvalidRequestError,
    LeaseConflictError,
    NoSwapError,
    OverBudgetError,
    TornShardError,
    UnknownShardError,
)
from offloadd.memory.arena import Arena
from offloadd.memory.shards import (
    IN_ARENA,
    Lease,
    Residency,
    Shard,
    ShardTable,
    check_grantable,
    check_mode,
    check_new_shard,
    check_shard_ids,
)
from offloadd.protocol import Placed, check_ids
from offloadd.service import batches
from offloadd.swap.scheduler import Priority

log = logging.getLogger(__name__)


class SwapTier(Protocol):
    """What a job needs from the NVMe tier (offloadd.swap.nvme); absent without --swap-dir."""

    prefetching: set[Shard]  # explicit prefetches in flight (offloadd.service.limits bounds them)

    async def make_room(self, table: ShardTable, nbytes: int) -> bool: ...
    async def read_in(self, table: ShardTable, shard: Shard,
                      priority: Priority = Priority.DEMAND) -> None: ...
    def note_access(self, table: ShardTable, shard: Shard, traced: bool = True) -> None: ...
    def after_access(self, table: ShardTable, rank: int) -> None: ...
    def expect(self, table: ShardTable, rank: int, shards: list[Shard], reads: list[Shard],
               due_s: float) -> None: ...
    def unexpect(self, table: ShardTable, shards: list[Shard]) -> None: ...
    def note_stall(self, rank: int, seconds: float) -> None: ...
    def hurry(self, shard: Shard) -> None: ...
    def step_begin(self, table: ShardTable, rank: int) -> None: ...
    def note_dirty(self, table: ShardTable, nbytes: int) -> None: ...
    def note_room(self) -> None: ...
    async def room_changed(self) -> bool: ...
    steps_running: Callable[[], bool]
    def prefetch(self, table: ShardTable, shards: list[Shard], deadline_s: float) -> None: ...
    async def flush(self, table: ShardTable, tag: str | None) -> int: ...
    def forget(self, table: ShardTable, shard: Shard) -> None: ...
    def load_manifest(self, table: ShardTable, manifest: dict[str, Any]) -> int: ...
    def usage(self) -> tuple[int, int]: ...


class Job:
    """One training job: its arena, its shards and the sessions of its ranks."""

    def __init__(self, name: str, arena: Arena, tier: SwapTier | None = None) -> None:
        self.name = name
        self.arena = arena
        self.table = ShardTable(name, arena)
        self.tier = tier
        self.num_sessions = 0
        self.owner_uid: int | None = None
        """The uid its resources count against (offloadd.service.limits), set at its first hello."""
        self.ranks: set[int] = set()
        """Rank numbers that attached (offloadd.service.limits bounds them and per-rank state)."""
        self.steps_holding = 0
        """Optimizer steps whose shards are pinned (being made resident) or leased (the
        kernel running): room they free by themselves, which the swap tier waits for
        rather than report over budget."""
        if tier is not None:
            tier.steps_running = lambda: self.steps_holding > 0

    # -- alloc / acquire ------------------------------------------------------------

    def alloc(self, rank: int, ids: list[str], nbytes: list[int], dtypes: list[str],
              leases: dict[Shard, Lease] | None = None, mode: str | None = None
              ) -> Placed | Awaitable[Placed]:
        """Create shards (existing ones must match size and dtype) and optionally lease them.

        The whole batch is validated before anything is created, so a bad entry
        leaves the table as it was. Without a lease nothing has to be resident:
        shards that do not fit now are placed when first acquired.
        """
        check_ids(ids, nbytes, dtypes)
        if len(ids) > batches.SLICE_IDS:
            return batches.alloc_sliced(self, rank, ids, nbytes, dtypes, leases, mode)
        check_shard_ids(ids)
        fresh = self.validate_batch(rank, ids, nbytes, dtypes)
        shards = [self._find_or_create(rank, i, n, d) for i, n, d in zip(ids, nbytes, dtypes)]
        created = [s for s in dict.fromkeys(shards) if s.shard_id in fresh]
        if mode is None:
            return self.place_what_fits(shards, created)
        try:
            result = self._serve(shards, leases, mode)
        except Exception:
            self.forget_unwritten(created)
            raise
        if isinstance(result, Placed):
            return result
        return self._undo_on_failure(result, created)

    def validate_batch(self, rank: int, ids: list[str], nbytes: list[int], dtypes: list[str],
                       fresh: dict[str, tuple[int, str]] | None = None
                       ) -> dict[str, tuple[int, str]]:
        """Raise for any entry that cannot be created; returns the new ids' (nbytes, dtype).

        ``fresh`` (new id -> (nbytes, dtype)) carries the new ids across the slices of
        one large batch (offloadd.service.batches), so a repeated id is checked against them all.
        """
        fresh = {} if fresh is None else fresh
        for shard_id, size, dtype in zip(ids, nbytes, dtypes):
            existing = self.table.shards.get((rank, shard_id))
            if existing is not None:
                self.table.matches(existing, size, dtype)
                continue
            check_new_shard(shard_id, size, dtype)
            self.table.check_fits(size)
            if fresh.setdefault(shard_id, (size, dtype)) != (size, dtype):
                raise InvalidRequestError(
                    f"shard {shard_id!r} appears twice in one alloc with different sizes",
                    [shard_id])
        return fresh

    def place_what_fits(self, shards: list[Shard], created: list[Shard]) -> Placed:
        """Give new shards arena space where it is free now; -1 marks 'placed on first use'.

        Without a swap tier there is no later: a shard that does not fit fails the batch.
        """
        for shard in shards:
            if shard.in_arena or shard.swap is not None or shard.io is not None:
                continue
            if not self.table.place_unwritten(shard) and self.tier is None:
                self.forget_unwritten(created)
                self._raise_arena_full(shard)
        return Placed(
            0,
            [s.offset if s.in_arena and s.offset is not None else -1 for s in shards],
            [s.nbytes for s in shards],
            [s.version for s in shards],
            [s.dtype for s in shards],
        )

    def check_batch_fits(self, need_nbytes: int, new_nbytes: int, mode: str | None) -> None:
        """Refuse a large batch whose total cannot fit before any of it is created.

        ``need_nbytes``: arena bytes of the batch's distinct shards; ``new_nbytes``: of
        those it creates. Without a swap tier every new shard must be placed now; with
        one, only a leased batch must be resident at once (as ``_pinned_fit``).
        """
        self.arena.restore_withheld()  # withheld pages: the node may have room again
        if self.tier is None and new_nbytes > self.arena.allocator.free_nbytes:
            raise OverBudgetError(
                f"job {self.name!r} arena is full: the batch creates {new_nbytes} bytes of "
                f"shards, {self.arena.allocator.free_nbytes} free of {self.arena.nbytes}"
                f"{self._withheld_note()}; drop shards, ask for a larger arena_nbytes at "
                "hello, or start the daemon with --swap-dir")
        leased = self.table.leased_nbytes()
        usable = self.arena.nbytes - self.arena.allocator.withheld_nbytes
        if self.tier is not None and mode is not None and need_nbytes + leased > usable:
            raise OverBudgetError(
                f"job {self.name!r}: {need_nbytes} bytes requested while {leased} bytes are "
                f"leased, arena is {self.arena.nbytes}{self._withheld_note()}; release "
                "leases or request fewer shards at once")

    def _withheld_note(self) -> str:
        """Says how much of the arena is withheld (``Arena.withhold_unbacked``), if any."""
        withheld = self.arena.allocator.withheld_nbytes
        return (f" ({withheld} bytes of it withheld: the node ran short of memory while "
                "backing it, until it has room again)") if withheld else ""

    async def _undo_on_failure(self, pending: Awaitable[Placed], created: list[Shard]) -> Placed:
        try:
            return await pending
        except BaseException:
            self.forget_unwritten(created)
            raise

    def forget_unwritten(self, created: list[Shard]) -> None:
        """A shard created by a request that failed never held bytes: do not keep it,
        or a later read would return whatever the arena held at its offset."""
        for shard in created:
            alive = self.table.shards.get((shard.rank, shard.shard_id)) is shard
            if alive and not shard.leased and not shard.pins and shard.io is None \
                    and shard.swap is None and shard.version == 0:
                self.table.remove(shard)

    def acquire(self, rank: int, ids: list[str], mode: str, leases: dict[Shard, Lease]
                ) -> Placed | Awaitable[Placed]:
        check_mode(mode)
        if len(ids) > batches.SLICE_IDS:
            return batches.acquire_sliced(self, rank, ids, mode, leases)
        return self._serve(self.table.lookup(rank, ids), leases, mode)

    def serve_batch(self, shards: list[Shard], leases: dict[Shard, Lease], mode: str
                    ) -> Placed | Awaitable[Placed]:
        """Lease ``shards`` (one slice of a large acquire; see offloadd.service.batches)."""
        return self._serve(shards, leases, mode)

    # -- the optimizer service's leases ---------------------------------------------

    def expect_step(self, rank: int, shards: list[Shard], reads: list[Shard],
                    due_s: float) -> None:
        """A queued optimizer step will write ``shards`` in about ``due_s`` seconds; the swap
        tier keeps them resident and starts reading ``reads`` now (``offloadd.swap.tier``)."""
        if self.tier is not None:
            self.tier.expect(self.table, rank, shards, reads, due_s)

    def unexpect_step(self, shards: list[Shard]) -> None:
        """The step holds its leases now (or gave up): ``shards`` are ordinary again."""
        if self.tier is not None:
            self.tier.unexpect(self.table, shards)

    def acquire_for_step(self, rank: int, ids: list[str], leases: dict[Shard, Lease],
                         overwrite: frozenset[Shard] = frozenset()
                         ) -> Placed | Awaitable[Placed]:
        """Write leases for the optimizer service; ``overwrite``: shards the kernel writes
        whole, placed without reading their swap copy (``ShardTable.place_unread``).

        The step's accesses were recorded in the rank's trace when it was queued
        (``expect_step``), in the rank's program order; recording them again when the
        worker gets to them would put them wherever the queue's delay fell this step,
        and the trace would mispredict the next."""
        return self._serve(self.table.lookup(rank, ids), leases, "w", traced=False,
                           overwrite=overwrite)

    def _find_or_create(self, rank: int, shard_id: str, nbytes: int, dtype: str) -> Shard:
        shard = self.table.shards.get((rank, shard_id))
        if shard is None:
            return self.table.create(rank, shard_id, nbytes, dtype)
        self.table.matches(shard, nbytes, dtype)
        return shard

    def _serve(self, shards: list[Shard], leases: dict[Shard, Lease] | None, mode: str | None,
               traced: bool = True, overwrite: frozenset[Shard] = frozenset()
               ) -> Placed | Awaitable[Placed]:
        if leases is not None and mode is not None:
            check_grantable(shards, mode)
        if _ready(shards, mode):  # the common case, checked in one pass
            return self._lease_and_reply(shards, leases, mode, traced)
        if mode == "w" and any(s.io is not None for s in shards):
            # wait for the write-back
            return self._serve_slow(shards, leases, mode, traced, overwrite)
        if all(s.in_arena for s in shards) or self._place_now(shards, overwrite):
            return self._lease_and_reply(shards, leases, mode, traced)
        return self._serve_slow(shards, leases, mode, traced, overwrite)

    def _place_now(self, shards: list[Shard], overwrite: frozenset[Shard] = frozenset()
                   ) -> bool:
        """Place never-written shards (and ``overwrite`` ones) that fit right now; anything
        needing IO or eviction goes slow. A caller that gets False places the rest there."""
        for shard in shards:
            if shard.in_arena:
                continue
            if shard in overwrite and shard.residency is Residency.NVME \
                    and shard.swap is not None:
                if not self.table.place_unread(shard):
                    return False
                continue
            if shard.swap is not None or shard.residency is Residency.READING:
                return False
            if not self.table.place_unwritten(shard):
                if self.tier is None:
                    self._raise_arena_full(shard)
                return False
        return True

    def _raise_arena_full(self, shard: Shard) -> None:
        allocator = self.arena.allocator
        raise OverBudgetError(
            f"job {self.name!r} arena is full: shard {shard.shard_id!r} needs "
            f"{shard.arena_nbytes} bytes, {allocator.free_nbytes} free (largest extent "
            f"{allocator.largest_free()}) of {self.arena.nbytes}{self._withheld_note()}; "
            "drop shards, ask for a larger arena_nbytes at hello, or start the daemon with "
            "--swap-dir",
            [shard.shard_id],
        )

    async def _serve_slow(self, shards: list[Shard], leases: dict[Shard, Lease] | None,
                          mode: str | None, traced: bool = True,
                          overwrite: frozenset[Shard] = frozenset()) -> Placed:
        assert self.tier is not None
        started = time.monotonic()
        unique = list(dict.fromkeys(shards))
        while not self._pinned_fit(unique):
            # room an optimizer step of this job holds comes back by itself
            if not await self.tier.room_changed():
                self._raise_pinned_fit(unique)
        for shard in unique:  # pinned: reading one shard never evicts another of the batch
            shard.pins += 1
            self.table.note_changed(shard)
        try:
            try:
                await self._settle(unique, mode, overwrite)
            finally:
                for shard in unique:
                    shard.pins -= 1
                    self.table.note_changed(shard)  # evictable again (offloadd.memory.eviction)
                self.tier.note_room()
            # No await from here on: the conflict check and the grant are one atomic step.
            if leases is not None and mode is not None:
                check_grantable(shards, mode)
        except BaseException:
            self._discard_unread(unique)  # placed for a writer that will not come
            raise
        self.tier.note_stall(unique[0].rank, time.monotonic() - started)
        return self._lease_and_reply(shards, leases, mode, traced)

    def _discard_unread(self, shards: Iterable[Shard]) -> None:
        for shard in shards:
            if shard.unread and not shard.leased and shard.in_arena:
                self.table.discard_unread(shard)

    async def _settle(self, shards: list[Shard], mode: str | None,
                      overwrite: frozenset[Shard] = frozenset()) -> None:
        """Make every shard resident; a writer also waits out write-backs in flight."""
        while True:
            await asyncio.gather(*(self._make_resident(s, s in overwrite) for s in shards))
            busy = [s for s in shards if s.io is not None and mode == "w"]
            if busy:
                for shard in busy:
                    self.tier.hurry(shard)  # type: ignore[union-attr]
                await asyncio.wait([asyncio.shield(s.io) for s in busy if s.io is not None])
            elif all(s.in_arena for s in shards):
                return

    def _pinned_fit(self, shards: list[Shard]) -> bool:
        need = sum(s.arena_nbytes for s in set(shards))
        return need + self.table.leased_nbytes() <= self.arena.nbytes

    def _raise_pinned_fit(self, shards: list[Shard]) -> None:
        """The batch does not fit beside the leases (``_pinned_fit`` said so)."""
        need = sum(s.arena_nbytes for s in set(shards))
        raise OverBudgetError(
            f"job {self.name!r}: {need} bytes requested while {self.table.leased_nbytes()} "
            f"bytes are leased, arena is {self.arena.nbytes}; release leases or request "
            "fewer shards at once",
            [s.shard_id for s in shards],
        )

    async def _make_resident(self, shard: Shard, overwrite: bool = False) -> None:
        assert self.tier is not None
        while not shard.in_arena:
            if (shard.rank, shard.shard_id) not in self.table.shards:
                raise UnknownShardError(f"shard {shard.shard_id!r} was dropped", [shard.shard_id])
            if shard.residency is Residency.READING or (shard.swap is not None and not overwrite):
                await self.tier.read_in(self.table, shard)
            elif shard.swap is not None:
                if not self.table.place_unread(shard):
                    await self.tier.make_room(self.table, shard.arena_nbytes)
            elif not self.table.place_unwritten(shard):
                await self.tier.make_room(self.table, shard.arena_nbytes)

    def _lease_and_reply(self, shards: list[Shard], leases: dict[Shard, Lease] | None,
                         mode: str | None, traced: bool = True) -> Placed:
        table, tier = self.table, self.tier
        offsets: list[int] = []
        nbytes: list[int] = []
        versions: list[int] = []
        dtypes: list[str] = []
        leasing = leases is not None and mode is not None
        for shard in shards:
            if leasing:
                table.grant(leases, shard, mode)  # type: ignore[arg-type]
            table.touch(shard)
            if tier is not None:
                tier.note_access(table, shard, traced)
            offsets.append(shard.offset)  # type: ignore[arg-type]
            nbytes.append(shard.nbytes)
            versions.append(shard.version)
            dtypes.append(shard.dtype)
        if tier is not None and shards and traced:
            tier.after_access(table, shards[0].rank)
        return Placed(0, offsets, nbytes, versions, dtypes)

    # -- release / drop -------------------------------------------------------------

    def release(self, rank: int, ids: list[str], dirty: bool, leases: dict[Shard, Lease],
                *, torn: bool = False) -> Awaitable[None] | None:
        if len(ids) > batches.SLICE_IDS:
            return batches.release_sliced(self, rank, ids, dirty, leases, torn)
        self.release_batch(rank, ids, dirty, leases, torn)
        return None

    def release_batch(self, rank: int, ids: list[str], dirty: bool,
                      leases: dict[Shard, Lease], torn: bool = False) -> None:
        dirtied = 0
        for shard in self.table.lookup(rank, ids):
            if self.table.give_back(leases, shard, dirty, torn):
                dirtied += shard.arena_nbytes
                shard.unread = False
            elif shard.unread and not shard.leased:
                self.table.discard_unread(shard)  # never written: its swap copy is current
        if self.tier is not None:
            if dirtied:
                self.tier.note_dirty(self.table, dirtied)
            self.tier.note_room()

    def drop(self, rank: int, ids: list[str]) -> Awaitable[None] | None:
        """Forget shards and free their arena and swap space; waits out IO in flight."""
        if len(ids) > batches.SLICE_IDS:
            return batches.drop_sliced(self, rank, ids)
        return self.drop_batch(rank, ids)

    def drop_batch(self, rank: int, ids: list[str]) -> Awaitable[None] | None:
        shards = self.table.lookup(rank, ids)
        leased = [s.shard_id for s in shards if s.leased]
        if leased:
            raise LeaseConflictError(
                f"cannot drop leased shard(s) {leased[:8]}; release them first", leased)
        if any(s.pins or s.io is not None for s in shards):
            return self._drop_after_io(rank, ids)
        self._remove(shards)
        return None

    async def _drop_after_io(self, rank: int, ids: list[str]) -> None:
        shards = self.table.lookup(rank, ids)
        while await _waited_out_io(shards):
            shards = self.table.lookup(rank, ids)  # a shard may be dropped meanwhile
        leased = [s.shard_id for s in shards if s.leased]
        if leased:
            raise LeaseConflictError(
                f"shard(s) {leased[:8]} were leased while their IO finished; release them first",
                leased)
        self._remove(shards)

    async def adopt(self, pairs: list[tuple[Shard, Shard]]) -> None:
        """Each ``(source, target)``: the target takes the source's bytes without a copy
        (``ShardTable.hand_over``) and the source is dropped. A speculative optimizer step's
        commit: the state adopts the copy the step wrote. IO in flight on any of them ends
        first; a source swapped out meanwhile is read back."""
        shards = [shard for pair in pairs for shard in pair]
        sources = [source for source, _target in pairs]
        while True:
            _check_unleased(shards)
            if await _waited_out_io(shards):
                continue
            swapped_out = [source for source in sources if not source.in_arena]
            if not swapped_out:
                break  # no await from here on: nothing can lease or move them meanwhile
            placed = self._serve(swapped_out, None, None, traced=False)
            if not isinstance(placed, Placed):
                await placed
        gone = [s.shard_id for s in shards if self.table.shards.get((s.rank, s.shard_id)) is not s]
        if gone:
            raise UnknownShardError(f"shard(s) {gone} were dropped before the commit", gone)
        torn = [source.shard_id for source in sources if source.torn]
        if torn:
            raise TornShardError(f"{torn} were torn (their writer failed): nothing to adopt",
                                 torn)
        for source, target in pairs:
            self.table.hand_over(source, target)
        self._remove(sources)
        if self.tier is not None:
            self.tier.note_dirty(self.table, sum(target.arena_nbytes for _s, target in pairs))
            self.tier.note_room()

    def _remove(self, shards: list[Shard]) -> None:
        for shard in dict.fromkeys(shards):
            if self.tier is not None:
                self.tier.forget(self.table, shard)
            self.table.remove(shard)

    def release_all(self, leases: dict[Shard, Lease]) -> int:
        """Free every lease of a session that went away; returns how many were held."""
        count = 0
        for shard, held in list(leases.items()):
            if held.mode == "w":
                # The writer died mid-update: its bytes are half-written, never published.
                log.warning("event=writer_disconnected job=%s shard=%s torn=1",
                            self.name, shard.shard_id)
            while shard in leases:
                self.table.give_back(leases, shard, dirty=False, torn=held.mode == "w")
                count += 1
        return count

    # -- step / prefetch / flush ----------------------------------------------------

    def prefetch(self, rank: int, ids: list[str], deadline_s: float) -> None:
        shards = self.table.lookup(rank, ids)
        if self.tier is not None:
            self.tier.prefetch(self.table, shards, deadline_s)

    def step_begin(self, rank: int) -> None:
        if self.tier is not None:
            self.tier.step_begin(self.table, rank)

    async def flush(self, tag: str | None) -> int:
        if self.tier is None:
            raise NoSwapError(
                "flush persists shards to the swap tier; start the daemon with --swap-dir"
            )
        if tag is not None and (not tag or len(tag) > 128 or "/" in tag or tag.startswith(".")):
            raise InvalidRequestError(f"flush tag must be 1..128 chars without '/', got {tag!r}")
        return await self.tier.flush(self.table, tag)

    def swap_usage(self) -> tuple[int, int]:
        """(swap bytes holding the job's chunks, bytes of its swap files); 0s without swap."""
        return self.tier.usage() if self.tier is not None else (0, 0)

    def stats(self) -> dict[str, object]:
        residency = {state.value: 0 for state in Residency}
        shard_nbytes = _count_shards(self.table.shards.values(), residency)
        return self._stats(residency, shard_nbytes)

    async def stats_sliced(self) -> dict[str, object]:
        """``stats`` of a job with many shards: the per-shard counts are taken
        ``SLICE_IDS`` shards per turn of the loop (200k shards take ~40 ms at once).
        A shard that changes residency meanwhile is counted in one of its states."""
        shards = list(self.table.shards.values())
        residency = {state.value: 0 for state in Residency}
        shard_nbytes = 0
        for start in range(0, len(shards), batches.SLICE_IDS):
            shard_nbytes += _count_shards(shards[start : start + batches.SLICE_IDS], residency)
            await asyncio.sleep(0)
        return self._stats(residency, shard_nbytes)

    def _stats(self, residency: dict[str, int], shard_nbytes: int) -> dict[str, object]:
        allocator = self.arena.allocator
        swap_used, swap_reserved = self.swap_usage()
        return {
            "arena_nbytes": self.arena.nbytes,
            "arena_used_nbytes": allocator.used_nbytes,
            "arena_largest_free_nbytes": allocator.largest_free(),
            "arena_locked": self.arena.locked,
            "arena_backing": self.arena.backing.value,
            "arena_backed_nbytes": self.arena.backed_nbytes,
            "arena_allocated_nbytes": self.arena.allocated_nbytes(),
            "arena_backing_error": self.arena.backing_error,
            "arena_withheld_nbytes": allocator.withheld_nbytes,
            "arena_restored_nbytes": self.arena.restored_nbytes,
            "arena_hugepages": self.arena.hugepages,
            "num_shards": len(self.table.shards),
            "shard_nbytes": shard_nbytes,
            "leased_nbytes": self.table.leased_nbytes(),
            "residency": residency,
            "swap_used_nbytes": swap_used,
            "swap_reserved_nbytes": swap_reserved,
            "sessions": self.num_sessions,
        }


async def _waited_out_io(shards: list[Shard]) -> bool:
    """Wait once for the IO in flight on ``shards``, or for a batch settling them to unpin
    them; False at once when neither holds them."""
    busy = [shard.io for shard in shards if shard.io is not None]
    if busy:
        await asyncio.wait([asyncio.shield(io) for io in busy])
    elif any(shard.pins for shard in shards):
        await asyncio.sleep(0.001)  # a batch is settling these; it unpins promptly
    else:
        return False
    return True


def _check_unleased(shards: list[Shard]) -> None:
    leased = [shard.shard_id for shard in shards if shard.leased]
    if leased:
        raise LeaseConflictError(f"shard(s) {leased[:8]} are leased; release them first",
                                 leased)


def _ready(shards: list[Shard], mode: str | None) -> bool:
    """Every shard in the arena, and none with a write-back a writer must wait for."""
    for shard in shards:
        if shard.residency not in IN_ARENA or (mode == "w" and shard.io is not None):
            return False
    return True


def _count_shards(shards: Iterable[Shard], residency: dict[str, int]) -> int:
    """Add each shard to its residency's count; returns the shards' bytes."""
    nbytes = 0
    for shard in shards:
        residency[shard.residency.value] += 1
        nbytes += shard.nbytes
    return nbytes
