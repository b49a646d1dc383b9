"""make_room frees one contiguous range: ``contiguous_victims`` against a brute force.

An arena holds shards of two sizes (as bf16 params and gradients beside fp32 state)
with free holes between them. For a request bigger than every hole, the victims
``contiguous_victims`` returns must be among the ranked candidates, free one range of
the request's size once evicted, and be the best such set: no contiguous run of
free ranges and candidates reaches the size with a better-ranked worst member
(a brute force over every run in offset order).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _tier_job import settle, tier_job
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from offloadd.errors import OverBudgetError
from offloadd.memory.arena import Arena
from offloadd.memory.eviction import contiguous_victims
from offloadd.memory.shards import Lease, Shard, ShardTable

PAGE = 4096
SMALL, LARGE = 2 * PAGE, 4 * PAGE


def fill(table: ShardTable, layout: list[str]) -> list[Shard]:
    """Place shards (and holes: 'f' a small, 'F' a large one) in layout order."""
    shards, holes = [], []
    for index, kind in enumerate(layout):
        nbytes = SMALL if kind in "sf" else LARGE
        shard = table.create(0, f"s{index}", nbytes, "uint8")
        assert table.place_unwritten(shard)
        (holes if kind in "fF" else shards).append(shard)
    rest = table.arena.allocator.free_nbytes
    if rest:  # the arena past the layout is held by a shard that is no candidate
        assert table.place_unwritten(table.create(0, "rest", rest, "uint8"))
    for hole in holes:
        table.remove(hole)
    return shards


def best_worst_rank(table: ShardTable, rank_of: dict[Shard, int], need: int) -> int | None:
    """The least worst rank of any run of free ranges and ranked shards of ``need`` bytes."""
    allocator = table.arena.allocator
    pieces = sorted([(e.offset, e.nbytes, None) for e in allocator.free_extents()]
                    + [(s.offset, s.arena_nbytes, s) for s in table.placed_at.values()],
                    key=lambda piece: piece[0])
    best = None
    for first in range(len(pieces)):
        size, worst = 0, -2
        for _offset, nbytes, shard in pieces[first:]:
            if shard is not None:
                if shard not in rank_of:
                    break
                worst = max(worst, rank_of[shard])
            size += nbytes
            if size >= need:
                if worst > -2 and (best is None or worst < best):
                    best = worst
                break
    return best


@settings(max_examples=300, deadline=None)
@given(layout=st.lists(st.sampled_from("sSfF"), min_size=1, max_size=40),
       seed=st.integers(0, 2**32 - 1), ranked_fraction=st.floats(0.0, 1.0),
       pending_count=st.integers(0, 2), need=st.sampled_from([SMALL, LARGE, 3 * LARGE]))
def test_contiguous_victims_frees_the_best_ranked_run(layout: list[str], seed: int,
                                                      ranked_fraction: float,
                                                      pending_count: int, need: int) -> None:
    arena = Arena("window", sum(SMALL if kind in "sf" else LARGE for kind in layout), lock=False)
    try:
        table = ShardTable("window", arena)
        shards = fill(table, layout)
        generator = random.Random(seed)
        ranked = [s for s in shards if generator.random() < ranked_fraction]
        generator.shuffle(ranked)
        pending = ranked[:pending_count]
        ranked = ranked[pending_count:]
        if arena.allocator.largest_free() >= need:
            return  # make_room returns before picking
        rank_of = {shard: -1 for shard in pending}
        rank_of.update((shard, index) for index, shard in enumerate(ranked))

        victims = contiguous_victims(table, ranked, need, pending=pending)
        event(f"victims: {'none' if victims is None else len(victims)}")

        expected = best_worst_rank(table, rank_of, need)
        if expected is None:
            assert victims is None
            return
        assert victims is not None
        assert set(victims) <= set(rank_of)
        assert max(rank_of[v] for v in victims) == expected
        for victim in victims:
            table.unplace(victim)
        assert arena.allocator.largest_free() >= need
    finally:
        arena.close()


async def room_for_a_large_shard(root: Path, layout: list[str], order_seed: int,
                                 dirty: bool) -> tuple[list[tuple[int, int]], int]:
    """A job's arena filled in ``layout`` order (holes dropped), its shards used in a
    random order (clean or dirty), then a large shard written: the ranges of the
    shards evicted for it, and its own offset."""
    arena = sum(SMALL if kind in "sf" else LARGE for kind in layout)
    async with tier_job(root, "window", arena, chunk_nbytes=PAGE) as job:
        ids = [f"s{index}" for index in range(len(layout))]
        sizes = [SMALL if kind in "sf" else LARGE for kind in layout]
        await settle(job.alloc(0, ids, sizes, ["uint8"] * len(ids)))
        await settle(job.drop(0, [i for i, kind in zip(ids, layout, strict=True)
                                  if kind in "fF"]))
        kept = [i for i, kind in zip(ids, layout, strict=True) if kind in "sS"]
        random.Random(order_seed).shuffle(kept)
        for shard_id in kept:  # least recently used first: the victim order
            leases: dict[Shard, Lease] = {}
            await settle(job.acquire(0, [shard_id], "w" if dirty else "r", leases))
            await settle(job.release(0, [shard_id], dirty, leases))
        placed = {s: s.offset for s in job.table.shards.values() if s.offset is not None}
        await settle(job.alloc(0, ["large"], [LARGE], ["uint8"]))
        leases = {}
        await settle(job.acquire(0, ["large"], "w", leases))
        large = job.table.get(0, "large").offset
        assert large is not None
        await settle(job.release(0, ["large"], True, leases))
        evicted = [(offset, s.arena_nbytes) for s, offset in placed.items()
                   if s.offset is None and offset is not None]
        return evicted, large


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(layout=st.lists(st.sampled_from("sSf"), min_size=4, max_size=24)
       .filter(lambda layout: "f" in layout and "ff" not in "".join(layout)),
       order_seed=st.integers(0, 2**32 - 1), dirty=st.booleans())
@example(layout=list("SSSSsssSsssSssssfSsSs"), order_seed=143, dirty=True)  # see below
def test_make_room_evicts_one_range_not_victims_scattered_over_the_holes(
        tmp_path_factory: pytest.TempPathFactory, run_async: Callable[..., Any],
        layout: list[str], order_seed: int, dirty: bool) -> None:
    """Free ranges too small for the request (holes of a small shard) with the shards
    used least recently scattered between them: every shard evicted for the request
    lies under the range it gets. Picking victims in order alone evicted shards
    elsewhere until two holes happened to meet (6-8 pages for a 4-page shard). The
    example: all dirty, the write-behind cleaning other shards while the first window's
    are written, and the clean half of a window evicted before the pick moved on to
    another (19 of 20 runs, before make_room evicted a window only once all of it was
    clean)."""
    root = tmp_path_factory.mktemp("window")
    try:
        evicted, large = run_async(room_for_a_large_shard(root, layout, order_seed, dirty),
                                   timeout_s=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elsewhere = [(offset, nbytes) for offset, nbytes in evicted
                 if offset + nbytes <= large or offset >= large + LARGE]
    assert not elsewhere, f"evicted {evicted}, the shard went to {large}"


async def leased_apart(root: Path) -> tuple[str, ShardTable]:
    """Five large shards fill a job's arena but a small tail; the 1st, 3rd and 5th stay
    leased (a rank holding them), so evicting the other two frees two large pieces and
    the tail, more bytes than one more large shard needs but in no piece that holds it:
    the request's error."""
    async with tier_job(root, "apart", 5 * LARGE + SMALL, chunk_nbytes=PAGE) as job:
        ids = [f"s{index}" for index in range(5)]
        await settle(job.alloc(0, ids, [LARGE] * 5, ["uint8"] * 5))
        leases: dict[Shard, Lease] = {}
        for shard_id in ids:
            await settle(job.acquire(0, [shard_id], "w", leases))
        for shard_id in ids[1::2]:
            await settle(job.release(0, [shard_id], True, leases))
        await settle(job.alloc(0, ["one_more"], [LARGE + SMALL], ["uint8"]))
        with pytest.raises(OverBudgetError) as refused:
            await settle(job.acquire(0, ["one_more"], "w", {}))
        return str(refused.value), job.table


