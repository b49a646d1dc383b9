"""The arena and its allocator, without a daemon.

The allocator is checked against a page-bitmap reference model by a hypothesis state
machine; the arena against the kernel (``/proc/self/fd``, ``fstat``, ``VmLck``).
"""

from __future__ import annotations

import mmap
import os
import resource

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from offloadd.errors import OverBudgetError
from offloadd.memory.arena import (
    HUGE_PAGE_NBYTES,
    PAGE_NBYTES,
    Allocator,
    Arena,
    Extent,
    align_up,
    buffer_address,
    free_huge_pages,
)

PAGE = PAGE_NBYTES


# -- allocator: examples -----------------------------------------------------------------


def test_capacity_must_be_whole_pages() -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        Allocator(PAGE + 1)


def test_allocations_are_page_aligned_and_rounded_up() -> None:
    allocator = Allocator(16 * PAGE)
    first, second = allocator.alloc(1), allocator.alloc(PAGE + 1)
    assert (first, second) == (0, PAGE)
    assert allocator.used_nbytes == 3 * PAGE
    assert allocator.alloc(0) == 3 * PAGE  # an empty shard still gets its own page
    assert all(e.offset % PAGE == 0 for e in allocator.free_extents())


def test_full_allocator_returns_none_and_a_free_makes_room() -> None:
    allocator = Allocator(4 * PAGE)
    offsets = [allocator.alloc(PAGE) for _ in range(4)]
    assert allocator.alloc(1) is None
    assert allocator.largest_free() == 0 and allocator.free_nbytes == 0
    allocator.free(offsets[2], PAGE)
    assert allocator.alloc(PAGE) == offsets[2]


def test_best_fit_takes_the_smallest_hole_that_fits() -> None:
    allocator = Allocator(16 * PAGE)
    a, _, c, _, e, _ = (allocator.alloc(n * PAGE) for n in (3, 1, 1, 1, 2, 1))
    allocator.free(a, 3 * PAGE)  # holes: 3 pages at 0, 1 at c, 2 at e, 7 at the end
    allocator.free(c, PAGE)
    allocator.free(e, 2 * PAGE)
    assert allocator.alloc(2 * PAGE) == e
    assert allocator.alloc(PAGE) == c
    assert allocator.alloc(3 * PAGE) == a


def test_free_coalesces_with_both_neighbours() -> None:
    allocator = Allocator(8 * PAGE)
    a, b, c = (allocator.alloc(PAGE) for _ in range(3))
    allocator.free(a, PAGE)
    allocator.free(c, PAGE)  # merges with the free tail
    assert allocator.free_extents() == [Extent(0, PAGE), Extent(2 * PAGE, 6 * PAGE)]
    allocator.free(b, PAGE)  # merges left and right
    assert allocator.free_extents() == [Extent(0, 8 * PAGE)]
    assert allocator.largest_free() == 8 * PAGE and allocator.used_nbytes == 0


def test_double_free_is_caught() -> None:
    allocator = Allocator(4 * PAGE)
    offset = allocator.alloc(PAGE)
    allocator.free(offset, PAGE)
    with pytest.raises(AssertionError, match="double free"):
        allocator.free(offset, PAGE)


# -- allocator: state machine against a reference model --------------------------------


