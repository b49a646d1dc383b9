"""Jobs end: a job with no sessions left is freed after ``job_linger_s``, or at once after
``close_job``.

The linger lets a restarting rank reattach to its shards; a job whose ranks said
``close_job`` has nothing to come back to. Freeing a job unmaps and unlocks its arena,
closes its fds, forgets its owner, and closes its swap files (deleting them unless a
flush left a manifest there for ``--recover``).

Hazard, arena lifetime: an optimizer step runs on a worker thread and swap IO on the IO
engine, both writing into the arena. A job is freed only when no shard is leased (the
optimizer holds its leases until the thread is done), and its arena is closed only after
its swap tier has been closed (which waits for the tier's IO).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offloadd.jobs import Job
    from offloadd.server import Daemon

log = logging.getLogger(__name__)
BUSY_RETRY_S = 0.5
"""How soon to try again to free an ended job whose shards are still leased."""


class JobLifecycle:
    """Linger timers and the freeing of ended jobs, one per daemon."""

    def __init__(self, daemon: Daemon, linger_s: float) -> None:
        self.daemon = daemon
        self.linger_s = linger_s
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.closing: set[str] = set()
        """Jobs whose ranks sent close_job: freed as soon as the last session leaves."""
        self.freeing: set[asyncio.Task[None]] = set()
        self.freed_jobs = 0

    def attached(self, job: Job) -> None:
        """A session said hello to ``job``: it lives on."""
        timer = self.timers.pop(job.name, None)
        if timer is not None:
            timer.cancel()

    def detached(self, job: Job) -> None:
        """A session of ``job`` ended (closed, or sent close_job)."""
        if job.num_sessions > 0 or self.daemon.jobs.jobs.get(job.name) is not job:
            return
        if job.name in self.closing:
            self._expire(job)
        else:
            self._schedule(job, self.linger_s)

    def close_requested(self, job: Job) -> None:
        """A rank sent close_job: free the job once no session is left (now, if none is)."""
        self.closing.add(job.name)
        self.detached(job)

    def _schedule(self, job: Job, delay_s: float) -> None:
        old = self.timers.pop(job.name, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self.timers[job.name] = loop.call_later(delay_s, self._expire, job)

    def _expire(self, job: Job) -> None:
        self.timers.pop(job.name, None)
        if job.num_sessions > 0 or self.daemon.jobs.jobs.get(job.name) is not job:
            return
        if job.table.leased_nbytes() > 0:  # an in-daemon optimizer step still holds leases
            self._schedule(job, BUSY_RETRY_S)
            return
        self.free(job)

    def free(self, job: Job) -> None:
        """Forget ``job`` now; its arena closes after its swap tier (see the module note)."""
        del self.daemon.jobs.jobs[job.name]
        self.daemon.auth.forget(job.name)
        self.closing.discard(job.name)
        self.freed_jobs += 1
        log.info("event=job_freed job=%s shards=%d", job.name, len(job.table.shards))
        if job.tier is None or self.daemon.swap is None:
            job.arena.close()
            return
        task = asyncio.ensure_future(self._free_swap(job))
        self.freeing.add(task)
        task.add_done_callback(self.freeing.discard)

    async def _free_swap(self, job: Job) -> None:
        try:
            await self.daemon.swap.release_job(job.name, keep_flushed=True,
                                               owner_uid=job.owner_uid)
        except Exception:  # the arena must still go; the files are left for `offloadd gc`
            log.exception("event=swap_release_failed job=%s", job.name)
        finally:
            job.arena.close()

    async def close(self) -> None:
        """Daemon stop: cancel the timers and let frees in progress finish."""
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        if self.freeing:
            await asyncio.gather(*self.freeing, return_exceptions=True)
