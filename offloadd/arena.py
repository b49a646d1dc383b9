"""Job arenas: one shared-memory region per job and the allocator inside it.

The region is a memfd, fully backed before first use (fallocate + populate)
so that no rank ever takes a SIGBUS on a lazily backed page, and mlock'ed
where RLIMIT_MEMLOCK allows. Ranks map the same fd (passed with SCM_RIGHTS),
so an arena offset names the same bytes in every process of the job.

The memfd is sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW,
then F_SEAL_SEAL so no one can lift that) before its fd is passed to any rank: a
client that ftruncates its fd gets EPERM instead of making every process that
maps the arena, the daemon first, take a SIGBUS. Kernels before 4.16 cannot seal
hugetlb memfds; there "auto" falls back to sealed 4 KiB pages and "on" refuses:
every arena the daemon hands out is sealed.

Where the operator reserved huge pages (``vm.nr_hugepages``) the memfd is a
hugetlb one: O_DIRECT swap IO into 2 MiB pages needs a fraction of the block
segments that scattered 4 KiB shmem pages need (measured on a virtio disk: reads
2.3x, writes 1.6x faster; see bench/README.md), and page tables shrink 512x.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import resource
from dataclasses import dataclass
from typing import Literal

import numpy as np
from sortedcontainers import SortedList

from offloadd.errors import OverBudgetError

log = logging.getLogger(__name__)

PAGE_NBYTES = 4096
HUGE_PAGE_NBYTES = 2 << 20
HugePages = Literal["auto", "on", "off"]
_libc = ctypes.CDLL(None, use_errno=True)
_mlock_warned = False
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""Size seals on every arena fd: a rank can neither truncate nor extend it, nor unseal it."""


def align_up(nbytes: int, alignment: int = PAGE_NBYTES) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Extent:
    offset: int
    nbytes: int


