"""The shard table: what each job's shards are, where they live, who holds them.

A shard is a named, contiguous byte range owned by ``(job, rank, shard_id)``.
While a shard is in the arena it occupies exactly one allocator range, so a
rank can view it as one tensor without copying. Leases pin a shard: a leased
shard is never evicted, moved or dropped.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from offloadd.errors import (
    InvalidRequestError,
    LeaseConflictError,
    NotLeasedError,
    OverBudgetError,
    ShardExistsError,
    TornShardError,
    UnknownShardError,
)
from offloadd.memory.arena import Arena, align_up
from offloadd.protocol import DTYPES

MAX_ID_LENGTH = 256
SHARD_KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
"""What the ZeRO engine's shard ids end with (``u17.exp_avg``): the kinds the swap
tier counts its bytes by. Any other id counts as ``other`` (bounded metric labels)."""


def shard_kind(shard_id: str) -> str:
    """The kind a shard's swap bytes are counted under (``SHARD_KINDS`` or ``other``)."""
    _unit, dot, kind = shard_id.rpartition(".")
    return kind if dot and kind in SHARD_KINDS else "other"


@dataclass
class Chunk:
    """One extent of a shard's swap copy: which swap dir, where, how long, its xxh3-64
    (seeded with the chunk's place, ``offloadd.swap.tier_io.chunk_seed``)."""

    dir_index: int
    offset: int
    nbytes: int
    checksum: int


@dataclass(eq=False)
class SwapPlacement:
    """Where a shard's swap copy lives. The table only holds it; the swap tier
    (``offloadd.swap.tier``) writes, reads and frees it, so the dependency runs one way."""

    chunks: list[Chunk]
    version: int
    gens: set[int] = field(default_factory=set)
    """Generations of the manifests (durable, or being committed) that name these
    extents: they are freed only once no such manifest is left."""
    released: bool = False
    """Its shard no longer uses it (a newer copy, or dropped): free when ``gens`` empties."""
    bound: bool = True
    """Chunk checksums are bound to their place (``offloadd.swap.tier_io.chunk_seed``); False only
    for copies recovered from a format-1 manifest, whose checksums cover the bytes alone."""
    reads: int = 0
    """Times these extents were read back into the arena: a second read of one version
    is a byte read twice (counted as ``reread_nbytes``)."""
    needed: bool = False
    """Something relied on this copy: its shard was evicted while it was current, or a
    manifest named it. A copy superseded or dropped before that was written for nothing
    (counted as ``writeback_unneeded_nbytes``)."""

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)


class Residency(enum.Enum):
    ARENA_DIRTY = "arena_dirty"  # in the arena only, or newer there than its swap copy
    ARENA_CLEAN = "arena_clean"  # in the arena and byte-identical to its swap copy ("both")
    NVME = "nvme"  # on swap only; holds no arena range
    READING = "reading"  # swap -> arena copy in flight; the arena range is reserved
    WRITING = "writing"  # arena -> swap write-back in flight; the arena copy stays readable


IN_ARENA = frozenset({Residency.ARENA_DIRTY, Residency.ARENA_CLEAN, Residency.WRITING})


@dataclass(eq=False)
class Shard:
    rank: int
    shard_id: str
    nbytes: int
    dtype: str
    residency: Residency = Residency.ARENA_DIRTY
    offset: int | None = None
    """Arena offset while the shard holds an arena range, else None."""
    version: int = 0
    """Bumped on every dirty release; swap copies record the version they hold."""
    readers: int = 0
    writer: bool = False
    last_use: int = 0
    """Logical clock of the last acquire, for LRU when no access trace is known."""
    optimizer_state: bool = False
    """An optimizer step has updated this shard as its master or a moment: with no
    access trace yet, it is next used one step after its last use
    (``scheduler.untraced_next_use``)."""
    swap: SwapPlacement | None = None
    """Where the last written swap copy lives (NVMe tier), if any."""
    pins: int = 0
    """Internal holds (IO in flight, a batch being made resident): never evicted while > 0."""
    io: asyncio.Future[None] | None = None
    """Completion of the swap read or write in flight, if any."""
    prefetched: bool = False
    """Brought in by prefetch and not yet used (for hit/late accounting)."""
    torn: bool = False
    """A write lease ended by an exception or its client's death: the arena bytes are
    half-written. Never written back; reads raise TornShardError until a writer
    releases it dirty again; a flush keeps its last written-back version."""
    unread: bool = False
    """Placed for a writer that overwrites it whole (the optimizer's ``param``) without
    reading its swap copy, which stays current: torn until the writer releases it
    dirty; given back unwritten, it leaves the arena again (``discard_unread``)."""
    serial: int = 0
    """Creation order within the job's table: the order a scan of the table meets it,
    which breaks ties between equal eviction keys (offloadd.memory.eviction)."""
    arena_nbytes: int = field(init=False, repr=False)
    """The arena range it needs (``nbytes`` page-aligned, at least one page); a shard's
    size never changes, so this is worked out once, not on every lease."""

    def __post_init__(self) -> None:
        self.arena_nbytes = align_up(max(self.nbytes, 1))

    @property
    def leased(self) -> bool:
        return self.readers > 0 or self.writer

    @property
    def evictable(self) -> bool:
        return self.in_arena and not self.leased and self.pins == 0 and self.io is None

    @property
    def in_arena(self) -> bool:
        return self.residency in IN_ARENA


