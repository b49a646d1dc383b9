"""The arena allocator's indexed best fit against a brute-force model, and lease accounting
kept as a counter rather than a scan of the shard table."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from offloadd.memory.arena import PAGE_NBYTES, Allocator, Arena
from offloadd.memory.shards import Lease, Shard, ShardTable

PAGES = 64


def best_fit(free: dict[int, int], need: int) -> int | None:
    """The smallest free range that fits, lowest offset first among equals."""
    fits = sorted((size, offset) for offset, size in free.items() if size >= need)
    return fits[0][1] if fits else None


def coalesced(free: dict[int, int]) -> dict[int, int]:
    merged: dict[int, int] = {}
    for offset in sorted(free):
        last = max(merged, default=None)
        if last is not None and last + merged[last] == offset:
            merged[last] += free[offset]
        else:
            merged[offset] = free[offset]
    return merged


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)), max_size=80))
def test_alloc_and_free_match_a_brute_force_best_fit(ops: list[tuple[bool, int, int]]) -> None:
    allocator = Allocator(PAGES * PAGE_NBYTES)
    model = {0: PAGES * PAGE_NBYTES}
    held: list[tuple[int, int]] = []
    for is_alloc, pages, pick in ops:
        if is_alloc or not held:
            need = pages * PAGE_NBYTES
            expected = best_fit(model, need)
            assert allocator.alloc(need - 1) == expected
            if expected is not None:
                size = model.pop(expected)
                if size > need:
                    model[expected + need] = size - need
                held.append((expected, need))
        else:
            offset, nbytes = held.pop(pick % len(held))
            allocator.free(offset, nbytes)
            model = coalesced({**model, offset: nbytes})
        assert {e.offset: e.nbytes for e in allocator.free_extents()} == model
        assert allocator.largest_free() == max(model.values(), default=0)
        assert allocator.free_nbytes == sum(model.values())


def test_a_failing_alloc_in_a_fragmented_allocator_leaves_it_unchanged() -> None:
    allocator = Allocator(20_000 * PAGE_NBYTES)
    offsets = [allocator.alloc(PAGE_NBYTES) for _ in range(20_000)]
    for offset in offsets[::2]:
        allocator.free(offset, PAGE_NBYTES)  # type: ignore[arg-type]
    before = allocator.free_extents()
    assert len(before) == 10_000
    assert allocator.alloc(2 * PAGE_NBYTES) is None
    assert allocator.free_extents() == before
    assert allocator.reserve(offsets[0], PAGE_NBYTES) is None  # type: ignore[arg-type, func-returns-value]
    assert allocator.alloc(PAGE_NBYTES) == offsets[2]


def test_leased_nbytes_follows_grants_and_releases_without_a_scan() -> None:
    arena = Arena("leases", 64 * PAGE_NBYTES, lock=False)
    try:
        table = ShardTable("leases", arena)
        shards = [table.create(0, f"s{i}", (i + 1) * 1000, "uint8") for i in range(6)]
        session_a: dict[Shard, Lease] = {}
        session_b: dict[Shard, Lease] = {}

        def scanned() -> int:
            return sum(s.arena_nbytes for s in table.shards.values() if s.leased)

        table.grant(session_a, shards[0], "w")
        table.grant(session_a, shards[1], "r")
        table.grant(session_b, shards[1], "r")
        table.grant(session_b, shards[2], "r")
        table.grant(session_b, shards[2], "r")
        assert table.leased_nbytes() == scanned() == 3 * PAGE_NBYTES
        assert table.give_back(session_a, shards[0], dirty=True)
        table.give_back(session_a, shards[1], dirty=False)
        assert table.leased_nbytes() == scanned() == 2 * PAGE_NBYTES
        table.give_back(session_b, shards[2], dirty=False)
        assert table.leased_nbytes() == scanned() == 2 * PAGE_NBYTES
        table.give_back(session_b, shards[2], dirty=False)
        table.give_back(session_b, shards[1], dirty=False)
        assert table.leased_nbytes() == scanned() == 0
    finally:
        arena.close()
