"""Staging buffers for O_DIRECT swap IO of arenas on 4 KiB pages.

An arena without reserved huge pages is a shmem memfd on 4 KiB pages, physically
scattered: the block layer splits each 4 MiB O_DIRECT chunk over such pages into
several requests (5-7 on a virtio disk whose ``max_segments`` is 254; see
bench/README.md and ``bench/arena_pages.py``), and the drive runs below its speed.
Transparent huge pages would fix that, but shmem's (``shmem_enabled``) are off by
default, while private anonymous memory advised ``MADV_HUGEPAGE`` gets them under
the common distros' default ``enabled`` (``madvise`` or ``always``). So the swap tier
stages such IO through chunk-sized slots of that memory (one request per chunk):
a write copies the arena bytes into a slot and writes the slot; a read reads into a
slot and copies it into the arena. The copy runs on a worker thread at memory speed
and takes the chunk's checksum on the way (from the slot, which no rank can touch),
so the event loop does neither. A hugetlb arena needs none of this: its IO runs in
place, as does IO to a swap dir without O_DIRECT (the page cache copies anyway).
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from functools import partial
from pathlib import Path

import xxhash

from offloadd.memory.arena import HUGE_PAGE_NBYTES, align_up, buffer_address

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> str:
    """The kernel's THP mode for anonymous memory ("always", "madvise", "never"; "" unknown)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


class BouncePool:
    """``num_slots`` staging slots of ``slot_nbytes`` each (rounded up to 2 MiB), 2 MiB
    aligned, in one private anonymous mapping advised ``MADV_HUGEPAGE``.

    The mapping is made on the first ``take`` (or ``prefault``) and costs memory only
    for the slots ever used; free slots are handed out last-in first-out, so a light
    load touches few of them. ``prefault`` backs them all ahead of the first swap-out.
    ``take`` never waits: the swap space takes a slot only while it holds one of the
    IO queue's ``io_queue_depth`` places and sizes the pool to that depth, so a slot is
    free whenever it asks; where none is (or a chunk is larger than a slot, as a
    manifest from a bigger ``chunk_size`` can name) the IO runs in place instead,
    slower but the same bytes.
    """

    def __init__(self, num_slots: int, slot_nbytes: int) -> None:
        if num_slots < 1 or slot_nbytes < 1:
            raise ValueError(f"a bounce pool needs num_slots >= 1 and slot_nbytes >= 1, got "
                             f"{num_slots} and {slot_nbytes}")
        self.num_slots = num_slots
        self.slot_nbytes = align_up(slot_nbytes, HUGE_PAGE_NBYTES)
        self.staged_nbytes = {"read": 0, "write": 0}
        """Bytes of swap IO that went through a slot, by op (plain fields, for stats)."""
        self.prefaulted = 0
        """Slots ``prefault`` has backed."""
        self.direct_count = 0
        """IO requests of a 4 KiB-page arena that found no fitting slot and ran in place."""
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._free: list[int] = []
        self._in_use: dict[int, int] = {}
        """id of each slot view handed out -> its slot index."""

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def take(self, nbytes: int) -> memoryview | None:
        """A free slot's first ``nbytes`` bytes, or None (too large, or none free)."""
        if nbytes > self.slot_nbytes:
            return None
        if self._view is None:
            self._open()
        if not self._free:
            return None
        return self._hand_out(self._free.pop(), nbytes)

    def _hand_out(self, index: int, nbytes: int) -> memoryview:
        assert self._view is not None
        start = index * self.slot_nbytes
        slot = self._view[start:start + nbytes]
        self._in_use[id(slot)] = index
        return slot

    async def prefault(self, copy_pool: Executor | None) -> None:
        """Back every free slot's pages now, one slot at a time on ``copy_pool`` (the slot
        taken meanwhile), instead of at the first IO through it.

        A slot's first touch allocates and zeroes its huge pages: on the 2-core VM that
        took 30-65 ms a slot at times, so the first write-backs of a fresh daemon waited
        up to a second for their copies (bench/README.md, eighth session). A slot in
        use is skipped: its IO touches it."""
        loop = asyncio.get_running_loop()
        if self._view is None:
            self._open()
        for index in range(self.num_slots):
            if index not in self._free:
                continue
            self._free.remove(index)
            slot = self._hand_out(index, self.slot_nbytes)
            touched = loop.run_in_executor(copy_pool, _touch, slot)
            try:
                await asyncio.shield(touched)
            finally:
                # Hazard: the thread writes the slot until its future is done; only then
                # may the slot go back, cancelled or not.
                if touched.done():
                    self.give(slot)
                else:
                    touched.add_done_callback(partial(_give_back, self, slot))
            self.prefaulted += 1

    def give(self, slot: memoryview) -> None:
        """Return a slot from ``take``; only once the kernel is done with its bytes."""
        self._free.append(self._in_use.pop(id(slot)))
        slot.release()

    async def transfer(self, op: str, view: memoryview, slot: memoryview, seed: int | None,
                       copy_pool: Executor | None,
                       submit: Callable[[memoryview], Awaitable[None]]) -> int | None:
        """Move ``view``'s bytes through ``slot`` (from ``take``): a write copies them in,
        then ``submit``s the slot; a read ``submit``s the slot, then copies it out. Returns
        the seeded xxh3 of the slot's bytes, taken during the copy (None: no seed). The
        slot goes back to the pool at the end, failed or not.

        Hazard: run this in a task its caller cannot cancel (``asyncio.shield``): the
        slot must stay taken until the kernel and the copy thread are done with it.
        """
        try:
            checksum = None
            if op == "write":
                checksum = await _copy(copy_pool, slot, view, slot, seed)
            await submit(slot)
            if op == "read":
                checksum = await _copy(copy_pool, view, slot, slot, seed)
        finally:
            self.give(slot)
        self.staged_nbytes[op] += len(view)
        return checksum

    def _open(self) -> None:
        nbytes = self.num_slots * self.slot_nbytes
        # Hazard: mmap's default is MAP_SHARED, i.e. shmem again (no THP by default).
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE_NBYTES,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        skip = -buffer_address(self._map) % HUGE_PAGE_NBYTES  # slots start on a 2 MiB page
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # kernels without THP: still private pages, in longer runs
                pass
        self._view = memoryview(self._map)[skip:skip + nbytes]
        self._free = list(reversed(range(self.num_slots)))

    def close(self) -> None:
        """Unmap the slots; every slot must have been given back."""
        assert not self._in_use, f"{len(self._in_use)} bounce slots still in use"
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            self._map.close()
            self._map = None