class Lease:
    """One session's hold on one shard (reads may nest; a write lease is exclusive)."""

    __slots__ = ("count", "mode", "shard")

    def __init__(self, shard: Shard, mode: str) -> None:
        self.shard = shard
        self.mode = mode
        self.count = 0


def check_shard_ids(ids: Iterable[str]) -> None:
    for shard_id in ids:
        if not shard_id or len(shard_id) > MAX_ID_LENGTH:
            raise InvalidRequestError(
                f"shard id must be 1..{MAX_ID_LENGTH} characters, got {shard_id!r:.80}"
            )


def check_new_shard(shard_id: str, nbytes: int, dtype: str) -> None:
    if nbytes < 0:
        raise InvalidRequestError(f"shard {shard_id!r}: nbytes must be >= 0, got {nbytes}")
    if dtype not in DTYPES:
        raise InvalidRequestError(f"shard {shard_id!r}: dtype {dtype!r} is not one of {DTYPES}")


class ShardTable:
    """All shards of one job, keyed by ``(rank, shard_id)``, inside the job's arena."""

    _clock = itertools.count(1)

    def __init__(self, job: str, arena: Arena) -> None:
        self.job = job
        self.arena = arena
        self.shards: dict[tuple[int, str], Shard] = {}
        self.total_nbytes = 0
        """Arena bytes every shard of the job would need at once, resident or not."""
        self.id_nbytes = 0
        """Characters of every shard id (metadata the daemon holds; offloadd.service.limits)."""
        self._leased_nbytes = 0
        """Arena bytes of leased shards, counted as leases come and go (never a scan)."""
        self.changed: set[Shard] | None = None
        """Shards whose eviction candidacy or key may have changed, for the swap tier's
        eviction index (offloadd.memory.eviction) to re-key; None while no index exists."""
        self._serials = itertools.count()
        self.placed_at: dict[int, Shard] = {}
        """Placed shards by arena offset, and by the end of their range below: the
        neighbours of a range (``eviction.contiguous_victims``)."""
        self.placed_ending_at: dict[int, Shard] = {}

    def get(self, rank: int, shard_id: str) -> Shard:
        try:
            return self.shards[(rank, shard_id)]
        except KeyError:
            raise UnknownShardError(
                f"job {self.job!r} rank {rank} has no shard {shard_id!r}; alloc or put it first",
                [shard_id],
            ) from None

    def lookup(self, rank: int, ids: list[str]) -> list[Shard]:
        if len(ids) == 1:  # the common single-shard request: one dict look-up
            shard = self.shards.get((rank, ids[0]))
            if shard is not None:
                return [shard]
        missing = [i for i in ids if (rank, i) not in self.shards]
        if missing:
            raise UnknownShardError(
                f"job {self.job!r} rank {rank} has no shard(s) {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}; alloc or put them first",
                missing,
            )
        return [self.shards[(rank, i)] for i in ids]

    def check_fits(self, nbytes: int) -> None:
        """A single shard larger than the whole arena can never be served."""
        if align_up(max(nbytes, 1)) > self.arena.nbytes:
            raise OverBudgetError(
                f"a shard of {nbytes} bytes exceeds job {self.job!r}'s arena of "
                f"{self.arena.nbytes} bytes; ask for a larger arena_nbytes at hello or split it"
            )

    def create(self, rank: int, shard_id: str, nbytes: int, dtype: str) -> Shard:
        """Register a new shard without arena space yet (the caller places it)."""
        check_new_shard(shard_id, nbytes, dtype)
        if (rank, shard_id) in self.shards:
            raise ShardExistsError(f"shard {shard_id!r} already exists", [shard_id])
        self.check_fits(nbytes)
        shard = Shard(rank, shard_id, nbytes, dtype, residency=Residency.NVME,
                      serial=next(self._serials))
        self.shards[(rank, shard_id)] = shard
        self.total_nbytes += shard.arena_nbytes
        self.id_nbytes += len(shard_id)
        return shard

    def matches(self, shard: Shard, nbytes: int, dtype: str) -> None:
        if shard.nbytes != nbytes or shard.dtype != dtype:
            raise ShardExistsError(
                f"shard {shard.shard_id!r} exists with {shard.nbytes} bytes of {shard.dtype}, "
                f"not {nbytes} bytes of {dtype}; drop it first to change its size",
                [shard.shard_id],
            )

    def try_place(self, shard: Shard) -> bool:
        """Give ``shard`` an arena range if one is free now (no eviction here)."""
        if self.arena.withhold_due:  # its backing failed: no range the node cannot back
            self.arena.withhold_unbacked()
        offset = self.arena.allocator.alloc(shard.arena_nbytes)
        if offset is None and self.arena.restore_withheld():  # the node has room again
            offset = self.arena.allocator.alloc(shard.arena_nbytes)
        if offset is None:
            return False
        if not self.arena.placement_fits(offset, shard.arena_nbytes):  # the node is short
            self.arena.allocator.free(offset, shard.arena_nbytes)
            self.arena.withhold_unbacked()
            return False
        shard.offset = offset
        self.placed_at[offset] = shard
        self.placed_ending_at[offset + shard.arena_nbytes] = shard
        self.note_changed(shard)
        return True

    def place_unwritten(self, shard: Shard) -> bool:
        """Place a shard that has no swap copy: never written, so its bytes are
        undefined until a writer releases it. It is clean (nothing to write back);
        its first dirty release makes it ARENA_DIRTY."""
        if not self.try_place(shard):
            return False
        shard.residency = Residency.ARENA_CLEAN
        return True

    def place_unread(self, shard: Shard) -> bool:
        """Place a swapped-out shard for a writer that overwrites it whole, reading nothing.
        Its arena bytes are undefined: torn (reads refused, never written back) until the
        writer releases it dirty."""
        if not self.try_place(shard):
            return False
        shard.residency = Residency.ARENA_CLEAN
        shard.torn = shard.unread = True
        return True

    def discard_unread(self, shard: Shard) -> None:
        """The writer of an unread shard gave it back unwritten: its swap copy is current."""
        assert shard.unread and shard.swap is not None and not shard.leased
        self.unplace(shard)
        shard.residency = Residency.NVME
        shard.torn = shard.unread = False

    def unplace(self, shard: Shard) -> None:
        assert shard.offset is not None and not shard.leased
        self.arena.allocator.free(shard.offset, shard.arena_nbytes)
        self.arena.withhold_freed(shard.offset, shard.arena_nbytes)
        del self.placed_at[shard.offset]
        del self.placed_ending_at[shard.offset + shard.arena_nbytes]
        shard.offset = None
        self.note_changed(shard)

    def hand_over(self, source: Shard, target: Shard) -> None:
        """``target`` takes ``source``'s arena range as a new version of its bytes, dirty (a
        speculative step's commit: the state adopts the copy the step wrote); the range
        ``target`` held, if any, is freed and ``source`` is left without one. Neither may be
        leased, pinned or in IO; ``source`` must be in the arena and whole."""
        for shard in (source, target):
            assert not shard.leased and not shard.pins and shard.io is None, shard.shard_id
        assert source.offset is not None and source.in_arena and not source.torn
        assert source.arena_nbytes == target.arena_nbytes
        if target.offset is not None:
            self.unplace(target)
        offset = source.offset
        self.placed_at[offset] = target
        self.placed_ending_at[offset + source.arena_nbytes] = target
        source.offset, target.offset = None, offset
        source.residency = Residency.NVME  # placed nowhere, as a shard not made resident yet
        target.residency = Residency.ARENA_DIRTY
        target.version += 1
        target.torn = target.unread = False
        self.note_changed(source)
        self.note_changed(target)

    def remove(self, shard: Shard) -> None:
        if shard.offset is not None:
            self.unplace(shard)
        del self.shards[(shard.rank, shard.shard_id)]
        self.total_nbytes -= shard.arena_nbytes
        self.id_nbytes -= len(shard.shard_id)
        self.note_changed(shard)

    def touch(self, shard: Shard) -> None:
        shard.last_use = next(self._clock)
        changed = self.changed
        if changed is not None:
            changed.add(shard)

    def note_changed(self, shard: Shard) -> None:
        """Residency, pins, IO or lease of ``shard`` changed (see ``changed``)."""
        changed = self.changed
        if changed is not None:
            changed.add(shard)

    def overcommitted(self) -> bool:
        """True when the job's shards cannot all be resident: eviction is certain."""
        return self.total_nbytes > self.arena.nbytes

    def resident_nbytes(self) -> int:
        return self.arena.allocator.used_nbytes

    def leased_nbytes(self) -> int:
        return self._leased_nbytes

    def grant(self, leases: dict[Shard, Lease], shard: Shard, mode: str) -> None:
        """Record a lease that ``check_grantable`` allowed."""
        if not shard.readers and not shard.writer:
            self._leased_nbytes += shard.arena_nbytes
        grant(leases, shard, mode)
        changed = self.changed
        if changed is not None:
            changed.add(shard)

    def give_back(self, leases: dict[Shard, Lease], shard: Shard, dirty: bool,
                  torn: bool = False) -> bool:
        """Drop one lease (see the module's ``give_back``), keeping the leased-bytes count."""
        dirtied = give_back(leases, shard, dirty, torn)
        if not shard.readers and not shard.writer:
            self._leased_nbytes -= shard.arena_nbytes
        changed = self.changed
        if changed is not None:
            changed.add(shard)
        return dirtied


