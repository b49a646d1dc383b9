"""Ended jobs' flushed swap files: kept for their owner, counted, bounded, reclaimed.

A job that ends after a flush keeps its swap files, so that its owner can resume from
its last flush: a hello of the owner with the job's name claims them (``claim``), in
this daemon or, after a restart with ``--recover``, in the next one. When it ends, the
job's manifest is marked ended (``offloadd.swap.manifests.mark_ended``), so a restart
brings back only the jobs that were live and keeps the ended ones as files, and its swap
files are cut to the extents the manifest names (a file grows in 256 MiB segments; the
unwritten tail is given back to the disk).

Those files still take disk: they stay reserved in their swap dirs' budgets and count
against their owner's ``max_swap_nbytes_per_uid``, ``offloadd status`` lists them by
owner, and they are deleted without ``offloadd gc``: after ``flushed_job_retention_s``
from the job's end, or earlier, oldest first, when their owner or their swap dir (its
budget, or the file system itself) needs the room for a live job.

A job that was live when the daemon stopped but found no room in the DRAM budget at
``--recover`` is kept the same way (``ended_at`` None): its owner's hello claims it once
there is room, and the next restart tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offloadd.memory.arena import align_up
from offloadd.swap.manifests import JobOwner, manifest_owner, mark_ended, retained_file_ends
from offloadd.swap.swapdirs import FILE_FLAGS, SwapDir, open_private_subdir, remove_job_dir

log = logging.getLogger(__name__)

SWAP_FILE = "swap.0"
"""A job's swap file in each swap dir (``offloadd.swap.nvme.JobFile``)."""


@dataclass(eq=False)
class RetainedJob:
    """One job's kept swap files."""

    job: str
    owner: JobOwner | None
    """Who may claim them (the manifest's owner; None: root only)."""
    uid: int | None
    """The uid they count against (None: a job no hello served)."""
    nbytes_by_dir: dict[int, int]
    """Swap dir index -> bytes of the job's file there, still reserved in that dir."""
    ended_at: float | None
    """When the job ended; None: it was live at the restart but found no room."""
    retained_at: float
    expires_at: float
    note: str = ""
    settling: bool = False
    """Its manifest is being marked ended and its files cut (``settle`` ends it): not
    reclaimed meanwhile, and counted at its files' sizes before the cut."""
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_dir.values())

    @property
    def age_key(self) -> tuple[bool, float]:
        """Reclaim order: ended jobs before unrecovered live ones, each oldest first."""
        return (self.ended_at is None, self.ended_at or self.retained_at)

    def describe(self, now: float) -> dict[str, Any]:
        return {"uid": self.uid, "nbytes": self.nbytes,
                "state": "ended" if self.ended_at is not None else "not_recovered",
                "ended_s_ago": None if self.ended_at is None else now - self.ended_at,
                "expires_in_s": max(0.0, self.expires_at - now), "note": self.note}


