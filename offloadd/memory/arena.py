"""Job arenas: one shared-memory region per job and the allocator inside it.

The region is a memfd, mlock'ed where RLIMIT_MEMLOCK allows. Ranks map the same
fd (passed with SCM_RIGHTS), so an arena offset names the same bytes in every
process of the job.

Backing its pages (fallocate, mlock) costs 0.5-0.9 s per GiB, so it never stands
between a job's hello and its reply: the daemon makes the memfd at its full size
at once and backs it chunk by chunk on a thread of its own (``prefault``), in
address order, which is the order the allocator hands out ranges. A page that
is used before the thread reaches it is backed by that first touch. That is
safe on both page kinds: a memfd has no size limit to run into (the SIGBUS of a
lazily backed /dev/shm comes from its tmpfs size), and a hugetlb memfd's pages
are reserved for its whole size by the daemon's shared mapping, so a later
fault cannot find the pool empty.

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
import enum
import errno
import fcntl
import logging
import mmap
import os
import resource
import threading
import time
from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedList

from offloadd.config import HugePages, Prefault
from offloadd.errors import OverBudgetError

log = logging.getLogger(__name__)

PAGE_NBYTES = 4096
HUGE_PAGE_NBYTES = 2 << 20
BACKING_CHUNK_NBYTES = 64 << 20
"""Bytes backed per step of the backing thread: the unit between stop checks."""
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

    def free_at(self, offset: int) -> int:
        """Bytes of the free range that starts at ``offset`` (0: none does)."""
        return self._free_nbytes.get(offset, 0)

    def free_ending_at(self, end: int) -> int:
        """Bytes of the free range that ends at ``end`` (0: none does)."""
        index = self._free_offsets.bisect_left(end) - 1
        if index < 0:
            return 0
        start = self._free_offsets[index]
        size = self._free_nbytes[start]
        return size if start + size == end else 0

    def free_extents(self) -> list[Extent]:
        return [Extent(offset, self._free_nbytes[offset]) for offset in self._free_offsets]


def _mlock_allowed(nbytes: int) -> bool:
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
    return True


def _mlock(address: int, nbytes: int) -> bool:
    global _mlock_warned
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
                ) -> tuple[int, int, mmap.mmap | None]:
    """A sealed hugetlb memfd of ``nbytes`` rounded up to 2 MiB and its shared mapping,
    whose pages the kernel reserves from the pool at mmap (ENOMEM when the pool is
    short): (fd, size, map), or (-1, 0, None) where "auto" finds no room for it."""
    if mode == "off":
        return -1, 0, None
    size = align_up(nbytes, HUGE_PAGE_NBYTES)
    if max_nbytes is not None and size > max_nbytes:
        if mode == "on":
            raise OverBudgetError(
                f"arena of {nbytes} bytes for job {name!r} rounds up to {size} bytes of 2 MiB "
                f"pages, more than the {max_nbytes} bytes of budget left; ask for a multiple "
                "of 2 MiB or raise arena_size")
        return -1, 0, None
    fd = -1
    try:
        fd = os.memfd_create(f"offloadd:{name}",
                             os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        seal(fd)
        return fd, size, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
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
        return -1, 0, None


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


class Backing(enum.Enum):
    """How much of an arena is backed by memory (see the module docstring)."""

    LAZY = "lazy"  # nothing is prefaulted: each page is backed by its first touch
    BACKING = "backing"  # the backing thread is at ``backed_nbytes``; pages past it back on touch
    BACKED = "backed"  # every page is backed (and locked where allowed)
    FAILED = "failed"  # backing stopped at ``backed_nbytes`` (``backing_error`` says why)
    STOPPED = "stopped"  # the arena was closed before the backing thread finished


class Arena:
    """A job's shared-memory region: memfd + mapping + allocator.

    ``hugepages``: "auto" uses 2 MiB hugetlb pages when the reserved pool holds the
    whole arena (and its rounding up to 2 MiB stays within ``max_nbytes``), "on"
    insists (OverBudgetError naming the sysctl otherwise), "off" never does.

    ``prefault``: "now" backs (and locks) every page before the constructor returns;
    "background" returns at once and backs the pages on a thread, at most
    ``prefault_rate`` bytes per second (0: as fast as it can); "lazy" leaves each
    page to its first touch. ``backing`` and ``backed_nbytes`` tell how far it got.
    """

    def __init__(self, name: str, nbytes: int, *, lock: bool = True,
                 hugepages: HugePages = "off", max_nbytes: int | None = None,
                 prefault: Prefault = "now", prefault_rate: int = 0) -> None:
        self.fd, self.nbytes, huge_map = _huge_memfd(name, nbytes, hugepages, max_nbytes)
        self.hugepages = huge_map is not None
        if huge_map is not None:
            self.map = huge_map
        else:
            self.nbytes = align_up(nbytes)
            self.fd = os.memfd_create(f"offloadd:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(self.fd, self.nbytes)
                seal(self.fd)
                self.map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
            except BaseException:
                os.close(self.fd)
                raise
        self.name = name
        self.view = memoryview(self.map)
        self.address = buffer_address(self.map)
        self.locked = lock and _mlock_allowed(self.nbytes)
        self.allocator = Allocator(self.nbytes)
        self.backed_nbytes = 0
        self.backing_error = ""
        self.backing = Backing.LAZY if prefault == "lazy" else Backing.BACKING
        self._prefault_rate = prefault_rate
        self._lock_requested = self.locked
        self._backing_lock = threading.Lock()
        self._stop = threading.Event()
        self._closing = self._closed = False
        self._backer_running = prefault == "background"
        if prefault == "now":
            self._back_all()
            if self.backing is Backing.FAILED:
                self._close_now()
                raise OverBudgetError(
                    f"cannot back the {self.nbytes}-byte arena of job {name!r}: "
                    f"{self.backing_error}; lower arena_size")
        elif prefault == "background":
            threading.Thread(target=self._back_all, daemon=True,
                             name=f"offloadd-arena-backing:{name}").start()

    # -- backing ------------------------------------------------------------------------

    def _chunk_nbytes(self) -> int:
        unit = HUGE_PAGE_NBYTES if self.hugepages else PAGE_NBYTES
        if not self._prefault_rate:
            return BACKING_CHUNK_NBYTES
        return max(unit, min(BACKING_CHUNK_NBYTES, align_up(self._prefault_rate // 4, unit)))

    def _back_all(self) -> None:
        """Back the pages in address order, one chunk at a time, until done or closed."""
        chunk, started = self._chunk_nbytes(), time.monotonic()
        try:
            while self.backed_nbytes < self.nbytes:
                if self._closing:
                    self.backing = Backing.STOPPED
                    return
                nbytes = min(chunk, self.nbytes - self.backed_nbytes)
                self._back_range(self.backed_nbytes, nbytes)
                self.backed_nbytes += nbytes
                self._throttle(started)
            self.backing = Backing.BACKED
        except OSError as exc:
            self.backing, self.backing_error = Backing.FAILED, f"{exc.strerror} ({exc.errno})"
            log.warning("event=arena_backing_failed job=%s backed_nbytes=%d arena_nbytes=%d "
                        "error=%r hint='pages past backed_nbytes are backed on first touch; "
                        "lower arena_size if the node is short of memory'",
                        self.name, self.backed_nbytes, self.nbytes, self.backing_error)
        finally:
            self._backing_done()

    def _back_range(self, offset: int, nbytes: int) -> None:
        # fallocate leaves pages that a rank already wrote alone: it only adds missing ones.
        os.posix_fallocate(self.fd, offset, nbytes)
        if self.locked and not _mlock(self.address + offset, nbytes):
            self.locked = False

    def _throttle(self, started: float) -> None:
        if self._prefault_rate and self.backed_nbytes < self.nbytes:
            self._stop.wait(max(0.0, started + self.backed_nbytes / self._prefault_rate
                                - time.monotonic()))

    def _backing_done(self) -> None:
        with self._backing_lock:
            self._backer_running = False
            closing = self._closing
        if closing:
            self._close_now()

    # -- use ----------------------------------------------------------------------------

    def slice(self, offset: int, nbytes: int) -> memoryview:
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap and close; a backing thread still running does it after its chunk
        (the loop never waits for one), so the fd cannot be reused under its fallocate."""
        with self._backing_lock:
            self._closing = True
            self._stop.set()
            if self._backer_running:
                return
        self._close_now()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.view.release()
        if self._lock_requested:
            _libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.nbytes))
        try:
            self.map.close()
        except BufferError:
            log.warning("event=arena_close_deferred reason=exported_views")
        os.close(self.fd)
