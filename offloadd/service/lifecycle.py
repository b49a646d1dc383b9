"""Jobs end: a job with no sessions left is freed after ``job_linger_s``, or at once when its
last session left by ``close_job``; a private daemon ends when no rank of its jobs is left
(``IdleExit``).

The linger lets a restarting rank reattach to its shards; a job whose last rank said
``close_job`` has nothing to come back to. Hazard: one rank's ``close_job`` says only that
this rank is done; were the job marked for freeing, a peer rank that crashes later (or
reattaches, then crashes) would find its shards gone instead of lingering. So only the
way the last session leaves decides. A job made for a hello whose session never attached
(closed or timed out while its arena was made) lingers too, from its creation.

Freeing a job unmaps and unlocks its arena, closes its fds, and closes its swap files:
deleting them and forgetting its owner, unless a flush left a manifest there. Then the
files are kept for the owner (``offloadd.swap.retention``), and so is the job's name: only
the owner's hello takes it, claiming the kept files (``Daemon.open_job_async``), until
they are reclaimed. A hello for a name whose job is being freed waits for that to end
(``settled``), so it finds the files either kept or gone, never half-closed.

A job brought back by ``--recover`` has no ranks attached: it lingers like a job whose
ranks are gone (``created``), charged to its owner.

Hazard, arena lifetime: an optimizer step runs on a worker thread and swap IO on the IO
engine, both writing into the arena. A job is freed only when no shard is leased (the
optimizer holds its leases until the thread is done), and its arena is closed only after
its swap tier has been closed (which waits for the tier's IO).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Collection
from typing import Any, Protocol

from offloadd.service.auth import JobAuthority
from offloadd.service.jobs import Job
from offloadd.service.registry import JobRegistry

log = logging.getLogger(__name__)
BUSY_RETRY_S = 0.5
"""How soon to try again to free an ended job whose shards are still leased."""


class Session(Protocol):
    """What ``IdleExit`` watches of a rank's session (``offloadd.service.session.Session``)."""

    @property
    def session_id(self) -> int: ...
    @property
    def peer_pid(self) -> int: ...
    @property
    def job(self) -> Job | None: ...
    @property
    def hello_pending(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def transport(self) -> asyncio.BaseTransport | None: ...


class Daemon(Protocol):
    """What the lifecycle uses of the daemon (``offloadd.service.server.Daemon``): its jobs,
    their owners and swap, its sessions, and a way to stop."""

    @property
    def jobs(self) -> JobRegistry: ...
    @property
    def auth(self) -> JobAuthority: ...
    @property
    def swap(self) -> Any: ...
    @property
    def sessions(self) -> Collection[Session]: ...
    @property
    def idle_exit(self) -> IdleExit | None: ...

    def request_stop(self) -> None: ...


class JobLifecycle:
    """Linger timers and the freeing of ended jobs, one per daemon."""

    def __init__(self, daemon: Daemon, linger_s: float) -> None:
        self.daemon = daemon
        self.linger_s = linger_s
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.freeing: dict[str, asyncio.Task[None]] = {}
        """Freed jobs whose swap files are being closed (and kept or deleted), by name."""
        self.freed_jobs = 0
        self.hellos: dict[str, int] = {}
        """Hellos being served, by job name: a job they are about to attach to is not freed
        (a new job's linger starts at its creation, before its first hello attaches)."""

    def hello_began(self, name: str) -> None:
        self.hellos[name] = self.hellos.get(name, 0) + 1

    def hello_ended(self, name: str) -> None:
        left = self.hellos.pop(name, 1) - 1
        if left:
            self.hellos[name] = left

    def attached(self, job: Job) -> None:
        """A session said hello to ``job``: it lives on."""
        timer = self.timers.pop(job.name, None)
        if timer is not None:
            timer.cancel()
        if self.daemon.idle_exit is not None:
            self.daemon.idle_exit.attached()

    def created(self, job: Job) -> None:
        """A new job's arena is made: it lingers until a session attaches (``attached``)."""
        if job.num_sessions == 0:
            self._schedule(job, self.linger_s)

    def detached(self, job: Job) -> None:
        """A session of ``job`` ended without close_job: the job lingers if it was the last."""
        if job.num_sessions == 0 and self.daemon.jobs.jobs.get(job.name) is job:
            self._schedule(job, self.linger_s)
        if self.daemon.idle_exit is not None:
            self.daemon.idle_exit.check()

    def close_requested(self, job: Job) -> None:
        """A rank sent close_job: free the job now if it was the last session, else nothing
        (see the module note)."""
        if job.num_sessions == 0 and self.daemon.jobs.jobs.get(job.name) is job:
            self._expire(job)

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
        if job.table.leased_nbytes() > 0 or self.hellos.get(job.name):
            # An in-daemon optimizer step still holds leases, or a hello is attaching.
            self._schedule(job, BUSY_RETRY_S)
            return
        self.free(job)

    def free(self, job: Job) -> None:
        """Forget ``job`` now; its arena closes after its swap tier (see the module note)."""
        del self.daemon.jobs.jobs[job.name]
        self.freed_jobs += 1
        log.info("event=job_freed job=%s shards=%d", job.name, len(job.table.shards))
        if job.tier is None or self.daemon.swap is None:
            self.daemon.auth.forget(job.name)
            job.arena.close()
        else:
            task = asyncio.ensure_future(self._free_swap(job))
            self.freeing[job.name] = task
            task.add_done_callback(functools.partial(self._freed, job.name))
        if self.daemon.idle_exit is not None:
            self.daemon.idle_exit.check()

    async def _free_swap(self, job: Job) -> None:
        try:
            await self.daemon.swap.release_job(job.name, keep_flushed=True,
                                               owner_uid=job.owner_uid)
        except Exception:  # the arena must still go; the files are left for `offloadd gc`
            log.exception("event=swap_release_failed job=%s", job.name)
        finally:
            kept = job.name in self.daemon.swap.retention.jobs
            if not kept and job.name not in self.daemon.jobs.jobs:
                self.daemon.auth.forget(job.name)  # kept files keep the name for their owner
            job.arena.close()

    def abandon(self, job: Job) -> None:
        """A job that could not be set up (its kept files would not load) and has left the
        registry: its swap files close, staying on disk, then its arena."""
        task = asyncio.ensure_future(self._close_abandoned(job))
        self.freeing[job.name] = task
        task.add_done_callback(functools.partial(self._freed, job.name))

    async def _close_abandoned(self, job: Job) -> None:
        try:
            await self.daemon.swap.close_tier(job.name)
        finally:
            job.arena.close()

    def _freed(self, name: str, task: asyncio.Task[None]) -> None:
        if self.freeing.get(name) is task:
            del self.freeing[name]

    async def settled(self, name: str) -> None:
        """Wait until a job of this name that is being freed has its swap files closed."""
        task = self.freeing.get(name)
        if task is not None:
            await asyncio.shield(task)

    async def close(self) -> None:
        """Daemon stop: cancel the timers and let frees in progress finish."""
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        if self.freeing:
            await asyncio.gather(*self.freeing.values(), return_exceptions=True)


class IdleExit:
    """The end of a private daemon (``DaemonConfig.exit_when_idle_s``): it serves the ranks
    of one training job, and nobody stops it once they are gone.

    - Every rank closed its job and left: stop at once (the clean end of a run, whichever
      rank finishes last; the daemon must outlive local rank 0 while other ranks work).
    - No rank attached for ``idle_s`` (all ranks died, by SIGKILL or the OOM killer, or
      none ever came): stop, giving up lingering jobs.

    Hazard, inherited sockets: the kernel closes a dead rank's connection only when no
    process holds it any more, and a child the rank forked (a DataLoader worker, a pool
    process blocked on a pipe) keeps it open after the rank is killed. So the daemon also
    watches each rank's own process (a pidfd of the SO_PEERCRED pid) and ends the session
    when that process exits, whoever still holds its socket.
    """

    def __init__(self, daemon: Daemon, idle_s: float) -> None:
        self.daemon = daemon
        self.idle_s = idle_s
        self.timer: asyncio.TimerHandle | None = None
        self.served = False
        """A rank attached once: before that, an empty daemon is starting, not finished."""
        self.watches: dict[Session, int] = {}
        """The pidfd of each attached session's peer process."""
        self.stopped = False

    def start(self) -> None:
        """The daemon listens: the ranks have ``idle_s`` to say hello."""
        self._arm()

    def attached(self) -> None:
        self.served = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for session in self.daemon.sessions:
            if session.job is not None and session not in self.watches:
                self._watch(session)

    def check(self) -> None:
        """A session left or a job was freed: stop when nobody is left."""
        for session in [s for s in self.watches if s.closed or s.job is None]:
            self._unwatch(session)
        if self._ranks_present():
            return
        if self.served and not self.daemon.jobs.jobs:
            self._stop("every_job_closed")
        elif self.timer is None:
            self._arm()

    def _ranks_present(self) -> bool:
        # A hello still making its job's arena counts: its rank is about to attach.
        return any(session.job is not None or session.hello_pending
                   for session in self.daemon.sessions)

    def _watch(self, session: Session) -> None:
        try:
            pidfd = os.pidfd_open(session.peer_pid)
        except OSError:  # gone already, or no pidfd (Linux < 5.3): socket EOF still ends it
            return
        self.watches[session] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._peer_exited, session)

    def _unwatch(self, session: Session) -> None:
        pidfd = self.watches.pop(session, None)
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

    def _peer_exited(self, session: Session) -> None:
        self._unwatch(session)
        if not session.closed and session.transport is not None:
            log.info("event=peer_exited session=%d pid=%d", session.session_id,
                     session.peer_pid)
            session.transport.close()

    def _arm(self) -> None:
        self.timer = asyncio.get_running_loop().call_later(self.idle_s, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self._ranks_present():  # a hello still making its arena: it may yet fail
            self._arm()
            return
        self._stop("idle")

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for session in list(self.watches):
            self._unwatch(session)

    def _stop(self, reason: str) -> None:
        if self.stopped:  # a freed job and its session's end both report the same end
            return
        self.stopped = True
        log.info("event=idle_exit reason=%s idle_s=%s jobs=%d", reason, self.idle_s,
                 len(self.daemon.jobs.jobs))
        self.daemon.request_stop()
