"""The kernel calls that back and lock an arena's pages: mlock, mlock2, MADV_POPULATE_WRITE.

Backing a page means allocating it in the memfd; locking it means the kernel may never
swap it out. ``mlock`` of a range does both for the pages it finds, but only by faulting
every page into the caller's page tables, one fault at a time: fallocate + mlock per
chunk backed 24 GiB at 1.2 GB/s on a 16-core H200 host (bench/README.md), which put a
110 GB arena's backing at 95 s. The faster way splits the work:

- ``lock_on_fault`` (mlock2 with MLOCK_ONFAULT, Linux 4.4) marks the whole mapping
  locked at once; each page is locked the moment it is faulted in, by anyone in this
  process;
- ``populate_write`` (MADV_POPULATE_WRITE, Linux 5.14) faults a range in as writes
  would (allocating and zeroing missing pages) without writing a byte, and runs on
  several threads at once over disjoint ranges: 4-5 GB/s from 4-16 threads on that host.

``posix_fallocate`` stays the way to back an unlocked arena: it allocates at ~10 GB/s
on one thread but leaves the zeroing to each page's first fault, and the kernel runs
one file's fallocates one at a time (fallocate then populate per chunk was no faster
than populate alone).

Every call here releases the GIL (ctypes, ``os.posix_fallocate``), so the backing
threads run in parallel and never stall the event loop.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""madvise advice (Linux 5.14): fault a range in for writing, without writing it."""
MLOCK_ONFAULT = 1
"""mlock2 flag (Linux 4.4): lock each page of the range when it is faulted in."""
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS})
"""What a kernel too old for a call (or an advice it does not know) answers."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mlock2 = getattr(_libc, "mlock2", None)  # glibc >= 2.27
if _mlock2 is not None:
    _mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
_warned = False


def _warn_once(event: str, **fields: object) -> None:
    global _warned
    if not _warned:
        log.warning("event=%s %s", event, " ".join(f"{k}={v!r}" for k, v in fields.items()))
        _warned = True


def mlock_allowed(nbytes: int) -> bool:
    """Whether RLIMIT_MEMLOCK lets this process lock ``nbytes`` (root always may); warns
    once, naming the limit to raise, when it does not."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < nbytes and os.geteuid() != 0:
        _warn_once("mlock_skipped", reason="rlimit", limit_nbytes=soft, need_nbytes=nbytes,
                   hint="raise LimitMEMLOCK / ulimit -l")
        return False
    return True


def mlock(address: int, nbytes: int) -> bool:
    """Fault in and lock ``nbytes`` at ``address``; False (warned once) if refused."""
    if _libc.mlock(address, nbytes) != 0:
        err = ctypes.get_errno()
        _warn_once("mlock_failed", errno=err, error=os.strerror(err))
        return False
    return True


def munlock(address: int, nbytes: int) -> None:
    _libc.munlock(address, nbytes)


def lock_on_fault(address: int, nbytes: int) -> bool | None:
    """Lock the range's pages as they are faulted in from now on (mlock2 MLOCK_ONFAULT);
    pages already mapped are locked at once. True: done; None: this kernel or libc has no
    mlock2 (lock each range with ``mlock`` instead); False: refused (warned once)."""
    if _mlock2 is None:
        return None
    if _mlock2(address, nbytes, MLOCK_ONFAULT) == 0:
        return True
    err = ctypes.get_errno()
    if err in UNSUPPORTED_ERRNOS:
        return None
    _warn_once("mlock_failed", errno=err, error=os.strerror(err))
    return False


def populate_write(address: int, nbytes: int) -> bool:
    """Map ``nbytes`` at ``address`` as write faults would (MADV_POPULATE_WRITE), allocating
    pages that are missing; False where the kernel has no such advice (before 5.14).
    Raises OSError when a page cannot be had (ENOMEM: the node is out of memory)."""
    if _libc.madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in UNSUPPORTED_ERRNOS:
        return False
    raise OSError(err, os.strerror(err))
