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

Scratch dirs (``DaemonConfig.scratch_dirs``: a private daemon's socket and swap dirs) are
deleted, whole, when the daemon exits, so a daemon deletes only a dir made to be deleted:
one it creates itself, or one offloadd's launcher made for it (``make_scratch_dir``), each
marked by a ``.offloadd-scratch`` file. At start the daemon claims each (an exclusive lock
on the marker, its pid and a random token written in it); at exit it deletes a dir only
if the dir at that path is still the one it claimed and its marker still holds its token.
A typo that names / or someone's data finds no marker there, and the daemon refuses to
start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import tempfile
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


class ScratchDirRefusedError(RuntimeError):
    """A scratch dir the daemon may not take: not made to be deleted, another uid's, or
    held by another live daemon."""


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


SCRATCH_MARKER = ".offloadd-scratch"
"""The file that makes a dir a scratch dir a daemon may delete, whole, at its exit."""
SCRATCH_MAGIC = "offloadd scratch dir: the daemon that claims it deletes it, whole, at exit\n"
"""The marker's first line; a claim adds the claiming daemon's pid and token."""


@dataclass(eq=False)
class ScratchClaim:
    """A scratch dir this daemon holds: which dir it was, its token, the marker's lock."""

    path: Path
    device: int
    inode: int
    token: str
    lock_fd: int
    """The marker, flock'ed for the daemon's life: a second daemon cannot claim the dir."""
    made_parents: tuple[Path, ...] = ()
    """Dirs above it that its launcher created for it (a missing ``nvme_path``), deepest
    first: removed after it when they are empty."""


MADE_PARENT_KEY = "made_parent="
"""A marker line naming a dir above the scratch dir that its launcher created for it."""


_PARENT_ATTEMPTS = 8
"""Times ``make_scratch_dir`` makes its parent again after another daemon removed it."""


def make_dirs(path: str | os.PathLike[str]) -> list[str]:
    """``mkdir -p path``; returns the dirs it created, deepest first (for
    ``make_scratch_dir(made_parents=...)``)."""
    missing, current = [], Path(path).absolute()
    while not current.exists() and current != current.parent:
        missing.append(str(current))
        current = current.parent
    Path(path).mkdir(parents=True, exist_ok=True)
    return missing


def make_scratch_dir(parent: str | os.PathLike[str] | None = None,
                     prefix: str = "offloadd-", made_parents: list[str] | None = None) -> str:
    """A new private dir (``tempfile.mkdtemp``, mode 0700) marked as scratch, for a launcher
    that must put something in it (the daemon's log) before the daemon it hands the dir to
    (``--scratch-dir``) claims it.

    ``made_parents``: dirs above it the launcher created for it (``make_dirs``); the
    daemon removes those that are empty once it deleted the scratch dir, so a mistyped
    path leaves no tree of empty dirs behind. Only dirs above the scratch dir are taken.

    Hazard: another daemon of the node that made the same parent (two jobs, or one
    engine after another, with one ``nvme_path``) removes it at its exit when it finds it
    empty, which it is between the caller's ``make_dirs`` and the scratch dir made here.
    The parent is then made again, as this dir's own; once the scratch dir is in it, no
    other daemon's ``rmdir`` can take it.
    """
    made = list(made_parents or ())
    for attempt in range(_PARENT_ATTEMPTS):
        try:
            path = tempfile.mkdtemp(prefix=prefix, dir=parent)
            break
        except FileNotFoundError:
            if parent is None or attempt == _PARENT_ATTEMPTS - 1:
                raise
            made = sorted(set(made) | set(make_dirs(parent)),
                          key=lambda dir_path: Path(dir_path).absolute().parts, reverse=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS
    parents = "".join(f"{MADE_PARENT_KEY}{dir_path}\n" for dir_path in made)
    with open(os.path.join(path, SCRATCH_MARKER), "x", opener=lambda name, _: os.open(
            name, flags, 0o600)) as marker:
        marker.write(f"{SCRATCH_MAGIC}made_by_pid={os.getpid()}\n{parents}")
    return path


def claim_scratch_dir(path: Path) -> ScratchClaim:
    """Create ``path`` (its parent must exist) and mark it, or take the marked scratch dir
    there; lock its marker and write this daemon's pid and token into it.

    Refused (ScratchDirRefusedError naming the dir): a dir without the marker (it was not
    made to be deleted), a link, a dir of another uid or writable by others, and a dir a live
    daemon holds. A dead daemon's claim (its lock died with it) passes to this one.
    """
    fd, created = _open_or_make_scratch(path)
    try:
        _check_scratch_owner(fd, path)
        flags = os.O_RDWR | FILE_FLAGS | (os.O_CREAT | os.O_EXCL if created else 0)
        try:
            lock_fd = os.open(SCRATCH_MARKER, flags, 0o600, dir_fd=fd)
        except FileNotFoundError:
            raise ScratchDirRefusedError(
                f"scratch dir {path} exists and was not made by offloadd (no {SCRATCH_MARKER} "
                "in it): the daemon deletes its scratch dirs whole at exit, so it takes only "
                "dirs it creates; name a path that does not exist yet in scratch_dirs "
                "(--scratch-dir), or drop it") from None
        info = os.fstat(fd)
    finally:
        os.close(fd)
    try:
        return _lock_scratch(lock_fd, path, info, created)
    except BaseException:
        os.close(lock_fd)
        raise


def _open_or_make_scratch(path: Path) -> tuple[int, bool]:
    parent_fd = os.open(path.parent, DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        created = False
        with contextlib.suppress(FileExistsError):
            os.mkdir(path.name, 0o700, dir_fd=parent_fd)
            created = True
        try:
            return os.open(path.name, DIR_FLAGS, dir_fd=parent_fd), created
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise ScratchDirRefusedError(
                f"scratch dir {path} is a symbolic link or not a dir; the daemon deletes only "
                "a dir it made, named by its real path") from None
    finally:
        os.close(parent_fd)


def _check_scratch_owner(fd: int, path: Path) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise ScratchDirRefusedError(
            f"scratch dir {path} is owned by uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}: a scratch dir must be the daemon's "
            f"(uid {os.geteuid()}) and writable only by it; name a path that does not exist yet")


def _lock_scratch(lock_fd: int, path: Path, info: os.stat_result, created: bool) -> ScratchClaim:
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ScratchDirRefusedError(
            f"scratch dir {path} is held by another live offloadd ({_claimant(lock_fd)}); give "
            "each daemon scratch dirs of its own") from None
    marker = "" if created else os.pread(lock_fd, 4096, 0).decode(errors="replace")
    if not created and not marker.startswith(SCRATCH_MAGIC):
        raise ScratchDirRefusedError(
            f"scratch dir {path}: {SCRATCH_MARKER} in it is not offloadd's marker; the daemon "
            "deletes only dirs it made: name a path that does not exist yet")
    made_parents = _made_parents(marker, path)
    token = secrets.token_hex(16)
    parents = "".join(f"{MADE_PARENT_KEY}{made}\n" for made in made_parents)
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{SCRATCH_MAGIC}claimed_by_pid={os.getpid()}\ntoken={token}\n"
              f"{parents}".encode(), 0)
    log.info("event=scratch_dir_claimed dir=%s created=%s", path, created)
    return ScratchClaim(path, info.st_dev, info.st_ino, token, lock_fd, made_parents)


def _made_parents(marker: str, path: Path) -> tuple[Path, ...]:
    """The marker's ``made_parent`` dirs that lie above ``path``, deepest first (a line
    naming any other dir is ignored: the daemon removes nothing outside the scratch
    dir's own chain)."""
    above = set(path.absolute().parents)
    named = [Path(line.removeprefix(MADE_PARENT_KEY)) for line in marker.splitlines()
             if line.startswith(MADE_PARENT_KEY)]
    return tuple(sorted({made for made in named if made in above},
                        key=lambda made: len(made.parts), reverse=True))


def _claimant(lock_fd: int) -> str:
    text = os.pread(lock_fd, 4096, 0).decode(errors="replace")
    pids = [line for line in text.splitlines() if line.startswith("claimed_by_pid=")]
    return pids[0] if pids else "pid unknown"


def release_scratch_dir(claim: ScratchClaim) -> None:
    """Delete a claimed scratch dir, whole, if the dir at its path is still the one claimed
    and its marker still holds this daemon's token; else leave it (and say so in the log).

    Never leaves the dir's filesystem (a mount inside is left, and the dir with it) and
    follows no links. Errors are logged: the daemon is exiting, and must finish."""
    try:
        fd = os.open(claim.path, DIR_FLAGS)
    except OSError as exc:
        log.warning("event=scratch_dir_kept dir=%s reason=%r", claim.path, exc.strerror)
        os.close(claim.lock_fd)
        return
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != (claim.device, claim.inode) or \
                f"token={claim.token}\n" not in _marker_text(fd):
            log.warning("event=scratch_dir_kept dir=%s reason=not_the_dir_it_claimed",
                        claim.path)
            return
        emptied = _empty_dir(fd, info.st_dev, claim.path)
    except (OSError, RecursionError) as exc:
        log.warning("event=scratch_dir_kept dir=%s reason=%r", claim.path, str(exc))
        return
    finally:
        os.close(fd)
        os.close(claim.lock_fd)
    if emptied:
        with contextlib.suppress(OSError):  # rmdir takes only an empty dir, whatever is there
            os.rmdir(claim.path)
    for made in claim.made_parents:  # deepest first; one another job still uses stays
        try:
            os.rmdir(made)
        except OSError:
            break
        log.info("event=made_parent_removed dir=%s", made)


def _marker_text(dir_fd: int) -> str:
    try:
        fd = os.open(SCRATCH_MARKER, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return ""
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace")
    finally:
        os.close(fd)


def _empty_dir(fd: int, device: int, path: Path) -> bool:
    """Delete what is in the dir open at ``fd`` without leaving ``device``; True if emptied."""
    emptied = True
    for entry in os.scandir(fd):
        if not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.name, dir_fd=fd)
            continue
        if entry.stat(follow_symlinks=False).st_dev != device:
            log.warning("event=scratch_mount_kept dir=%s", path / entry.name)
            emptied = False
            continue
        child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
        try:
            child_emptied = _empty_dir(child, device, path / entry.name)
        finally:
            os.close(child)
        if child_emptied:
            os.rmdir(entry.name, dir_fd=fd)
        emptied = emptied and child_emptied
    return emptied