def check_grantable(shards: list[Shard], mode: str) -> None:
    """Raise LeaseConflictError if any lease of the batch cannot be granted.

    Checked for the whole batch before any lease is taken, so a conflict leaks
    nothing; ``grant`` then only records.
    """
    if mode == "w":
        check_writable(shards)
        return
    for shard in shards:
        if shard.torn:
            raise TornShardError(
                f"shard {shard.shard_id!r} was torn: its last write lease ended by an error or "
                "its client's death; write it again (acquire 'w' and release) before reading",
                [shard.shard_id])
        if shard.writer:
            raise LeaseConflictError(
                f"shard {shard.shard_id!r} is leased for writing; release it first",
                [shard.shard_id],
            )


def check_writable(shards: list[Shard]) -> None:
    """Write leases are exclusive: no shard of the batch leased, nor named twice."""
    seen: set[int] = set()
    for shard in shards:
        if shard.leased or id(shard) in seen:
            holder = "for writing" if shard.writer else f"by {shard.readers} reader(s)"
            raise LeaseConflictError(
                f"shard {shard.shard_id!r} is already leased "
                f"({holder if shard.leased else 'twice in this batch'}); "
                "release it before acquiring for writing",
                [shard.shard_id],
            )
        seen.add(id(shard))


def grant(leases: dict[Shard, Lease], shard: Shard, mode: str) -> None:
    """Record a lease that ``check_grantable`` allowed."""
    if mode == "w":
        assert not shard.leased, f"write lease on busy shard {shard.shard_id!r}"
        shard.writer = True
    else:
        assert not shard.writer, f"read lease on written shard {shard.shard_id!r}"
        shard.readers += 1
    held = leases.get(shard)
    if held is None:
        held = leases[shard] = Lease(shard, mode)
    held.count += 1