class SwapRetention:
    """The retained jobs of one swap space."""

    def __init__(self, dirs: list[SwapDir], retention_s: float) -> None:
        self.dirs = dirs
        self.retention_s = retention_s
        self.jobs: dict[str, RetainedJob] = {}
        self.deleting: dict[str, RetainedJob] = {}
        """Reclaimed jobs whose files are being deleted: still listed (with
        ``deleting``) until they are gone from disk, so a status that no longer lists a
        job means its files are gone."""
        self.reclaiming: set[asyncio.Task[int]] = set()
        self.reclaimed_nbytes = 0
        self.on_reclaimed: Callable[[str], None] = lambda _job: None
        """Called with a job's name once its kept files are deleted (its name is free)."""

    def keep(self, job: str, owner: JobOwner | None, nbytes_by_dir: dict[int, int], *,
             ended_at: float | None, uid: int | None = None, note: str = "",
             settling: bool = False) -> RetainedJob:
        """Keep ``job``'s files (already closed) reserved until ``retention_s`` after its
        end (or from now, for an unrecovered live job); ``uid`` when no owner is known.
        ``settling``: its files are still being cut (``settle``)."""
        now = time.time()
        expires_at = (ended_at if ended_at is not None else now) + self.retention_s
        entry = RetainedJob(job, owner, owner.uid if owner is not None else uid,
                            dict(nbytes_by_dir), ended_at, now, expires_at, note, settling)
        self._add(entry)
        log.info("event=swap_retained job=%s uid=%s nbytes=%d expires_in_s=%g state=%s", job,
                 entry.uid, entry.nbytes, max(0.0, expires_at - now),
                 "ended" if ended_at is not None else "not_recovered")
        return entry

    def _add(self, entry: RetainedJob) -> None:
        for index, nbytes in entry.nbytes_by_dir.items():
            self.dirs[index].reserved_nbytes += nbytes
        delay_s = max(0.0, entry.expires_at - time.time())
        entry.timer = asyncio.get_running_loop().call_later(delay_s, self._expire, entry.job)
        self.jobs[entry.job] = entry

    def settle(self, job: str, owner: JobOwner | None, nbytes_by_dir: dict[int, int]) -> None:
        """A settling job's files are cut: count them at their new sizes, under the owner its
        manifest records."""
        entry = self.jobs[job]
        for index, nbytes in entry.nbytes_by_dir.items():
            self.dirs[index].reserved_nbytes -= nbytes
        for index, nbytes in nbytes_by_dir.items():
            self.dirs[index].reserved_nbytes += nbytes
        entry.nbytes_by_dir, entry.settling = dict(nbytes_by_dir), False
        if owner is not None:
            entry.owner, entry.uid = owner, owner.uid
        if entry.expires_at <= time.time():
            self._expire(job)

    def claim(self, job: str, reason: str = "claimed") -> RetainedJob | None:
        """The owner's hello takes ``job``'s files back (its tier reopens and reserves them),
        or they are no longer kept for another ``reason`` (left on disk, uncounted); None
        if they are not kept (never were, or reclaimed)."""
        entry = self.jobs.pop(job, None)
        if entry is None:
            return None
        if entry.timer is not None:
            entry.timer.cancel()
        for index, nbytes in entry.nbytes_by_dir.items():
            self.dirs[index].reserved_nbytes -= nbytes
        log.info("event=swap_unkept job=%s uid=%s nbytes=%d reason=%s", job, entry.uid,
                 entry.nbytes, reason)
        return entry

    def unclaim(self, entry: RetainedJob) -> None:
        """A claim that could not reopen the files: keep them as before."""
        self._add(entry)

    def _expire(self, job: str) -> None:
        entry = self.jobs.get(job)
        if entry is None or entry.settling:  # settle expires it once its files are cut
            return
        task = asyncio.ensure_future(self.reclaim(job, "expired"))
        self.reclaiming.add(task)
        task.add_done_callback(self.reclaiming.discard)

    async def reclaim(self, job: str, reason: str) -> int:
        """Delete a retained job's files and give their budget back; returns bytes freed."""
        entry = self.jobs.pop(job, None)
        if entry is None:
            return 0
        if entry.timer is not None:
            entry.timer.cancel()
        for index, nbytes in entry.nbytes_by_dir.items():
            self.dirs[index].reserved_nbytes -= nbytes
        loop = asyncio.get_running_loop()
        freed = 0
        self.deleting[job] = entry
        try:
            for swap_dir in self.dirs:
                freed += await loop.run_in_executor(None, remove_job_dir, swap_dir.root_fd,
                                                    swap_dir.job_dir(job))
        finally:
            if self.deleting.get(job) is entry:
                del self.deleting[job]
        self.reclaimed_nbytes += entry.nbytes
        log.info("event=swap_reclaimed job=%s uid=%s reason=%s freed_nbytes=%d", job,
                 entry.uid, reason, freed)
        if job not in self.jobs:
            self.on_reclaimed(job)
        return freed

    async def reclaim_oldest(self, which: Callable[[RetainedJob], bool], reason: str) -> bool:
        """Reclaim the oldest retained job ``which`` accepts; False if there is none."""
        for entry in sorted(self.jobs.values(), key=lambda e: e.age_key):
            if not entry.settling and which(entry):
                await self.reclaim(entry.job, reason)
                return True
        return False

    def uid_nbytes(self, uid: int) -> int:
        return sum(entry.nbytes for entry in self.jobs.values() if entry.uid == uid)

    def listing(self, visible: Callable[[RetainedJob], bool]) -> dict[str, dict[str, Any]]:
        now = time.time()
        listed = {name: entry.describe(now) for name, entry in self.jobs.items()
                  if visible(entry)}
        for name, entry in self.deleting.items():
            if visible(entry) and name not in listed:
                listed[name] = {**entry.describe(now), "expires_in_s": 0.0, "deleting": True}
        return listed

    def stats(self) -> dict[str, Any]:
        return {"retained_jobs": len(self.jobs),
                "retained_nbytes": sum(entry.nbytes for entry in self.jobs.values()),
                "retention_s": self.retention_s, "reclaimed_nbytes": self.reclaimed_nbytes}

    async def close(self) -> None:
        """Daemon stop: the files stay on disk for --recover; timers end."""
        for entry in self.jobs.values():
            if entry.timer is not None:
                entry.timer.cancel()
        if self.reclaiming:
            await asyncio.gather(*self.reclaiming, return_exceptions=True)


# -- on disk (run off the loop) -------------------------------------------------------


def end_job_files(dirs: list[SwapDir], job: str, ended_at: float
                  ) -> tuple[JobOwner | None, dict[int, int]]:
    """A job with a manifest ended: mark its manifest ended and cut its files to what the
    manifest names. Returns the manifest's owner and the bytes kept per swap dir."""
    manifest, ends = mark_ended(dirs[0].job_dir(job), dirs[0].root_fd, ended_at)
    return manifest_owner(manifest), shrink_job_files(dirs, job, ends)


def shrink_kept_files(dirs: list[SwapDir], job: str) -> dict[int, int]:
    """At ``--recover``: cut a kept job's files to what its manifest names (a crash may have
    come before its end cut them, or it was live); returns the bytes kept per swap dir."""
    return shrink_job_files(dirs, job, retained_file_ends(dirs[0].job_dir(job), dirs[0].root_fd))


def shrink_job_files(dirs: list[SwapDir], job: str, ends: dict[int, int]) -> dict[int, int]:
    """Truncate the job's swap file in each dir to ``ends[index]`` (page-aligned) when it
    is longer; returns each file's size after."""
    sizes: dict[int, int] = {}
    for swap_dir in dirs:
        job_dir = swap_dir.job_dir(job)
        try:
            dir_fd = open_private_subdir(swap_dir.root_fd, job, job_dir, create=False)
        except FileNotFoundError:
            continue
        try:
            fd = os.open(SWAP_FILE, os.O_RDWR | FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        finally:
            with contextlib.suppress(OSError):
                os.close(dir_fd)
        try:
            size, keep = os.fstat(fd).st_size, align_up(ends.get(swap_dir.index, 0))
            if size > keep:
                os.ftruncate(fd, keep)
                log.info("event=swap_file_shrunk job=%s file=%s from_nbytes=%d to_nbytes=%d",
                         job, Path(job_dir) / SWAP_FILE, size, keep)
                size = keep
            sizes[swap_dir.index] = size
        finally:
            os.close(fd)
    return sizes
