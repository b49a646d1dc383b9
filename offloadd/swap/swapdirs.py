"""Ownership of swap dirs: only the daemon's uid writes there, one daemon per dir (an
exclusive lock), and reclaiming a job's files.

A swap dir holds the only copy of evicted optimizer state, and ``--recover`` restores
whatever its manifests say. So a swap dir, its layout dir and every job dir must be owned
by the daemon's uid and writable by no one else, and the path to them must not be
replaceable by another user (every ancestor owned by root or the daemon's uid, and not
writable by others unless sticky, as /tmp is): ``open_private_dir`` walks the path with
O_NOFOLLOW and checks each step. Everything below is then opened relative to the checked
dir fds (openat) with O_NOFOLLOW, so a symlink planted at ``.probe``, ``.lock`` or
``manifest.tmp`` fails the open instead of redirecting a root daemon's write.

Two daemons on one dir would hand out the same extents of the same job files, so each
daemon takes an exclusive ``flock`` on ``<swap_dir>/offloadd/.lock`` for its whole
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
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
"""Flags of every file the daemon opens under a swap dir (with ``dir_fd``)."""
TRUSTED_ANCESTOR_UIDS = (0,)
"""Besides the daemon's own uid: who may own a dir on the path to a swap dir."""


class SwapDirBusyError(RuntimeError):
    """Another live daemon holds this swap dir."""


class SwapDirUnsafeError(OSError):
    """A swap dir (or a dir on its path, or a job dir in it) that another uid could write."""


def open_private_dir(path: Path) -> int:
    """Open the absolute ``path`` as a checked dir fd, making missing dirs (mode 0700).

    Walks from / with O_NOFOLLOW: each dir on the way must be owned by root or the
    daemon's uid and not writable by group or others unless it is sticky; ``path``
    itself must be owned by the daemon's uid and writable only by it.
    """
    fd = os.open("/", DIR_FLAGS)
    try:
        walked = Path("/")
        for name in path.parts[1:]:
            _check_ancestor(fd, walked, path)
            child = _open_or_make_dir(fd, name, walked / name, path)
            os.close(fd)
            fd, walked = child, walked / name
        check_private(fd, path)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_private_subdir(parent_fd: int, name: str, path: Path, *, create: bool = True) -> int:
    """Open (making it, 0700, with ``create``) the dir ``name`` of a checked dir, checked."""
    fd = (_open_or_make_dir(parent_fd, name, path, path) if create
          else _open_dir(parent_fd, name, path, path))
    try:
        check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private(fd: int, path: Path) -> None:
    """Raise SwapDirUnsafeError unless the dir is the daemon uid's and writable only by it."""
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise SwapDirUnsafeError(
            errno.EPERM, f"{path} is owned by uid {info.st_uid}, not by the daemon's uid "
            f"{os.geteuid()}: another user could choose what the daemon writes and recovers "
            "there; give the daemon a swap dir of its own (chown it, or pick another --swap-dir)")
    if info.st_mode & 0o022:
        raise SwapDirUnsafeError(
            errno.EPERM, f"{path} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); run `chmod go-w {path}` or pick another "
            "--swap-dir")


def _check_ancestor(fd: int, walked: Path, path: Path) -> None:
    info = os.fstat(fd)
    if info.st_uid not in (os.geteuid(), *TRUSTED_ANCESTOR_UIDS):
        raise SwapDirUnsafeError(
            errno.EPERM, f"swap dir {path}: {walked} on its path is owned by uid {info.st_uid}, "
            "who could replace what follows; pick a --swap-dir under dirs of root or the "
            "daemon's uid")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise SwapDirUnsafeError(
            errno.EPERM, f"swap dir {path}: {walked} on its path is writable by others and not "
            "sticky, so anyone could replace what follows; pick another --swap-dir")


def _open_dir(parent_fd: int, name: str, where: Path, path: Path) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(where)):
            raise SwapDirUnsafeError(
                exc.errno, f"swap dir {path}: {where} is a symbolic link; the daemon follows "
                "no links under its swap dirs (give --swap-dir the real path)") from None
        raise


def _open_or_make_dir(parent_fd: int, name: str, where: Path, path: Path) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    return _open_dir(parent_fd, name, where, path)


def lock_swap_dir(root_fd: int, root: Path) -> int:
    """Take the exclusive lock of a swap dir's layout dir; returns the fd that holds it."""
    path = root / LOCK_FILE
    fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | FILE_FLAGS, 0o600, dir_fd=root_fd)
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


def remove_job_dir(root_fd: int, job_dir: Path) -> int:
    """Delete one job's folder in one swap dir; returns the bytes its files took on disk."""
    if not job_dir.exists():
        return 0
    nbytes = sum(entry.stat(follow_symlinks=False).st_blocks * 512
                 for entry in os.scandir(job_dir) if entry.is_file(follow_symlinks=False))
    shutil.rmtree(job_dir.name, dir_fd=root_fd, ignore_errors=True)
    return nbytes


LAYOUT_DIR = "offloadd"
"""The dir offloadd owns under each configured swap dir; job dirs live in it."""


@dataclass(eq=False)
class SwapDir:
    """One configured swap dir: its budget, counters and the checked fd of its layout dir."""


    index: int
    path: Path
    budget_nbytes: int
    direct: bool = True
    reserved_nbytes: int = 0
    read_nbytes: int = 0
    written_nbytes: int = 0
    root_fd: int = -1
    """The layout dir, opened and checked (``offloadd.swap.swapdirs``) by ``prepare``."""

    @property
    def root(self) -> Path:
        return self.path / LAYOUT_DIR

    def job_dir(self, job: str) -> Path:
        return self.root / job

    def prepare(self) -> None:
        """Open and check the swap and layout dirs, probe O_DIRECT; errors name the dir."""
        try:
            swap_fd = open_private_dir(self.path)
            try:
                self.root_fd = open_private_subdir(swap_fd, LAYOUT_DIR, self.root)
            finally:
                os.close(swap_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(".probe", dir_fd=self.root_fd)
            fd = os.open(".probe", os.O_RDWR | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o600,
                         dir_fd=self.root_fd)
        except OSError as exc:
            raise OSError(exc.errno, f"swap dir {self.path} is not usable: {exc.strerror}") from exc
        try:
            os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        try:
            os.close(os.open(".probe", os.O_RDWR | FILE_FLAGS | getattr(os, "O_DIRECT", 0),
                             dir_fd=self.root_fd))
        except OSError:
            self.direct = False
            log.warning("event=odirect_unsupported dir=%s fallback=buffered", self.path)
        os.unlink(".probe", dir_fd=self.root_fd)

    def close(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1