async def _copy(copy_pool: Executor | None, dst: memoryview, src: memoryview,
                hashed: memoryview, seed: int | None) -> int | None:
    """Copy (and checksum, given a seed) on ``copy_pool``: a chunk takes ~1 ms at DRAM speed,
    a stall the event loop must not take."""
    loop = asyncio.get_running_loop()
    if seed is None:
        return await loop.run_in_executor(copy_pool, copy_bytes, dst, src)
    return await loop.run_in_executor(copy_pool, copy_and_checksum, dst, src, hashed, seed)


def _give_back(pool: BouncePool, slot: memoryview, _done: object) -> None:
    pool.give(slot)


def _touch(slot: memoryview) -> None:
    ctypes.memset(buffer_address(slot), 0, len(slot))


PIECE_NBYTES = 4 << 20
"""Bytes copied then hashed at a time (a default chunk: one memmove, one hash): each call
gives up the GIL and must take it back from the event loop, so pieces of 512 KiB (16
handoffs a chunk) cost 5-15% of the daemon's swap throughput where the CPU bounds it
(bench/README.md, twenty-first session); the hash still reads the piece from the caches."""


def copy_and_checksum(dst: memoryview, src: memoryview, hashed: memoryview, seed: int) -> int:
    """memcpy ``src`` into ``dst`` and return the seeded xxh3 of ``hashed`` (``dst`` or
    ``src``: the bounce slot, which no rank can touch), piece by piece so each piece is
    hashed while still in cache. Neither call holds the GIL (for worker threads)."""
    nbytes = len(src)
    if len(dst) != nbytes or len(hashed) != nbytes:
        raise ValueError(f"copy of {nbytes} bytes into a {len(dst)}-byte buffer")
    digest = xxhash.xxh3_64(seed=seed)
    if nbytes:
        dst_address, src_address = buffer_address(dst), buffer_address(src)
        for start in range(0, nbytes, PIECE_NBYTES):
            piece = min(PIECE_NBYTES, nbytes - start)
            ctypes.memmove(dst_address + start, src_address + start, piece)
            digest.update(hashed[start:start + piece])
    return digest.intdigest()


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy ``src`` into ``dst`` (same length) without holding the GIL (for worker threads)."""
    nbytes = len(src)
    if len(dst) != nbytes:
        raise ValueError(f"copy of {nbytes} bytes into a {len(dst)}-byte buffer")
    if nbytes:
        ctypes.memmove(buffer_address(dst), buffer_address(src), nbytes)