def give_back(leases: dict[Shard, Lease], shard: Shard, dirty: bool, torn: bool = False
              ) -> bool:
    """Drop one lease; returns True when a write lease was released dirty (a new version).

    A write lease released ``torn`` publishes nothing: the shard keeps its version
    and swap copy, is marked torn, and its arena bytes are never written back.
    """
    held = leases.get(shard)
    if held is None:
        raise NotLeasedError(
            f"shard {shard.shard_id!r} is not leased by this session", [shard.shard_id]
        )
    held.count -= 1
    if held.count == 0:
        del leases[shard]
    if held.mode == "w":
        shard.writer = False
    else:
        shard.readers -= 1
    if held.mode == "w" and torn:
        mark_torn(shard)
        return False
    if held.mode == "w" and dirty:
        shard.torn = False
        shard.version += 1
        shard.residency = Residency.ARENA_DIRTY
        return True
    return False


def mark_torn(shard: Shard) -> None:
    """The arena bytes are garbage: clean (evictable, never written back), reads refused."""
    shard.torn = True
    if shard.residency is Residency.ARENA_DIRTY:
        shard.residency = Residency.ARENA_CLEAN


def check_mode(mode: str) -> None:
    if mode not in ("r", "w"):
        raise InvalidRequestError(f"mode must be 'r' or 'w', got {mode!r}")
