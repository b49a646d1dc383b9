"""Limits per client: what one connection, uid or job may hold of the daemon.

The daemon serves every job on the node; without these bounds one client could
exhaust its memory (partial frames, shard tables, prefetch tasks) or its sessions
for everyone. Each limit is a config key (``DaemonConfig``), each rejection a
``LimitExceededError`` naming that key and a count in
``offloadd_limit_rejections_total{limit}``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offloadd.errors import LimitExceededError
from offloadd.metrics import Counters
from offloadd.protocol import MAX_FRAME_NBYTES

if TYPE_CHECKING:
    from offloadd.jobs import Job
    from offloadd.metrics import DaemonMetrics


@dataclass(kw_only=True, frozen=True)
class Limits:
    """The limit values, copied from DaemonConfig (see its docstrings)."""

    max_sessions: int
    max_sessions_per_uid: int
    hello_timeout_s: float
    max_ids_per_request: int
    max_shards_per_job: int
    max_prefetches_per_job: int
    max_partial_frame_nbytes: int
    frame_timeout_s: float


def check_limits(limits: Limits, max_frame_nbytes: int = MAX_FRAME_NBYTES) -> None:
    """Raise ValueError naming the knob for a limit outside its range."""
    for knob in ("max_sessions", "max_sessions_per_uid", "max_ids_per_request",
                 "max_shards_per_job", "max_prefetches_per_job"):
        if getattr(limits, knob) < 1:
            raise ValueError(f"{knob} must be >= 1, got {getattr(limits, knob)}")
    for knob in ("hello_timeout_s", "frame_timeout_s"):
        if getattr(limits, knob) <= 0:
            raise ValueError(f"{knob} must be > 0 seconds, got {getattr(limits, knob)}")
    if not 4096 <= limits.max_partial_frame_nbytes <= max_frame_nbytes:
        raise ValueError(f"max_partial_frame_nbytes must be in [4096, {max_frame_nbytes}] bytes, "
                         f"got {limits.max_partial_frame_nbytes}")


class LimitGuard:
    """Enforces the limits; one per daemon. Methods raise LimitExceededError."""

    def __init__(self, limits: Limits, metrics: DaemonMetrics) -> None:
        self.limits = limits
        self.sessions_by_uid: Counter[int] = Counter()
        self.num_sessions = 0
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
