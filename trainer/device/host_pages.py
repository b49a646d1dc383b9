"""Faulting a host range in from several threads before it is pinned for DMA.

``cudaHostRegister`` pins a range by faulting each page into this process's page tables
on the calling thread, one fault at a time. On a 16-core H200 host it pinned 24 GiB of an
arena mapping at 1.7 GB/s when nothing had backed the pages yet and at 6 GB/s when the
daemon had (a 110 GB arena: 18-66 s). Mapped beforehand with MADV_POPULATE_WRITE from
8-16 threads over disjoint chunks (0.4-0.9 s for 24 GiB of backed pages), the same
registration ran at 20 GB/s (bench/README.md). ``populate`` is that first step.

The daemon backs its arena the same way (``offloadd.memory.pages``); this is the rank's
own copy of the madvise call, as the rank side imports nothing of the daemon's layers.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading

MADV_POPULATE_WRITE = 23
"""madvise advice (Linux 5.14): fault a range in for writing, without writing it."""
POPULATE_CHUNK_NBYTES = 64 << 20
"""Bytes one thread maps per step."""
MAX_POPULATE_THREADS = 8
"""Most threads ``populate`` starts: populating stops scaling at 4-8 threads on a 16-core
host, and several ranks of a node populate at once."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate_threads() -> int:
    """Threads ``populate`` uses by default: one per CPU this process may run on, at most
    ``MAX_POPULATE_THREADS``."""
    return max(1, min(MAX_POPULATE_THREADS, len(os.sched_getaffinity(0))))


def chunks(nbytes: int, chunk_nbytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` chunks that tile ``[0, nbytes)`` in address order."""
    return [(offset, min(chunk_nbytes, nbytes - offset))
            for offset in range(0, nbytes, chunk_nbytes)]


def populate(address: int, nbytes: int, threads: int = 0,
             chunk_nbytes: int = POPULATE_CHUNK_NBYTES) -> bool:
    """Map the writable range ``[address, address + nbytes)`` into this process (pages
    not allocated yet are allocated) from ``threads`` threads (0: ``populate_threads()``),
    each taking the next ``chunk_nbytes`` chunk until none is left.

    Best effort, as a prefault: False (the range may be partly mapped) where the kernel has
    no MADV_POPULATE_WRITE (before 5.14) or refuses a chunk (ENOMEM, a read-only page);
    whoever touches the pages next faults in the rest."""
    if nbytes <= 0:
        return True
    pending = chunks(nbytes, chunk_nbytes)
    taken = itertools.count()  # next() on a count is atomic under the GIL
    refused = threading.Event()

    def work() -> None:
        while not refused.is_set() and (index := next(taken)) < len(pending):
            offset, size = pending[index]
            if _libc.madvise(address + offset, size, MADV_POPULATE_WRITE) != 0:
                refused.set()

    workers = [threading.Thread(target=work, name=f"offloadd-populate:{index}", daemon=True)
               for index in range(min(threads or populate_threads(), len(pending)) - 1)]
    for worker in workers:
        worker.start()
    work()  # the caller is one of the threads
    for worker in workers:
        worker.join()
    return not refused.is_set()
