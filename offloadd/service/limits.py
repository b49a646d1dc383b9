"""Limits per client: what one connection, uid or job may hold of the daemon.

The daemon serves every job on the node; without these bounds one client could
exhaust its memory (partial frames, shard tables, prefetch tasks) or its sessions
for everyone. Each limit is a config key (``DaemonConfig``), each rejection a
``LimitExceededError`` naming that key and a count in
``offloadd_limit_rejections_total{limit}``.
"""

from __future__ import annotations

import dataclasses
import resource
from collections import Counter
from typing import TYPE_CHECKING

from offloadd.config import Limits
from offloadd.errors import LimitExceededError
from offloadd.metrics import Counters

if TYPE_CHECKING:
    from offloadd.metrics import DaemonMetrics
    from offloadd.service.jobs import Job, JobRegistry


SHARD_METADATA_NBYTES = 400
"""Daemon memory per shard besides its id (measured with tracemalloc: ~350 bytes for the
Shard, its key tuple and its table entry)."""


class LimitGuard:
    """Enforces the limits; one per daemon. Methods raise LimitExceededError.

    Per-uid totals charge a job to its owner (``claim_job``, the uid of its first
    hello) and are summed over that uid's live jobs, so nothing has to be undone
    when a shard or a job goes away.
    """

    def __init__(self, limits: Limits, metrics: DaemonMetrics,
                 registry: JobRegistry | None = None, fds_per_job: int = 1) -> None:
        self.limits = limits
        self.registry = registry
        self.fds_per_job = fds_per_job
        """Descriptors a job holds: its arena and one swap file per swap dir."""
        self.sessions_by_uid: Counter[int] = Counter()
        self.num_sessions = 0
        self.jobs_by_uid: dict[int, list[Job]] = {}
        self.creating_by_uid: Counter[int] = Counter()
        """New jobs of each uid whose arena is being made (not yet in the registry)."""
        self.steps_by_uid: Counter[int] = Counter()
        self.pending_by_uid: Counter[int] = Counter()
        self.node_status_next: dict[int, float] = {}
        self.fds_per_uid = min(limits.max_fds_per_uid, max(raise_nofile_limit() // 2, 1))
        self.rejections = Counters("offloadd_limit_rejections",
                                   "Requests and connections refused by a limit.", ["limit"])
        for knob in (f.name for f in dataclasses.fields(Limits)):  # every series from 0
            self.rejections.values[(knob,)] = 0.0
        metrics.sources.append(lambda: [self.rejections.family()])

    def reject(self, knob: str, message: str) -> LimitExceededError:
        self.rejections.add((knob,))
        return LimitExceededError(f"{message} ({knob} in the daemon config)")

    def session_opened(self, uid: int) -> None:
        """Count a new connection of ``uid``, or raise if the node or the uid is full."""
        if self.num_sessions >= self.limits.max_sessions:
            raise self.reject("max_sessions", f"the daemon already serves "
                              f"{self.num_sessions} connections")
        if self.sessions_by_uid[uid] >= self.limits.max_sessions_per_uid:
            raise self.reject("max_sessions_per_uid", f"uid {uid} already has "
                              f"{self.sessions_by_uid[uid]} connections")
        self.check_fds(uid, 1)
        self.num_sessions += 1
        self.sessions_by_uid[uid] += 1

    def session_closed(self, uid: int) -> None:
        self.num_sessions -= 1
        self.sessions_by_uid[uid] -= 1
        if not self.sessions_by_uid[uid]:
            del self.sessions_by_uid[uid]

    def check_ids(self, count: int) -> None:
        if count > self.limits.max_ids_per_request:
            raise self.reject("max_ids_per_request", f"a request with {count} ids; send at "
                              f"most {self.limits.max_ids_per_request} per request")

    def check_new_shards(self, job: Job, rank: int, ids: list[str]) -> None:
        """Before an alloc: would the new ids among ``ids`` grow the table past the limit?"""
        limit, shards = self.limits.max_shards_per_job, job.table.shards
        if len(shards) + len(ids) <= limit:  # the common case needs no per-id look-up
            return
        fresh = len({i for i in ids if (rank, i) not in shards})
        if len(shards) + fresh > limit:
            raise self.reject("max_shards_per_job", f"job {job.name!r} holds {len(shards)} "
                              f"shards; {fresh} more would pass {limit}; drop some first")

    def check_prefetch(self, job: Job, count: int) -> None:
        in_flight = len(job.tier.prefetching) if job.tier is not None else 0
        limit = self.limits.max_prefetches_per_job
        if in_flight + count > limit:
            raise self.reject("max_prefetches_per_job", f"job {job.name!r} has {in_flight} "
                              f"prefetches in flight; {count} more would pass {limit}")

    def check_partial_frame(self, nbytes: int) -> None:
        if nbytes > self.limits.max_partial_frame_nbytes:
            raise self.reject("max_partial_frame_nbytes", f"a frame of {nbytes} bytes")

    # -- per uid ------------------------------------------------------------------------

    def jobs_of(self, uid: int) -> list[Job]:
        """The live jobs ``uid`` owns (freed ones are pruned here)."""
        jobs = self.jobs_by_uid.get(uid)
        if not jobs:
            return []
        live = self.registry.jobs if self.registry is not None else {}
        alive = [job for job in jobs if live.get(job.name) is job]
        if len(alive) != len(jobs):
            if alive:
                self.jobs_by_uid[uid] = alive
            else:
                del self.jobs_by_uid[uid]
        return alive

    def claim_job(self, job: Job, uid: int) -> None:
        """``uid`` said the first hello of ``job``: its resources count against ``uid``."""
        if job.owner_uid is None:
            job.owner_uid = uid
            self.jobs_by_uid.setdefault(uid, []).append(job)

    def check_fds(self, uid: int, more: int) -> None:
        held = (self.sessions_by_uid[uid] + self.creating_by_uid[uid] * self.fds_per_job
                + sum(self.job_fds(job) for job in self.jobs_of(uid)))
        if held + more > self.fds_per_uid:
            raise self.reject("max_fds_per_uid", f"uid {uid} holds {held} descriptors of the "
                              f"daemon (connections, arenas, swap files); {more} more would pass "
                              f"{self.fds_per_uid} (at most half the daemon's RLIMIT_NOFILE); "
                              "close connections or end jobs")

    def job_fds(self, job: Job) -> int:
        return 1 + (len(getattr(job.tier, "files", ())) if job.tier is not None else 0)

    def new_job_starting(self, uid: int) -> None:
        """A hello of ``uid`` creates a job: check its job and descriptor counts, then count
        it as creating until ``new_job_done``."""
        jobs = len(self.jobs_of(uid)) + self.creating_by_uid[uid]
        if jobs >= self.limits.max_jobs_per_uid:
            raise self.reject("max_jobs_per_uid", f"uid {uid} already owns {jobs} jobs; "
                              "end one (close_job) or reuse a job name")
        self.check_fds(uid, self.fds_per_job)
        self.creating_by_uid[uid] += 1

    def new_job_done(self, uid: int) -> None:
        self.creating_by_uid[uid] -= 1
        if not self.creating_by_uid[uid]:
            del self.creating_by_uid[uid]

    def check_uid_shards(self, job: Job, ids: list[str]) -> None:
        """Before an alloc into ``job``: would its owner's shards or metadata pass a limit?

        Counts every id as new (an upper bound; a repeated id is counted twice)."""
        uid = job.owner_uid
        if uid is None:
            return
        jobs = self.jobs_of(uid)
        shards = sum(len(j.table.shards) for j in jobs)
        if shards + len(ids) > self.limits.max_shards_per_uid:
            raise self.reject("max_shards_per_uid", f"uid {uid}'s jobs hold {shards} shards; "
                              f"{len(ids)} more would pass {self.limits.max_shards_per_uid}; "
                              "drop some first")
        metadata = shards * SHARD_METADATA_NBYTES + sum(j.table.id_nbytes for j in jobs)
        more = len(ids) * SHARD_METADATA_NBYTES + sum(map(len, ids))
        if metadata + more > self.limits.max_metadata_nbytes_per_uid:
            raise self.reject("max_metadata_nbytes_per_uid", f"uid {uid}'s jobs hold {metadata} "
                              f"bytes of shard metadata; {more} more would pass "
                              f"{self.limits.max_metadata_nbytes_per_uid}; drop shards or use "
                              "fewer, larger ones")

    def step_queued(self, uid: int) -> None:
        if self.steps_by_uid[uid] >= self.limits.max_queued_steps_per_uid:
            raise self.reject("max_queued_steps_per_uid", f"uid {uid} has "
                              f"{self.steps_by_uid[uid]} optimizer steps queued or running; "
                              "wait for their replies first")
        self.steps_by_uid[uid] += 1

    def step_done(self, uid: int) -> None:
        self.steps_by_uid[uid] -= 1
        if not self.steps_by_uid[uid]:
            del self.steps_by_uid[uid]

    def pending_changed(self, uid: int, delta: int) -> None:
        """Request bytes buffered for ``uid`` changed by ``delta``; raise (and count nothing)
        when growth would pass the uid's limit."""
        total = self.pending_by_uid[uid] + delta
        if delta > 0 and total > self.limits.max_pending_nbytes_per_uid:
            raise self.reject("max_pending_nbytes_per_uid", f"uid {uid}'s connections have "
                              f"{self.pending_by_uid[uid]} request bytes buffered; {delta} more "
                              f"would pass {self.limits.max_pending_nbytes_per_uid}; read your "
                              "replies and send whole frames")
        if total:
            self.pending_by_uid[uid] = total
        else:
            self.pending_by_uid.pop(uid, None)

    def check_rank(self, job: Job, rank: int) -> None:
        """Per-rank state (access traces, stall series) is kept for a bounded set of ranks."""
        if rank in job.ranks:
            return
        if len(job.ranks) >= self.limits.max_ranks_per_job:
            raise self.reject("max_ranks_per_job", f"job {job.name!r} already has "
                              f"{len(job.ranks)} distinct ranks on this node")
        job.ranks.add(rank)

    def node_status_delay_s(self, uid: int, now: float) -> float:
        """Seconds ``uid``'s node_status must wait for its turn (and book that turn)."""
        turn = max(now, self.node_status_next.get(uid, 0.0))
        self.node_status_next[uid] = turn + self.limits.node_status_interval_s
        if len(self.node_status_next) > 4 * max(self.num_sessions, 64):  # forget old turns
            self.node_status_next = {u: t for u, t in self.node_status_next.items() if t > now}
        return turn - now


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