def free_runs(used: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of free pages as (first page, page count)."""
    runs, start = [], None
    for page, taken in enumerate([*used, True]):
        if not taken and start is None:
            start = page
        elif taken and start is not None:
            runs.append((start, page - start))
            start = None
    return runs


class AllocatorModel(RuleBasedStateMachine):
    """Every page is free or owned by one allocation; the allocator must agree exactly."""

    blocks = Bundle("blocks")

    @initialize(pages=st.integers(1, 64))
    def start(self, pages: int) -> None:
        self.allocator = Allocator(pages * PAGE)
        self.used = [False] * pages
        self.withheld: set[int] = set()
        """Pages withheld (marked used in ``used``, back to free only by ``restore``)."""

    @rule(target=blocks, nbytes=st.integers(0, 20 * PAGE))
    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        pages = max(1, -(-nbytes // PAGE))
        offset = self.allocator.alloc(nbytes)
        if offset is None:
            # Only fails when no run of free pages is long enough (no false "full").
            assert all(length < pages for _, length in free_runs(self.used))
            return None
        assert offset % PAGE == 0
        first = offset // PAGE
        assert first + pages <= len(self.used), "allocation past the capacity"
        assert not any(self.used[first : first + pages]), "allocation overlaps a live one"
        # Best fit: the chosen run is the smallest free run that can hold it.
        fitting = [length for _, length in free_runs(self.used) if length >= pages]
        chosen = next(length for start, length in free_runs(self.used)
                      if start <= first < start + length)
        assert chosen == min(fitting)
        self.used[first : first + pages] = [True] * pages
        return offset, nbytes

    @rule(block=consumes(blocks))
    def free(self, block: tuple[int, int] | None) -> None:
        if block is None:
            return
        offset, nbytes = block
        self.allocator.free(offset, nbytes)
        pages = max(1, -(-nbytes // PAGE))
        self.used[offset // PAGE : offset // PAGE + pages] = [False] * pages

    @rule(page=st.integers(0, 63), pages=st.integers(1, 8))
    def withhold(self, page: int, pages: int) -> None:
        """Take free pages out (an arena's pages the node could not back)."""
        run = next(((start, length) for start, length in free_runs(self.used)
                    if start <= page < start + length), None)
        if run is None:
            return
        pages = min(pages, run[0] + run[1] - page)
        self.allocator.withhold(page * PAGE, pages * PAGE)
        self.used[page : page + pages] = [True] * pages
        self.withheld.update(range(page, page + pages))

    @rule()
    def restore(self) -> None:
        """Every withheld page back, coalesced with its free neighbours (the node has room
        again)."""
        assert self.allocator.restore_withheld() == len(self.withheld) * PAGE
        for page in self.withheld:
            self.used[page] = False
        self.withheld.clear()

    @invariant()
    def agrees_with_the_model(self) -> None:
        runs = free_runs(self.used)
        assert self.allocator.used_nbytes == (sum(self.used) - len(self.withheld)) * PAGE
        assert self.allocator.withheld_nbytes == len(self.withheld) * PAGE
        assert self.allocator.free_nbytes == (len(self.used) - sum(self.used)) * PAGE
        assert self.allocator.largest_free() == max((n for _, n in runs), default=0) * PAGE
        # Coalesced: the free list is exactly the maximal runs (never two touching extents).
        assert self.allocator.free_extents() == [Extent(s * PAGE, n * PAGE) for s, n in runs]

    def teardown(self) -> None:
        self.restore()
        for page, taken in enumerate(self.used):  # free every page still held, one by one
            if taken:
                self.allocator.free(page * PAGE, PAGE)
        assert self.allocator.free_extents() == [Extent(0, len(self.used) * PAGE)]
        assert self.allocator.used_nbytes == 0


AllocatorModel.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                            deadline=None)
test_allocator_matches_a_page_bitmap_model = AllocatorModel.TestCase


# -- arena ------------------------------------------------------------------------------


def locked_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


def test_arena_is_a_fully_backed_memfd_of_whole_pages() -> None:
    arena = Arena("unit", 3 * PAGE + 1, lock=False)
    try:
        assert arena.nbytes == align_up(3 * PAGE + 1) == 4 * PAGE
        assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:offloadd:unit")
        stat = os.fstat(arena.fd)
        assert stat.st_size == arena.nbytes
        assert stat.st_blocks * 512 >= arena.nbytes  # backed up front, not lazily
        assert not arena.locked
    finally:
        arena.close()


def test_a_second_mapping_of_the_fd_sees_the_same_bytes() -> None:
    arena = Arena("shared", 2 * PAGE, lock=False)
    other = mmap.mmap(arena.fd, arena.nbytes, flags=mmap.MAP_SHARED)
    try:
        arena.slice(PAGE, 5)[:] = b"hello"
        assert other[PAGE : PAGE + 5] == b"hello"
        other[0:3] = b"abc"
        assert bytes(arena.slice(0, 3)) == b"abc"
    finally:
        other.close()
        arena.close()


def mlock_allowed(nbytes: int) -> bool:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= nbytes


def test_arena_is_mlocked_when_the_limit_allows() -> None:
    nbytes = 8 << 20
    before = locked_kib()
    arena = Arena("locked", nbytes, lock=True)
    try:
        assert arena.locked == mlock_allowed(nbytes)
        if arena.locked:
            assert locked_kib() - before >= nbytes // 1024
    finally:
        arena.close()
    if arena.locked:
        assert locked_kib() - before < nbytes // 1024  # munlock'ed on close


# -- huge pages --------------------------------------------------------------------------

HUGE = HUGE_PAGE_NBYTES


def kernel_page_kib(address: int) -> int:
    """KernelPageSize of the mapping that contains ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "KernelPageSize:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping contains {address:#x}")


def test_a_hugetlb_arena_is_whole_2mib_pages_shared_through_its_fd(huge_pages) -> None:
    huge_pages(2)
    arena = Arena("huge", HUGE + 1, lock=False, hugepages="on")
    other = mmap.mmap(arena.fd, arena.nbytes, flags=mmap.MAP_SHARED)
    try:
        assert arena.hugepages and arena.nbytes == 2 * HUGE
        assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:offloadd:huge")
        assert kernel_page_kib(arena.address) == HUGE // 1024
        arena.slice(HUGE + 7, 5)[:] = b"hello"
        assert other[HUGE + 7 : HUGE + 12] == b"hello"
        assert arena.allocator.capacity == arena.nbytes
    finally:
        other.close()
        arena.close()


def test_auto_keeps_4k_pages_when_rounding_up_would_exceed_the_budget(huge_pages) -> None:
    huge_pages(1)
    arena = Arena("tight", HUGE - PAGE, lock=False, hugepages="auto", max_nbytes=HUGE - PAGE)
    try:
        assert not arena.hugepages and arena.nbytes == HUGE - PAGE
        assert kernel_page_kib(arena.address) == PAGE // 1024
    finally:
        arena.close()


def test_on_refuses_an_arena_that_rounding_to_2mib_pushes_over_the_budget() -> None:
    with pytest.raises(OverBudgetError, match="multiple of 2 MiB"):
        Arena("tight", HUGE - PAGE, lock=False, hugepages="on", max_nbytes=HUGE - PAGE)


def short_pool_nbytes() -> int:
    """An arena one 2 MiB page bigger than the free pool (skip if the pool is large)."""
    free = free_huge_pages()
    if free > 64:
        pytest.skip(f"{free} free huge pages: too many to exhaust in a test")
    return (free + 1) * HUGE


def test_without_enough_huge_pages_auto_falls_back_and_on_names_the_sysctl() -> None:
    nbytes = short_pool_nbytes()
    arena = Arena("fallback", nbytes, lock=False, hugepages="auto")
    try:
        assert not arena.hugepages and arena.nbytes == nbytes
    finally:
        arena.close()
    with pytest.raises(OverBudgetError, match=r"vm\.nr_hugepages"):
        Arena("insist", nbytes, lock=False, hugepages="on")


def numpy_address(buffer: object) -> int:
    """The reference: numpy's view of the same bytes."""
    import numpy as np

    view = memoryview(buffer)  # type: ignore[arg-type]
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def test_buffer_address_is_numpys_for_every_kind_of_buffer() -> None:
    """Read-only buffers included (ctypes' from_buffer refuses them), empty ones 0."""
    with mmap.mmap(-1, 1 << 20) as mapping:
        whole = memoryview(mapping)
        cases: list[object] = [mapping, whole, whole[4096:8192], whole[1:], whole.toreadonly(),
                               whole[0:0], b"read-only bytes", bytearray(b"writable"),
                               memoryview(b"a slice of bytes")[3:], b""]
        for case in cases:
            assert buffer_address(case) == numpy_address(case), case  # type: ignore[arg-type]
        with pytest.raises(BufferError, match="contiguous"):
            buffer_address(memoryview(bytearray(16))[::2])
        for view in (whole, *(c for c in cases if isinstance(c, memoryview))):
            view.release()
