"""Ended jobs' flushed swap files: kept for ``--recover``, counted, bounded, reclaimed.

A job that ends after a flush keeps its swap files, so that a daemon restarted with
``--recover`` finds its last flush. Those files still take disk: they stay reserved in
their swap dirs' budgets and count against their owner's ``max_swap_nbytes_per_uid``,
``offloadd status`` lists them, and they are deleted without ``offloadd gc``: after
``flushed_job_retention_s``, or earlier, oldest first, when their owner or their swap dir
needs the room for a live job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from offloadd.swap.swapdirs import SwapDir, remove_job_dir

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RetainedJob:
    """One ended job's kept swap files."""

    job: str
    uid: int | None
    """Its owner (None: a recovered job nobody attached to)."""
    nbytes_by_dir: dict[int, int]
    """Swap dir index -> bytes of the job's file there, still reserved in that dir."""
    ended_at: float
    expires_at: float
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_dir.values())

    def describe(self, now: float) -> dict[str, Any]:
        return {"uid": self.uid, "nbytes": self.nbytes, "ended_s_ago": now - self.ended_at,
                "expires_in_s": max(0.0, self.expires_at - now)}


class SwapRetention:
    """The retained jobs of one swap space, oldest first."""

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

    def keep(self, job: str, uid: int | None, nbytes_by_dir: dict[int, int]) -> None:
        """``job`` ended with a manifest: its files (already closed) stay reserved."""
        now = time.time()
        for index, nbytes in nbytes_by_dir.items():
            self.dirs[index].reserved_nbytes += nbytes
        entry = RetainedJob(job, uid, dict(nbytes_by_dir), now, now + self.retention_s)
        entry.timer = asyncio.get_running_loop().call_later(self.retention_s, self._expire, job)
        self.jobs[job] = entry
        log.info("event=swap_retained job=%s uid=%s nbytes=%d retention_s=%g", job, uid,
                 entry.nbytes, self.retention_s)

    def _expire(self, job: str) -> None:
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
        return freed

    async def reclaim_oldest(self, which: Callable[[RetainedJob], bool], reason: str) -> bool:
        """Reclaim the oldest retained job ``which`` accepts; False if there is none."""
        for entry in self.jobs.values():
            if which(entry):
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
