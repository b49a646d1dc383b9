"""Limits per client: what one connection, uid or job may hold of the daemon.

The daemon serves every job on the node; without these bounds one client could
exhaust its memory (partial frames, shard tables, prefetch tasks), its descriptors,
its DRAM budget or its sessions for everyone. Each limit is a config key
(``DaemonConfig``), each rejection a typed error naming that key (``LimitExceededError``;
``OverBudgetError`` for arena room) and a count in ``offloadd_limit_rejections_total{limit}``.

Three of them are shares of something the node has a fixed amount of:

- Descriptors: sized from the daemon's RLIMIT_NOFILE as it is now. ``fd_reserve`` of them
  are kept for the daemon itself; a uid gets at most half of the rest (``max_fds_per_uid``
  lower still), and what all uids hold together never passes the rest, so a hello is
  refused with ``limit`` before any open() could fail with EMFILE.
- Shard metadata: a uid may hold ``METADATA_FLOOR_NBYTES`` plus a quarter of its arenas'
  bytes (``max_metadata_nbytes_per_uid`` lower still): shards are what arenas hold, so
  tiny arenas cannot carry millions of them.
- The DRAM budget (``arena_size``): a uid's share is ``max_arena_nbytes_per_uid``, or by
  default the budget divided among the uids that hold arenas or ask for one. A uid may
  use free room past its share while nobody else waits for room; a uid asking within its
  share first gets the lingering arenas (ranks gone) of uids past theirs freed, oldest
  first, as their linger would have ended (``offloadd.service.lifecycle``); any uid's
  hello gets its own lingering arenas freed so (a run killed before it closed its job,
  restarted under a fresh job name, would otherwise wait ``job_linger_s`` for its room).

Jobs count against the uid whose hello created them from the moment their arena is made,
lingering ones and ones whose hello was abandoned included.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import resource
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from offloadd.config import Limits
from offloadd.errors import LimitExceededError, OverBudgetError
from offloadd.memory.arena import align_up
from offloadd.metrics import Counters

if TYPE_CHECKING:
    from offloadd.metrics import DaemonMetrics
    from offloadd.service.jobs import Job
    from offloadd.service.lifecycle import JobLifecycle
    from offloadd.service.registry import JobRegistry

log = logging.getLogger(__name__)

SHARD_METADATA_NBYTES = 400
"""Daemon memory per shard besides its id (measured with tracemalloc: ~350 bytes for the
Shard, its key tuple and its table entry)."""
METADATA_FLOOR_NBYTES = 8 << 20
"""Shard metadata any uid may hold however small its arenas (~20k shards)."""
ARENA_NBYTES_PER_METADATA_NBYTE = 4
"""A uid may hold one more byte of shard metadata per this many bytes of its arenas: about
2.5x the metadata of the page-sized shards its arenas hold at once (more live in swap)."""
ARENA_FDS = 2
"""Descriptors one job arena holds: its memfd, and the duplicate CPython's mmap keeps."""
SWAP_FILE_FDS = 2
"""Descriptors one swap file of a job holds: the file and its job dir
(``offloadd.swap.nvme.JobFile``)."""
FD_RESERVE_MIN = 64
"""Descriptors kept for the daemon itself at least: its listener and log, the IO engine,
/metrics connections, files a flush or a recovery opens for a moment."""
FD_RESERVE_FRACTION = 8
"""... or this fraction of RLIMIT_NOFILE (1/8), whichever is more."""
WAITING_S = 60.0
"""How long a uid refused arena room within its share counts as waiting for room: the fair
share divides the budget among it too, and no other uid grows past its share meanwhile."""