class Allocator:
    """Best-fit allocator over ``[0, capacity)`` in 4 KiB units with coalescing frees.

    Free ranges are indexed twice: by offset (for coalescing and ``reserve``) and by
    ``(size, offset)`` (best fit is the first key >= ``(need, 0)``), both sorted lists
    with O(log n) updates, so neither a fit nor a failing allocation in a fragmented
    arena scans its extents.
    """

    def __init__(self, capacity: int) -> None:
        if capacity % PAGE_NBYTES:
            raise ValueError(f"capacity must be a multiple of {PAGE_NBYTES}, got {capacity}")
        self.capacity = capacity
        self.used_nbytes = 0
        self._free_offsets = SortedList([0] if capacity else [])
        self._free_nbytes: dict[int, int] = {0: capacity} if capacity else {}
        self._by_size = SortedList([(capacity, 0)] if capacity else [])

    def alloc(self, nbytes: int) -> int | None:
        """Return the offset of a free aligned range of ``nbytes`` or None if none fits."""
        need = align_up(max(nbytes, 1))
        by_size = self._by_size
        index = by_size.bisect_left((need, -1))
        if index == len(by_size):
            return None
        size, offset = by_size[index]
        self._take(offset, size, need)
        return offset

    def _add_free(self, offset: int, size: int) -> None:
        self._free_offsets.add(offset)
        self._free_nbytes[offset] = size
        self._by_size.add((size, offset))

    def _remove_free(self, offset: int) -> int:
        size = self._free_nbytes.pop(offset)
        self._free_offsets.remove(offset)
        self._by_size.remove((size, offset))
        return size

    def _take(self, offset: int, size: int, need: int) -> None:
        self._remove_free(offset)
        if size > need:
            self._add_free(offset + need, size - need)
        self.used_nbytes += need

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark a known range as used (recovery re-registers what a manifest names)."""
        need = align_up(max(nbytes, 1))
        index = self._free_offsets.bisect_right(offset) - 1
        if index < 0:
            raise ValueError(f"range at {offset} is not free")
        start = self._free_offsets[index]
        size = self._free_nbytes[start]
        if offset + need > start + size:
            raise ValueError(f"range [{offset}, {offset + need}) is not free")
        self._take(start, size, offset + need - start)
        if offset > start:
            self.free(start, offset - start)

    def grow(self, new_capacity: int) -> None:
        """Extend the managed range (swap files grow in segments)."""
        if new_capacity % PAGE_NBYTES or new_capacity < self.capacity:
            raise ValueError(f"cannot grow from {self.capacity} to {new_capacity}")
        added = new_capacity - self.capacity
        old = self.capacity
        self.capacity = new_capacity
        if added:
            self.used_nbytes += added
            self.free(old, added)

    def free(self, offset: int, nbytes: int) -> None:
        """Return a range to the free list, merging it with free neighbours."""
        size = align_up(max(nbytes, 1))
        assert offset not in self._free_nbytes, f"double free at offset {offset}"
        self.used_nbytes -= size
        if offset + size in self._free_nbytes:
            size += self._remove_free(offset + size)
        index = self._free_offsets.bisect_left(offset)
        if index > 0:
            before = self._free_offsets[index - 1]
            if before + self._free_nbytes[before] == offset:
                size += self._remove_free(before)
                offset = before
        self._add_free(offset, size)

    @property
    def free_nbytes(self) -> int:
        return self.capacity - self.used_nbytes

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def free_extents(self) -> list[Extent]:
        return [Extent(offset, self._free_nbytes[offset]) for offset in self._free_offsets]


def _mlock(address: int, nbytes: int) -> bool:
    global _mlock_warned
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < nbytes and os.geteuid() != 0:
        if not _mlock_warned:
            log.warning(
                "event=mlock_skipped reason=rlimit limit_nbytes=%d need_nbytes=%d "
                "hint='raise LimitMEMLOCK / ulimit -l'", soft, nbytes,
            )
            _mlock_warned = True
        return False
    if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) != 0:
        if not _mlock_warned:
            err = ctypes.get_errno()
            log.warning("event=mlock_failed errno=%d error=%r", err, os.strerror(err))
            _mlock_warned = True
        return False
    return True


def free_huge_pages() -> int:
    """Free 2 MiB pages in the kernel's reserved hugetlb pool (0 where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("HugePages_Free:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _huge_memfd(name: str, nbytes: int, mode: HugePages, max_nbytes: int | None
                ) -> tuple[int, int, bool]:
    """A fully backed hugetlb memfd of ``nbytes`` rounded up to 2 MiB: (fd, size, True),
    or (-1, 0, False) where "auto" finds no room for it."""
    if mode == "off":
        return -1, 0, False
    size = align_up(nbytes, HUGE_PAGE_NBYTES)
    if max_nbytes is not None and size > max_nbytes:
        if mode == "on":
            raise OverBudgetError(
                f"arena of {nbytes} bytes for job {name!r} rounds up to {size} bytes of 2 MiB "
                f"pages, more than the {max_nbytes} bytes of budget left; ask for a multiple "
                "of 2 MiB or raise arena_size")
        return -1, 0, False
    fd = -1
    try:
        fd = os.memfd_create(f"offloadd:{name}",
                             os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # takes the pages from the pool now, or ENOSPC
        seal(fd)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if mode == "on":
            if exc.errno == errno.EINVAL:
                raise OverBudgetError(
                    f"this kernel cannot make a sealed hugetlb arena for job {name!r} "
                    f"({exc.strerror}; sealing hugetlb memfds needs Linux >= 4.16); "
                    "set arena_hugepages = \"auto\" or \"off\"") from None
            raise OverBudgetError(
                f"arena of {size} bytes for job {name!r} needs {size // HUGE_PAGE_NBYTES} free "
                f"2 MiB huge pages ({exc.strerror}); reserve them (sysctl vm.nr_hugepages) or "
                "set arena_hugepages = \"auto\"") from None
        log.debug("event=hugepages_unavailable job=%s nbytes=%d error=%r", name, size, exc)
        return -1, 0, False
    return fd, size, True


def seal(fd: int) -> None:
    """Fix the size of a fully backed memfd for good (see the module docstring)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)


def seals(fd: int) -> int:
    """The seals set on ``fd`` (F_GET_SEALS)."""
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


def buffer_address(buffer: mmap.mmap | memoryview) -> int:
    """Address of a buffer's first byte (for IO engines and CUDA registration); 0 if empty.

    numpy reads the address of read-only buffers too (ctypes.from_buffer cannot).
    """
    view = memoryview(buffer)
    try:
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
    finally:
        view.release()


class Arena:
    """A job's shared-memory region: memfd + mapping + allocator.

    ``hugepages``: "auto" uses 2 MiB hugetlb pages when the reserved pool holds the
    whole arena (and its rounding up to 2 MiB stays within ``max_nbytes``), "on"
    insists (OverBudgetError naming the sysctl otherwise), "off" never does.
    """

    def __init__(self, name: str, nbytes: int, *, lock: bool = True,
                 hugepages: HugePages = "off", max_nbytes: int | None = None) -> None:
        self.fd, self.nbytes, self.hugepages = _huge_memfd(name, nbytes, hugepages, max_nbytes)
        if self.fd < 0:
            self.nbytes = align_up(nbytes)
            self.fd = os.memfd_create(f"offloadd:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            if not self.hugepages:
                os.ftruncate(self.fd, self.nbytes)
                # Backing every page now turns a later out-of-memory into a clear error
                # here instead of a SIGBUS inside some rank's tensor write.
                os.posix_fallocate(self.fd, 0, self.nbytes)
                seal(self.fd)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(self.fd, self.nbytes, flags=flags)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)
        self.address = buffer_address(self.map)
        self.locked = lock and _mlock(self.address, self.nbytes)
        self.allocator = Allocator(self.nbytes)

    def slice(self, offset: int, nbytes: int) -> memoryview:
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        self.view.release()
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes))
        try:
            self.map.close()
        except BufferError:
            log.warning("event=arena_close_deferred reason=exported_views")
        os.close(self.fd)