def test_an_arena_too_fragmented_for_a_request_says_so(
        tmp_path: Path, run_async: Callable[..., Any]) -> None:
    """The over-budget error names the free bytes and the largest piece of them, read
    here from the table it refused in: free bytes in pieces too small for the request
    were the one figure missing from a failure seen in the suite (a 16 MiB arena with
    room by the byte count and none by the piece)."""
    message, table = run_async(leased_apart(tmp_path), timeout_s=60)
    allocator = table.arena.allocator
    assert allocator.free_nbytes >= LARGE + SMALL > allocator.largest_free()
    assert (f"leased {3 * LARGE}, pinned 0, withheld 0, free {allocator.free_nbytes} of "
            f"which {allocator.largest_free()} in one piece") in message, message
    assert "release leases or acquire fewer shards at once" in message


async def room_back_before_eviction(root: Path) -> tuple[list[bool], int, int]:
    async with tier_job(root, "back", 4 * LARGE, chunk_nbytes=PAGE) as job:
        ids = ["a", "b", "c"]
        await settle(job.alloc(0, ids[:2], [LARGE] * 2, ["uint8"] * 2))
        for shard_id in ids[:2]:
            leases: dict[Shard, Lease] = {}
            await settle(job.acquire(0, [shard_id], "w", leases))
            await settle(job.release(0, [shard_id], True, leases))
        allocator = job.arena.allocator
        for extent in allocator.free_extents():  # as a failed backing leaves it
            allocator.withhold(extent.offset, extent.nbytes)
        await settle(job.alloc(0, ["c"], [LARGE], ["uint8"]))
        leases = {}
        await settle(job.acquire(0, ["c"], "w", leases))
        await settle(job.release(0, ["c"], True, leases))
        resident = [job.table.get(0, shard_id).in_arena for shard_id in ids]
        return resident, allocator.withheld_nbytes, job.arena.restored_nbytes


def test_a_job_with_swap_gets_withheld_room_back_before_it_evicts(
        tmp_path: Path, run_async: Callable[..., Any]) -> None:
    """Withheld pages come back (the node has room: this host's) before anything is
    evicted for a new shard: the shards in the arena stay there."""
    resident, withheld, restored = run_async(room_back_before_eviction(tmp_path), timeout_s=60)
    assert resident == [True, True, True]
    assert withheld == 0 and restored == 2 * LARGE
