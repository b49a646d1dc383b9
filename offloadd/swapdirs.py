"""Ownership of swap dirs: one daemon per dir (an exclusive lock), and reclaiming a job's files.

A swap dir holds the only copy of evicted optimizer state. Two daemons on one
dir would hand out the same extents of the same job files, so each daemon
takes an exclusive ``flock`` on ``<swap_dir>/offloadd/.lock`` for its whole
life; the lock file records the holder's pid for the error a second daemon
gets. The lock dies with the process (kill -9 included), so a crashed
daemon never blocks its successor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class SwapDirBusyError(RuntimeError):
    """Another live daemon holds this swap dir."""


def lock_swap_dir(root: Path) -> int:
    """Take the exclusive lock of a swap dir's layout dir; returns the fd that holds it."""
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder_pid(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise SwapDirBusyError(
            f"swap dir {root.parent} is in use by another offloadd (pid {holder}, lock "
            f"{path}); stop that daemon or give this one another --swap-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _holder_pid(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return str(int(os.pread(fd, 32, 0).decode().strip()))
    return "unknown"


def unlock_swap_dir(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # closing the last fd drops the flock


def remove_job_dir(job_dir: Path) -> int:
    """Delete one job's folder in one swap dir; returns the bytes its files took on disk."""
    if not job_dir.exists():
        return 0
    nbytes = sum(entry.stat().st_blocks * 512 for entry in job_dir.iterdir() if entry.is_file())
    shutil.rmtree(job_dir, ignore_errors=True)
    return nbytes
