"""Job arenas: one shared-memory region per job and the allocator inside it.

The region is a memfd, mlock'ed where RLIMIT_MEMLOCK allows. Ranks map the same
fd (passed with SCM_RIGHTS), so an arena offset names the same bytes in every
process of the job.

Backing its pages takes seconds per 10 GB even done well, so it never stands
between a job's hello and its reply: the daemon makes the memfd at its full size
at once and backs it on threads of its own (``prefault``), 64 MiB chunks claimed
in address order, which is the order the allocator hands out ranges. Where the
arena is locked, each chunk is faulted in with MADV_POPULATE_WRITE under an
mlock2(MLOCK_ONFAULT) of the whole mapping, which locks each page as it arrives
(``offloadd.memory.pages``): the threads' populates run in parallel (4-5 GB/s
on a 16-core H200 host), where one fallocate + mlock per chunk ran one page
fault at a time (1.2 GB/s: 95 s for a 110 GB arena). Unlocked, one thread
fallocates. A page that is used before the threads reach it
is backed by that first touch. That is
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
import threading
import time
from dataclasses import dataclass

from sortedcontainers import SortedList

from offloadd.config import HugePages, Prefault
from offloadd.errors import OverBudgetError
from offloadd.memory import pages
from offloadd.memory.node import node_memory, pin_shortage, shortage

log = logging.getLogger(__name__)

PAGE_NBYTES = 4096
HUGE_PAGE_NBYTES = 2 << 20
BACKING_CHUNK_NBYTES = 64 << 20
"""Bytes one backing thread backs per step: the unit of work, and between stop checks."""
PLACEMENT_CHECK_NBYTES = 32 << 20
"""Unbacked bytes the allocator hands out (a lazy arena, or ranges past the backing's
frontier) between two reads of the node's memory (``Arena.placement_fits``): a read
costs ~0.3 ms, first touches of 32 MiB ~10 ms. Less on a node whose reserve is smaller
(``Arena.check_stride``)."""
RESTORE_CHECK_S = 5.0
"""Least seconds between two reads of the node's memory for ``Arena.restore_withheld``
(and from a withholding to the first): a job that finds no room asks at every placement."""
MAX_AUTO_PREFAULT_THREADS = 8
"""Most backing threads ``prefault_threads=0`` picks: on a 16-core H200 host populating a
memfd stops scaling at 4-8 threads (bench/README.md)."""
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
        self.withheld_nbytes = 0
        """Bytes taken out (``withhold``) until ``restore_withheld``: neither used nor free."""
        self._withheld: dict[int, int] = {}
        """The withheld ranges: offset -> bytes."""
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

    def withhold(self, offset: int, nbytes: int) -> None:
        """Take a free range out: no ``alloc`` returns it until ``restore_withheld`` (an
        arena's pages that the node had no memory to back)."""
        self.reserve(offset, nbytes)
        need = align_up(max(nbytes, 1))
        self.used_nbytes -= need
        self.withheld_nbytes += need
        self._withheld[offset] = need

    def restore_withheld(self) -> int:
        """Return every withheld range to the free list; the bytes returned."""
        restored = self.withheld_nbytes
        for offset, nbytes in sorted(self._withheld.items()):
            self.used_nbytes += nbytes
            self.withheld_nbytes -= nbytes
            self.free(offset, nbytes)
        self._withheld.clear()
        return restored

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
        return self.capacity - self.used_nbytes - self.withheld_nbytes

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


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (part of the stable ABI since 3.11, unchanged since 3.3)."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int),
                ("ndim", ctypes.c_int), ("format", ctypes.c_char_p),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_SIMPLE = 0
"""A contiguous buffer, read-only accepted (ctypes' ``from_buffer`` insists on writable)."""


def buffer_address(buffer: mmap.mmap | memoryview | bytes | bytearray) -> int:
    """Address of a contiguous buffer's first byte (for IO engines, the native kernels and
    CUDA registration), read-only buffers included; 0 if empty. Asked of the buffer
    protocol itself: the daemon imports no numpy (its import alone started a BLAS thread
    pool in every daemon)."""
    info = _PyBuffer()
    _get_buffer(buffer, ctypes.byref(info), _PYBUF_SIMPLE)  # BufferError if not contiguous
    try:
        return int(info.buf or 0) if info.len else 0
    finally:
        _release_buffer(ctypes.byref(info))


def default_prefault_threads() -> int:
    """Backing threads for ``prefault_threads=0``: one per CPU this process may run on,
    at most ``MAX_AUTO_PREFAULT_THREADS``."""
    return max(1, min(MAX_AUTO_PREFAULT_THREADS, len(os.sched_getaffinity(0))))


class Backing(enum.Enum):
    """How much of an arena is backed by memory (see the module docstring)."""

    LAZY = "lazy"  # nothing is prefaulted: each page is backed by its first touch
    BACKING = "backing"  # the backing threads are past ``backed_nbytes``; later pages back on touch
    BACKED = "backed"  # every page is backed (and locked where allowed)
    FAILED = "failed"  # backing stopped past ``backed_nbytes`` (``backing_error`` says why)
    STOPPED = "stopped"  # the arena was closed before the backing threads finished


class Arena:
    """A job's shared-memory region: memfd + mapping + allocator.

    ``hugepages``: "auto" uses 2 MiB hugetlb pages when the reserved pool holds the
    whole arena (and its rounding up to 2 MiB stays within ``max_nbytes``), "on"
    insists (OverBudgetError naming the sysctl otherwise), "off" never does.

    ``prefault``: "now" backs (and locks) every page before the constructor returns;
    "background" returns at once and backs the pages on threads, at most
    ``prefault_rate`` bytes per second (0: as fast as they can); "lazy" leaves each
    page to its first touch. ``backing`` and ``backed_nbytes`` tell how far it got.
    ``prefault_threads`` threads (0: ``default_prefault_threads()``) back disjoint
    ``BACKING_CHUNK_NBYTES`` chunks, taken in address order, where the arena is locked
    (unlocked, one thread: a chunk is then fallocate'd, which runs one at a time per file).

    ``lock``: lock the pages in RAM where RLIMIT_MEMLOCK allows (``locked`` says
    whether): the whole mapping is locked on fault up front (``pages.lock_on_fault``),
    so every page the backing threads map, or that the daemon touches first, is locked
    as it arrives; on kernels without mlock2 each backed chunk is mlock'ed.
    """

    def __init__(self, name: str, nbytes: int, *, lock: bool = True,
                 hugepages: HugePages = "off", max_nbytes: int | None = None,
                 prefault: Prefault = "now", prefault_rate: int = 0,
                 prefault_threads: int = 0) -> None:
        if prefault_threads < 0:
            raise ValueError(f"prefault_threads must be >= 0, got {prefault_threads}")
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
        self._lock_requested = lock and pages.mlock_allowed(self.nbytes)
        on_fault = pages.lock_on_fault(self.address, self.nbytes) \
            if self._lock_requested else False
        self.locked = self._lock_requested and on_fault is not False
        self._lock_each_chunk = self.locked and on_fault is None
        """No mlock2 here: each backed chunk is mlock'ed (which also maps it)."""
        self._populate = self.locked and not self._lock_each_chunk
        """Back each chunk with MADV_POPULATE_WRITE (allocated, zeroed, mapped and so
        locked), in parallel with the other threads, while the kernel has it; else
        fallocate it (and mlock it, where locked)."""
        self.allocator = Allocator(self.nbytes)
        self._start_backing(prefault, prefault_rate, prefault_threads)

    # -- backing ------------------------------------------------------------------------

    def _start_backing(self, prefault: Prefault, rate: int, threads: int) -> None:
        self.backed_nbytes = 0
        """Every page below this offset is backed (chunks past it may be too)."""
        self.backing_error = ""
        self.backing = Backing.LAZY if prefault == "lazy" else Backing.BACKING
        self.backing_threads = 0
        """Threads that backed (or are backing) this arena's pages."""
        self._prefault_rate = rate
        self._chunk = self._chunk_nbytes()
        self._claimed_nbytes = 0
        self._backed_chunks: dict[int, int] = {}
        """Chunks backed past ``backed_nbytes``: offset -> nbytes."""
        self._backing_lock = threading.Lock()
        self._stop = threading.Event()
        self._closing = self._closed = False
        self._backers_running = 0
        self.withhold_due = False
        """Backing failed: the loop thread is to ``withhold_unbacked`` (set when it failed,
        then again by the last backing thread, once the chunks in flight are done)."""
        self.withhold_from = self.nbytes
        """Free ranges past this offset that hold no page are withheld (frees included)."""
        self._fresh_nbytes = 0
        """Unbacked bytes handed out since the node's memory was last read."""
        self._half_reserve = node_memory().kept_nbytes // 2
        """Half what arenas leave this node (read once: its size does not change)."""
        self._restore_due_s = 0.0
        """When ``restore_withheld`` may next read the node's memory."""
        self.restored_nbytes = 0
        """Withheld bytes handed back so far (``restore_withheld``)."""
        if prefault == "lazy":
            return
        chunks = -(-self.nbytes // self._chunk)
        # Unlocked, a chunk is fallocate'd, which the kernel runs one at a time per file:
        # more threads would only queue on the inode's lock.
        wanted = (threads or default_prefault_threads()) if self.locked else 1
        self.backing_threads = max(1, min(wanted, chunks))
        self._backers_running = self.backing_threads
        self._backing_started = time.monotonic()
        helpers = self.backing_threads - (1 if prefault == "now" else 0)
        started = [threading.Thread(target=self._back_chunks, daemon=True,
                                    name=f"offloadd-arena-backing:{self.name}:{index}")
                   for index in range(helpers)]
        for thread in started:
            thread.start()
        if prefault == "now":
            self._back_chunks()  # this thread is one of the backers
            for thread in started:
                thread.join()
            if self.backing is Backing.FAILED:
                self._close_now()
                raise OverBudgetError(
                    f"cannot back the {self.nbytes}-byte arena of job {self.name!r}: "
                    f"{self.backing_error}; lower arena_size")

    def _chunk_nbytes(self) -> int:
        unit = HUGE_PAGE_NBYTES if self.hugepages else PAGE_NBYTES
        if not self._prefault_rate:
            return BACKING_CHUNK_NBYTES
        return max(unit, min(BACKING_CHUNK_NBYTES, align_up(self._prefault_rate // 4, unit)))

    def _back_chunks(self) -> None:
        """One backing thread: claim the next chunk in address order and back it, until
        none is left, the arena is closing, a chunk failed, or the node's available
        memory would fall into what arenas leave it (``memory.node.shortage``): the
        pages of the rest that no rank touched are then withheld (``withhold_unbacked``)."""
        try:
            while (chunk := self._claim_chunk()) is not None:
                short = "" if self.hugepages else shortage(chunk[1])
                if short:  # pinning on would take the node into the OOM killer
                    self._backing_failed(short)
                    return
                self._back_range(*chunk)
                self._chunk_backed(*chunk)
        except OSError as exc:
            self._backing_failed(f"{exc.strerror} ({exc.errno})")
        finally:
            self._backer_done()

    def _backing_failed(self, why: str) -> None:
        with self._backing_lock:
            if self.backing is not Backing.FAILED:
                self.backing = Backing.FAILED
                self.backing_error = why
                self.withhold_due = not self._closing

    def _claim_chunk(self) -> tuple[int, int] | None:
        """(offset, nbytes) of the next chunk nobody claimed, once the rate allows it;
        None when the arena is done, closing or failed."""
        with self._backing_lock:
            offset = self._claimed_nbytes
            if self._closing or self.backing is Backing.FAILED or offset >= self.nbytes:
                return None
            nbytes = min(self._chunk, self.nbytes - offset)
            self._claimed_nbytes += nbytes
        # Chunk k starts no sooner than k chunks' worth of the rate; one claimed while the
        # arena closes is left to first touch.
        due_s = self._backing_started + offset / self._prefault_rate if self._prefault_rate \
            else 0.0
        if due_s and self._stop.wait(max(0.0, due_s - time.monotonic())):
            return None
        return offset, nbytes

    def _back_range(self, offset: int, nbytes: int) -> None:
        # Both ways leave pages that a rank already wrote alone: they only add missing ones.
        address = self.address + offset
        if self._populate:
            if pages.populate_write(address, nbytes):
                return
            self._populate, self._lock_each_chunk = False, True  # kernel < 5.14
        os.posix_fallocate(self.fd, offset, nbytes)
        if self._lock_each_chunk and not pages.mlock(address, nbytes):
            self.locked = self._lock_each_chunk = False

    def _chunk_backed(self, offset: int, nbytes: int) -> None:
        with self._backing_lock:
            self._backed_chunks[offset] = nbytes
            while self.backed_nbytes in self._backed_chunks:
                self.backed_nbytes += self._backed_chunks.pop(self.backed_nbytes)

    def _backer_done(self) -> None:
        """The last backing thread to finish settles the state (and closes a closed arena)."""
        with self._backing_lock:
            self._backers_running -= 1
            if self._backers_running:
                return
            closing = self._closing
            if self.backing is Backing.BACKING:
                self.backing = Backing.BACKED if self.backed_nbytes == self.nbytes \
                    else Backing.STOPPED
            if self.backing is Backing.FAILED and not closing:
                self.withhold_due = True  # the chunks that were in flight are done: all of it
        self._log_backing()
        if closing:
            self._close_now()

    def _log_backing(self) -> None:
        seconds = time.monotonic() - self._backing_started
        if self.backing is Backing.FAILED:
            log.warning("event=arena_backing_failed job=%s backed_nbytes=%d arena_nbytes=%d "
                        "error=%r hint='pages it could not back are withheld from the job "
                        "(arena_withheld_nbytes); lower arena_size if the node is short of "
                        "memory'",
                        self.name, self.backed_nbytes, self.nbytes, self.backing_error)
        elif self.backing is Backing.BACKED:
            log.info("event=arena_backed job=%s arena_nbytes=%d seconds=%.3f gb_per_s=%.2f "
                     "threads=%d locked=%s hugepages=%s", self.name, self.nbytes, seconds,
                     self.nbytes / max(seconds, 1e-9) / 1e9, self.backing_threads,
                     self.locked, self.hugepages)

    # -- what could not be backed ---------------------------------------------------------

    def withhold_unbacked(self) -> None:
        """Loop thread, once backing failed (``withhold_due``): take every free range that
        holds no page out of the allocator, so no shard is placed where its first write
        would take memory the node was found not to have (pinned pages past it end in the
        OOM killer). Ranges already backed, by the threads or by a rank's first touch,
        stay in use; frees from now on are checked the same way (``withhold_holes``).

        While backing threads still finish the chunks they had claimed, only what lies
        past every claimed chunk is withheld (a chunk being backed is not a hole to
        waste); the last thread calls for a second pass over the rest."""
        with self._backing_lock:
            self.withhold_due = False
            if self.hugepages:
                return  # every page is reserved from the pool: none of it is missing
            running = self._backers_running
            start = self._claimed_nbytes if running else self.backed_nbytes
        self.withhold_from = min(self.withhold_from, start)
        self._restore_due_s = time.monotonic() + RESTORE_CHECK_S
        for extent in self.allocator.free_extents():
            begin, end = max(extent.offset, start), extent.offset + extent.nbytes
            if end > begin:
                self.withhold_holes(begin, end - begin)
        if not running:
            log.warning("event=arena_unbacked_withheld job=%s withheld_nbytes=%d "
                        "arena_nbytes=%d hint='the node ran short of memory while backing "
                        "this arena; those pages are not handed out until it has room again: "
                        "evict to swap or ask for a smaller arena'", self.name,
                        self.allocator.withheld_nbytes, self.nbytes)

    def placement_fits(self, offset: int, nbytes: int) -> bool:
        """Loop thread, for a range just allocated: False when pages of it are backed by
        nobody yet (a lazy arena, or a range past the backing's frontier: they would be
        backed by their first write) and the node has no room for them. The backing
        then counts as failed (``backing_error`` says why); the caller frees the range
        and withholds what is unbacked (``withhold_unbacked``). The node's memory is
        read once per ``check_stride`` bytes of such pages, as the backing threads
        read it once per chunk."""
        if self.hugepages or self.backing is Backing.BACKED or self.withhold_from < self.nbytes:
            return True  # every page there is backed, or is being backed by a thread
        begin, end = max(offset, self.backed_nbytes), offset + nbytes
        if end <= begin:
            return True
        self._fresh_nbytes += sum(stop - start for start, stop in self._holes(begin, end))
        if self._fresh_nbytes < self.check_stride:
            return True
        short = shortage(self._fresh_nbytes)
        self._fresh_nbytes = 0
        if not short:
            return True
        self._backing_failed(short)
        return False

    def restore_withheld(self) -> int:
        """Loop thread, where a job looks for room: hand the withheld pages back once the
        node has room again (the process that took its memory ended); the bytes returned.

        From then on they are watched as a lazy arena's pages are: each is backed by its
        first write, and ``placement_fits`` reads the node's memory once per
        ``check_stride`` bytes of them, so a node short again has what is unbacked
        withheld again, not the OOM killer. The node's memory is read at most once per
        ``RESTORE_CHECK_S``, and not while backing threads still run."""
        withheld = self.allocator.withheld_nbytes
        if not withheld or self.withhold_due or time.monotonic() < self._restore_due_s:
            return 0
        with self._backing_lock:
            if self._backers_running:
                return 0
        self._restore_due_s = time.monotonic() + RESTORE_CHECK_S
        if shortage(min(withheld, self.check_stride)):
            return 0
        restored = self.allocator.restore_withheld()
        self.withhold_from = self.nbytes
        self._fresh_nbytes = 0
        self.restored_nbytes += restored
        log.info("event=arena_withheld_restored job=%s restored_nbytes=%d arena_nbytes=%d "
                 "note='the node has room again: the pages are handed out under the "
                 "placement watch'", self.name, restored, self.nbytes)
        return restored

    @property
    def check_stride(self) -> int:
        """Unbacked bytes handed out between two reads of the node's memory:
        ``PLACEMENT_CHECK_NBYTES``, or half the node's reserve where that is less (a
        512 MiB container keeps 16 MiB: one 32 MiB stride unchecked could take all of it
        and more)."""
        return max(PAGE_NBYTES, min(PLACEMENT_CHECK_NBYTES, self._half_reserve))

    def withhold_freed(self, offset: int, nbytes: int) -> None:
        """A range freed on the loop thread: withhold its part past ``withhold_from`` that
        holds no page (nothing before a backing failed)."""
        begin = max(offset, self.withhold_from)
        if offset + nbytes > begin:
            self.withhold_holes(begin, offset + nbytes - begin)

    def withhold_holes(self, offset: int, nbytes: int) -> None:
        """Withhold the pages of the free range ``[offset, offset + nbytes)`` that the memfd
        holds none of (``lseek`` SEEK_HOLE / SEEK_DATA, page by page on shmem)."""
        for start, end in self._holes(offset, offset + nbytes):
            self.allocator.withhold(start, end - start)

    def _holes(self, start: int, end: int) -> list[tuple[int, int]]:
        holes = []
        position = start
        while position < end:
            try:
                hole = os.lseek(self.fd, position, os.SEEK_HOLE)
            except OSError:  # ENXIO: past the end of the file
                break
            if hole >= end:
                break
            try:
                data = min(end, os.lseek(self.fd, hole, os.SEEK_DATA))
            except OSError:  # ENXIO: no data after the hole
                data = end
            first, last = align_up(hole), data // PAGE_NBYTES * PAGE_NBYTES
            if last > first:
                holes.append((first, last))
            position = max(data, hole + PAGE_NBYTES)
        return holes

    def allocated_nbytes(self) -> int:
        """Bytes of the arena that hold pages now, backed by the threads or by a first
        touch (the memfd's blocks; 0 once closed). A hugetlb arena counts whole: its pages
        were reserved from the pool at mmap, whether faulted in yet or not."""
        if self.hugepages:
            return self.nbytes
        try:
            return min(self.nbytes, os.fstat(self.fd).st_blocks * 512)
        except OSError:
            return 0

    def pin_shortage(self) -> str:
        """Why a process should not pin this arena now (``memory.node.pin_shortage``)."""
        return pin_shortage(self.nbytes - self.allocated_nbytes(), hugepages=self.hugepages,
                            backing_error=self.backing_error)

    # -- use ----------------------------------------------------------------------------

    def slice(self, offset: int, nbytes: int) -> memoryview:
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap and close; backing threads still running do it after their chunk (the
        loop never waits for one), so the fd cannot be reused under their fallocate."""
        with self._backing_lock:
            self._closing = True
            self._stop.set()
            if self._backers_running:
                return
        self._close_now()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.view.release()
        if self._lock_requested:
            pages.munlock(self.address, self.nbytes)
        try:
            self.map.close()
        except BufferError:
            log.warning("event=arena_close_deferred reason=exported_views")
        os.close(self.fd)