class LimitGuard:
    """Enforces the limits; one per daemon. Methods raise LimitExceededError.

    Per-uid totals charge a job to its owner (``claim_job``: the uid whose hello created
    it, ``creation_ended``) and are summed over that uid's live jobs, lingering ones
    included, so nothing has to be undone when a shard or a job goes away.
    """

    def __init__(self, limits: Limits, metrics: DaemonMetrics,
                 registry: JobRegistry | None = None, *, swap_dirs: int = 0,
                 lifecycle: JobLifecycle | None = None) -> None:
        self.limits = limits
        self.registry = registry
        self.lifecycle = lifecycle
        """Frees lingering arenas another uid's share needs (None: never)."""
        self.fds_per_job = ARENA_FDS + SWAP_FILE_FDS * swap_dirs
        """Descriptors a new job will hold: its arena and one swap file per swap dir."""
        self.sessions_by_uid: Counter[int] = Counter()
        self.num_sessions = 0
        self.jobs_by_uid: dict[int, list[Job]] = {}
        self.creators: dict[str, int] = {}
        """New jobs whose hello was let through (their arena being made, or about to be), by
        name: the uid of their first hello, which they are charged to once made."""
        self.creating_hellos: Counter[str] = Counter()
        """Hellos under way for each name in ``creators`` (several ranks of a new job)."""
        self.waiting: dict[int, float] = {}
        """Uids refused arena room within their share, and until when they count as waiting."""
        self.steps_by_uid: Counter[int] = Counter()
        self.pending_by_uid: Counter[int] = Counter()
        self.node_status_next: dict[int, float] = {}
        raise_nofile_limit()
        self.rejections = Counters("offloadd_limit_rejections",
                                   "Requests and connections refused by a limit.", ["limit"])
        for knob in (*(f.name for f in dataclasses.fields(Limits)), "RLIMIT_NOFILE"):
            self.rejections.values[(knob,)] = 0.0  # every series from 0
        metrics.sources.append(lambda: [self.rejections.family()])
        if registry is not None:
            registry.admission = self

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

    # -- jobs per uid -------------------------------------------------------------------

    def jobs_of(self, uid: int) -> list[Job]:
        """The live jobs ``uid`` owns, lingering ones included (freed ones are pruned here)."""
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

    def creating_of(self, uid: int) -> list[str]:
        """Names of the new jobs ``uid``'s hellos are creating."""
        return [name for name, creator in self.creators.items() if creator == uid]

    def claim_job(self, job: Job, uid: int) -> None:
        """``job`` counts against ``uid`` (a no-op for a job that has its owner already)."""
        if job.owner_uid is None:
            job.owner_uid = uid
            self.jobs_by_uid.setdefault(uid, []).append(job)

    def new_job_starting(self, uid: int, name: str) -> None:
        """A hello of ``uid`` creates job ``name``: check its job and descriptor counts; the
        job counts against ``uid`` from now on (``creation_ended``, ``new_job_done``)."""
        if name not in self.creators:  # else another rank's hello creates it: no new job
            jobs = len(self.jobs_of(uid)) + len(self.creating_of(uid))
            if jobs >= self.limits.max_jobs_per_uid:
                raise self.reject("max_jobs_per_uid", f"uid {uid} already owns {jobs} jobs, "
                                  "lingering ones included; end one (close_job) or reuse a "
                                  "job name")
            self.check_fds(uid, self.fds_per_job)
            self.creators[name] = uid
        self.creating_hellos[name] += 1

    def new_job_done(self, uid: int, name: str) -> None:
        """A hello of ``uid`` for new job ``name`` is over (answered or abandoned). The job
        stays charged to its creator while its arena is still being made."""
        self.creating_hellos[name] -= 1
        if self.creating_hellos[name] <= 0:
            del self.creating_hellos[name]
            creating = self.registry.creating if self.registry is not None else {}
            if name not in creating:
                self.creators.pop(name, None)

    def creation_ended(self, name: str, job: Job | None) -> None:
        """The registry made the arena of ``name`` (``job``) or gave up (None: the creator
        stays charged while other hellos of the job may try again)."""
        if job is not None:
            uid = self.creators.pop(name, None)
            if uid is not None:
                self.claim_job(job, uid)
        elif not self.creating_hellos.get(name):
            self.creators.pop(name, None)

    # -- descriptors --------------------------------------------------------------------

    def fd_budget(self) -> tuple[int, int, int]:
        """(the daemon's RLIMIT_NOFILE now, descriptors left to clients, one uid's share)."""
        nofile = nofile_limit()
        usable = max(nofile - fd_reserve(nofile), 0)
        return nofile, usable, min(self.limits.max_fds_per_uid, usable // 2)

    def check_fds(self, uid: int, more: int) -> None:
        """Raise unless ``uid`` and the node can hold ``more`` descriptors."""
        nofile, usable, share = self.fd_budget()
        held = (self.sessions_by_uid[uid] + len(self.creating_of(uid)) * self.fds_per_job
                + sum(self.job_fds(job) for job in self.jobs_of(uid)))
        if held + more > share:
            raise self.reject("max_fds_per_uid", f"uid {uid} holds {held} descriptors of the "
                              f"daemon (1 per connection, {ARENA_FDS} per job arena, "
                              f"{SWAP_FILE_FDS} per job swap file, lingering jobs included); "
                              f"{more} more would pass its share of {share} (at most half of "
                              f"the {usable} its RLIMIT_NOFILE of {nofile} leaves to clients); "
                              "close connections or end jobs (close_job)")
        total = (self.num_sessions + len(self.creators) * self.fds_per_job
                 + sum(self.job_fds(job) for job in self.all_jobs()))
        if total + more > usable:
            self.rejections.add(("RLIMIT_NOFILE",))
            raise LimitExceededError(
                f"the daemon holds {total} of the {usable} descriptors its RLIMIT_NOFILE of "
                f"{nofile} leaves to clients ({fd_reserve(nofile)} are kept for itself); "
                f"{more} more do not fit: try again once jobs end, or raise the daemon's "
                "LimitNOFILE (RLIMIT_NOFILE)")

    def out_of_fds(self, name: str, exc: OSError) -> LimitExceededError:
        """A new job's arena or swap file found no descriptor left (EMFILE/ENFILE)."""
        nofile, _usable, _share = self.fd_budget()
        self.rejections.add(("RLIMIT_NOFILE",))
        return LimitExceededError(
            f"the daemon has no file descriptor left for job {name!r} ({exc.strerror}; its "
            f"RLIMIT_NOFILE is {nofile}); try again once jobs end, or raise the daemon's "
            "LimitNOFILE (RLIMIT_NOFILE)")

    def all_jobs(self) -> list[Job]:
        """Every job made, owned or not (a recovered job may have no owner)."""
        return list(self.registry.jobs.values()) if self.registry is not None else []

    def job_fds(self, job: Job) -> int:
        """Descriptors ``job`` holds: its arena's and its swap files'."""
        return ARENA_FDS + SWAP_FILE_FDS * len(getattr(job.tier, "files", ()))

    # -- shards per uid -----------------------------------------------------------------

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
        arena_nbytes = sum(j.arena.nbytes for j in jobs)
        limit = metadata_limit(self.limits.max_metadata_nbytes_per_uid, arena_nbytes)
        if metadata + more > limit:
            raise self.reject("max_metadata_nbytes_per_uid", f"uid {uid}'s jobs hold {metadata} "
                              f"bytes of shard metadata; {more} more would pass {limit} (the "
                              f"least of max_metadata_nbytes_per_uid and "
                              f"{METADATA_FLOOR_NBYTES} plus 1/{ARENA_NBYTES_PER_METADATA_NBYTE} "
                              f"of the uid's {arena_nbytes} arena bytes); drop shards, use "
                              "fewer, larger ones, or ask for larger arenas")

    # -- arena room per uid (the DRAM budget) -------------------------------------------

    def size_new(self, name: str, requested_nbytes: int) -> tuple[int, int] | None:
        """(arena bytes, budget bytes free) for new job ``name`` within its creator's share;
        frees the creator's own lingering arenas where its cap or the budget needs them, and
        lingering arenas of uids past their share where the creator's share does;
        OverBudgetError saying the share and who holds the room otherwise. None for a job
        no hello asked for (recovery): the registry sizes it alone."""
        uid = self.creators.get(name)
        registry = self.registry
        if uid is None or registry is None:
            return None
        share, sharers = self.arena_share(uid)
        # The uid's own lingering arenas are its to give up: no rank of theirs is attached,
        # and a job the engine named (a fresh name every run) is never reattached, so a
        # run restarted after kill -9 would otherwise wait job_linger_s for its own room.
        own = self.lingering_of(uid)
        held = self.arena_nbytes_of(uid) - sum(job.arena.nbytes for job in own)
        within = max(share - held, 0)
        want = self.wanted_nbytes(uid, requested_nbytes, held, share)
        cap = self.limits.max_arena_nbytes_per_uid
        if cap is not None and (held + want > cap or held >= cap):
            raise self.over_budget(uid, name, want, f"uid {uid}'s live jobs hold {held} "
                                   f"bytes of arenas; {want} more would pass "
                                   f"max_arena_nbytes_per_uid ({cap})")
        if want > within and self.others_waiting(uid):
            raise self.over_budget(uid, name, want, f"other uids wait for arena room and uid "
                                   f"{uid}'s jobs hold {held} bytes: {want} more would pass "
                                   f"its fair share of {share} (the {registry.budget_nbytes}-"
                                   f"byte budget divided among {sharers} uids)")
        if cap is not None:
            self.free_lingering(own, uid, share, lambda: self.arena_nbytes_of(uid) + want <= cap)
        others = self.reclaimable_nbytes(uid, share) if want <= within else 0
        if registry.free_nbytes < want <= registry.free_nbytes + others + sum(
                job.arena.nbytes for job in own if self.lingering(job)):
            self.free_lingering(own, uid, share, lambda: registry.free_nbytes >= want)
        if want > registry.free_nbytes and want <= within:
            self.reclaim_for(uid, want, share)
        free = registry.free_nbytes
        if want > free or want <= 0:
            if within > 0 and want <= within:  # room is its due: others keep to their shares
                self.waiting[uid] = time.monotonic() + WAITING_S
            raise self.over_budget(uid, name, want, self.holders(uid, held, share, sharers))
        self.waiting.pop(uid, None)
        return want, free

    def wanted_nbytes(self, uid: int, requested_nbytes: int, held: int, share: int) -> int:
        """The arena a hello asks for; naming no size, its part of the room ``uid`` may take:
        what is free, or up to its share what freeing lingering arenas past theirs would."""
        assert self.registry is not None
        if requested_nbytes:
            return align_up(requested_nbytes)
        free = self.registry.free_nbytes
        room = max(free, min(share - held, free + self.reclaimable_nbytes(uid, share)))
        cap = self.limits.max_arena_nbytes_per_uid
        return self.registry.default_nbytes(room if cap is None else min(room, max(cap - held, 0)))

    def arena_share(self, uid: int) -> tuple[int, int]:
        """(bytes of the DRAM budget that are ``uid``'s share, uids it is divided among)."""
        now = time.monotonic()
        self.waiting = {u: until for u, until in self.waiting.items() if until > now}
        sharers = {uid, *self.creators.values(), *self.waiting}
        sharers.update(u for u in list(self.jobs_by_uid) if self.jobs_of(u))
        budget = self.registry.budget_nbytes if self.registry is not None else 0
        fair = budget // len(sharers)
        cap = self.limits.max_arena_nbytes_per_uid
        return (fair if cap is None else min(fair, cap)), len(sharers)

    def arena_nbytes_of(self, uid: int) -> int:
        """Arena bytes ``uid``'s jobs hold or are being made with."""
        creating = self.registry.creating_nbytes if self.registry is not None else {}
        return (sum(job.arena.nbytes for job in self.jobs_of(uid))
                + sum(creating.get(name, 0) for name in self.creating_of(uid)))

    def others_waiting(self, uid: int) -> bool:
        """Whether a uid other than ``uid`` was refused room within its share lately."""
        now = time.monotonic()
        return any(u != uid and until > now for u, until in self.waiting.items())

    def lingering(self, job: Job) -> bool:
        """No rank attached and none about to: its linger would free it now if it ended."""
        hellos = self.lifecycle.hellos if self.lifecycle is not None else {}
        return (job.num_sessions == 0 and not hellos.get(job.name)
                and job.table.leased_nbytes() == 0 and job.steps_holding == 0
                and self.registry is not None and self.registry.jobs.get(job.name) is job)

    def reclaimable(self, uid: int, share: int) -> list[Job]:
        """Lingering jobs of uids other than ``uid`` holding more than ``share``, the one
        lingering longest first."""
        over = [u for u in list(self.jobs_by_uid) if u != uid and self.arena_nbytes_of(u) > share]
        return self.longest_lingering([job for u in over for job in self.jobs_of(u)])

    def lingering_of(self, uid: int) -> list[Job]:
        """``uid``'s own lingering jobs, the one lingering longest first."""
        return self.longest_lingering(self.jobs_of(uid))

    def longest_lingering(self, jobs: list[Job]) -> list[Job]:
        """The lingering ones of ``jobs``, the one lingering longest first."""
        if self.lifecycle is None:
            return []
        timers = self.lifecycle.timers
        return sorted((job for job in jobs if self.lingering(job)),
                      key=lambda job: timers[job.name].when() if job.name in timers
                      else math.inf)

    def reclaimable_nbytes(self, uid: int, share: int) -> int:
        """Arena bytes ``reclaim_for`` could free for ``uid`` (``reclaimable``)."""
        return sum(job.arena.nbytes for job in self.reclaimable(uid, share))

    def reclaim_for(self, uid: int, want: int, share: int) -> None:
        """Free lingering arenas of uids past ``share`` until ``want`` bytes are free (or
        none is left), as their linger ending would; each owner is re-checked as it shrinks."""
        registry = self.registry
        assert registry is not None
        while registry.free_nbytes < want:
            victims = self.reclaimable(uid, share)
            if not victims:
                return
            self.free_lingering(victims[:1], uid, share, lambda: registry.free_nbytes >= want)

    def free_lingering(self, jobs: list[Job], uid: int, share: int,
                       enough: Callable[[], bool]) -> None:
        """Free ``jobs`` in order, as their linger ending would, until ``enough()``."""
        for job in jobs:
            if enough() or self.lifecycle is None or not self.lingering(job):
                return
            timer = self.lifecycle.timers.pop(job.name, None)
            if timer is not None:
                timer.cancel()
            log.info("event=arena_reclaimed job=%s owner=%s for_uid=%d arena_nbytes=%d "
                     "share_nbytes=%d", job.name, job.owner_uid, uid, job.arena.nbytes, share)
            self.lifecycle.free(job)

    def holders(self, uid: int, held: int, share: int, sharers: int) -> str:
        """Who holds the budget, by counts (never another user's job names)."""
        assert self.registry is not None
        others = [u for u in list(self.jobs_by_uid) if u != uid and self.jobs_of(u)]
        jobs = [job for u in others for job in self.jobs_of(u)]
        lingering = sum(1 for job in jobs if self.lingering(job))
        how = ("max_arena_nbytes_per_uid" if self.limits.max_arena_nbytes_per_uid is not None
               and share == self.limits.max_arena_nbytes_per_uid else
               f"the {self.registry.budget_nbytes}-byte budget divided among {sharers} uids")
        return (f"uid {uid} holds {held} bytes, its share is {share} ({how}); "
                f"{len(others)} other uids hold {sum(j.arena.nbytes for j in jobs)} bytes in "
                f"{len(jobs)} jobs, {lingering} of them lingering (no rank attached)")

    def over_budget(self, uid: int, name: str, want: int, why: str) -> OverBudgetError:
        """The refusal of new job ``name``'s arena (counted as max_arena_nbytes_per_uid)."""
        assert self.registry is not None
        self.rejections.add(("max_arena_nbytes_per_uid",))
        free = self.registry.free_nbytes
        asks = f"a {want}-byte arena" if want > 0 else "an arena (no size named)"
        return OverBudgetError(
            f"job {name!r} asks for {asks}; {free} of the daemon's "
            f"{self.registry.budget_nbytes}-byte budget{self.registry.budget_note} is free "
            f"and {why}; ask for "
            "less (arena_nbytes at hello), end your own jobs (close_job), or try again when "
            "other jobs end (max_arena_nbytes_per_uid, arena_size in the daemon config)")

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

    def replies_changed(self, uid: int, delta: int) -> bool:
        """Reply bytes buffered for ``uid`` (written, not yet read by its client) changed by
        ``delta``: charged whatever the total, since they are already written. Returns
        whether the uid's buffered bytes now pass ``max_pending_nbytes_per_uid``."""
        total = self.pending_by_uid[uid] + delta
        if total:
            self.pending_by_uid[uid] = total
        else:
            self.pending_by_uid.pop(uid, None)
        return total > self.limits.max_pending_nbytes_per_uid

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


def metadata_limit(max_metadata_nbytes: int, arena_nbytes: int) -> int:
    """Shard metadata bytes a uid whose arenas hold ``arena_nbytes`` may keep in the daemon."""
    scaled = METADATA_FLOOR_NBYTES + arena_nbytes // ARENA_NBYTES_PER_METADATA_NBYTE
    return min(max_metadata_nbytes, scaled)


def fd_reserve(nofile: int) -> int:
    """Descriptors kept for the daemon itself out of an RLIMIT_NOFILE of ``nofile``."""
    return max(FD_RESERVE_MIN, nofile // FD_RESERVE_FRACTION)


def nofile_limit() -> int:
    """The daemon's soft RLIMIT_NOFILE as it is now (an operator's prlimit included)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):
            pass
    return nofile_limit()
