"""The node's jobs and the DRAM they share: the registry makes each job's arena on its
first hello, within the daemon's budget (``arena_size``), the creator's share of it
(``ArenaAdmission``) and what the node can still pin (``offloadd.memory.node``)."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
from collections.abc import Callable
from typing import Protocol

from offloadd.config import HugePages, Prefault
from offloadd.errors import LimitExceededError, OverBudgetError
from offloadd.memory.arena import HUGE_PAGE_NBYTES, Arena, align_up, free_huge_pages
from offloadd.memory.node import NodeMemory, node_memory
from offloadd.service.jobs import Job, SwapTier


class ArenaAdmission(Protocol):
    """Who may take how much of the DRAM budget (``offloadd.service.limits.LimitGuard``): the
    registry knows the jobs and the budget, not the uids asking for arenas."""

    def size_new(self, name: str, requested_nbytes: int) -> tuple[int, int] | None:
        """(arena bytes for new job ``name``, budget bytes free) as its creator's share allows,
        having freed other uids' lingering arenas where that share needs them; raise
        OverBudgetError past it; None where nobody asked for ``name`` (the registry's own
        sizing applies)."""
        ...

    def creation_ended(self, name: str, job: Job | None) -> None:
        """The arena of ``name`` was made (``job``) or will not be (None)."""
        ...

    def out_of_fds(self, name: str, exc: OSError) -> LimitExceededError:
        """The error for a new job that found no descriptor left (EMFILE/ENFILE)."""
        ...


FD_EXHAUSTED = (errno.EMFILE, errno.ENFILE)
"""Errnos of an open() that found no descriptor: the process's or the system's limit."""


def node_budget(arena_size: int) -> tuple[int, NodeMemory | None]:
    """The DRAM budget arenas share: ``arena_size``, cut to what the node can pin at all
    (in 2 MiB units); second value: the node's memory where it cut, else None.

    Cut once, at start: fair shares are the budget divided among uids, and a share of a
    budget past the node's memory would let one uid take all of it."""
    memory = node_memory()
    ceiling = memory.pinnable_nbytes // HUGE_PAGE_NBYTES * HUGE_PAGE_NBYTES
    return (arena_size, None) if arena_size <= ceiling else (ceiling, memory)


class JobRegistry:
    """Every job on the node, and the node-wide DRAM budget they share."""

    def __init__(self, budget_nbytes: int, share: float, *, lock: bool = True,
                 hugepages: HugePages = "off", prefault: Prefault = "now",
                 prefault_rate: int = 0, prefault_threads: int = 0) -> None:
        self.budget_nbytes = budget_nbytes
        self.budget_note = ""
        """Why the budget is less than arena_size, for refusals (``cut_to_node``)."""
        self.share = share
        self.lock = lock
        self.hugepages = hugepages
        self.prefault: Prefault = prefault
        self.prefault_rate = prefault_rate
        self.prefault_threads = prefault_threads
        self.jobs: dict[str, Job] = {}
        self.creating: dict[str, asyncio.Task[Job]] = {}
        """Arenas being made off the loop, by job name; every hello of that job awaits it."""
        self.creating_nbytes: dict[str, int] = {}
        """Bytes of the arenas being made, by job name (reserved against the budget)."""
        self.admission: ArenaAdmission | None = None
        """Sizes new arenas by their creator's share (set by the daemon's LimitGuard)."""

    def cut_to_node(self, arena_size: int, memory: NodeMemory) -> None:
        """Note that the budget is ``arena_size`` cut to what ``memory`` can pin."""
        self.budget_note = (
            f" (arena_size {arena_size} cut to what this node can pin: {memory.total_nbytes} "
            f"bytes ({memory.source('MemTotal')}) less {memory.kept_nbytes} kept for the "
            "system; past it, put the state on NVMe: offload_optimizer.device \"nvme\")")

    @property
    def reserved_nbytes(self) -> int:
        made = sum(job.arena.nbytes for job in self.jobs.values())
        return made + sum(self.creating_nbytes.values())

    def open(self, name: str, requested_nbytes: int,
             make_tier: Callable[[], SwapTier] | None = None) -> tuple[Job, bool]:
        """Return the job, creating its arena on first hello; second value: created."""
        job = self.jobs.get(name)
        if job is not None:
            return job, False
        try:
            nbytes, free = self._size_new(name, requested_nbytes)
            job = self._make_job(name, nbytes, free, make_tier)
        except BaseException:
            self._creation_ended(name, None)
            raise
        self.jobs[name] = job
        self._creation_ended(name, job)
        return job, True

    async def open_async(self, name: str, requested_nbytes: int,
                         make_tier: Callable[[], SwapTier] | None = None,
                         on_created: Callable[[Job], None] | None = None) -> Job:
        """``open`` with the arena made on an executor thread.

        Backing an arena takes seconds per 10 GB; with ``prefault="background"`` it
        happens after the hello (offloadd.memory.arena), but "now" does it here, and opening the
        job's swap tier touches files: neither may stall other jobs' requests (or the
        systemd watchdog). Its bytes stay reserved against the budget while it is made,
        and concurrent hellos of the job share one creation, which no cancelled hello stops;
        ``on_created`` gets the job once it is made, whether or not a hello is left to.
        """
        job = self.jobs.get(name)
        if job is not None:
            return job
        creating = self.creating.get(name)
        if creating is None:
            try:
                nbytes, free = self._size_new(name, requested_nbytes)
            except BaseException:
                self._creation_ended(name, None)
                raise
            self.creating_nbytes[name] = nbytes
            creating = self.creating[name] = asyncio.ensure_future(
                self._create(name, nbytes, free, make_tier, on_created))
        return await asyncio.shield(creating)

    async def _create(self, name: str, nbytes: int, free: int,
                      make_tier: Callable[[], SwapTier] | None,
                      on_created: Callable[[Job], None] | None) -> Job:
        job: Job | None = None
        try:
            arena = await asyncio.get_running_loop().run_in_executor(
                None, self._make_arena, name, nbytes, free)
            job = self.jobs[name] = Job(name, arena, self._make_tier(name, arena, make_tier))
            self._creation_ended(name, job)
            if on_created is not None:
                on_created(job)
            return job
        finally:
            del self.creating[name], self.creating_nbytes[name]
            if job is None:
                self._creation_ended(name, None)

    def _make_job(self, name: str, nbytes: int, free: int,
                  make_tier: Callable[[], SwapTier] | None) -> Job:
        arena = self._make_arena(name, nbytes, free)
        return Job(name, arena, self._make_tier(name, arena, make_tier))

    def _make_tier(self, name: str, arena: Arena,
                   make_tier: Callable[[], SwapTier] | None) -> SwapTier | None:
        try:
            return make_tier() if make_tier is not None else None
        except OSError as exc:
            arena.close()
            if exc.errno in FD_EXHAUSTED:
                raise self._out_of_fds(name, exc) from exc
            raise
        except BaseException:
            arena.close()
            raise

    def _make_arena(self, name: str, nbytes: int, free: int) -> Arena:
        try:
            return Arena(name, nbytes, lock=self.lock, hugepages=self.hugepages,
                         max_nbytes=free, prefault=self.prefault,
                         prefault_rate=self.prefault_rate,
                         prefault_threads=self.prefault_threads)
        except OSError as exc:
            if exc.errno in FD_EXHAUSTED:
                raise self._out_of_fds(name, exc) from exc
            raise

    def _out_of_fds(self, name: str, exc: OSError) -> LimitExceededError:
        if self.admission is not None:
            return self.admission.out_of_fds(name, exc)
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return LimitExceededError(
            f"the daemon has no file descriptor left for job {name!r} ({exc.strerror}; its "
            f"RLIMIT_NOFILE is {soft}); try again once jobs end, or raise the daemon's "
            "LimitNOFILE")

    def _creation_ended(self, name: str, job: Job | None) -> None:
        if self.admission is not None:
            self.admission.creation_ended(name, job)

    def _size_new(self, name: str, requested_nbytes: int) -> tuple[int, int]:
        """(arena bytes for a new job, budget bytes free now); OverBudgetError if none fit,
        in the budget or in the node's memory."""
        sized = self.admission.size_new(name, requested_nbytes) \
            if self.admission is not None else None
        if sized is None:
            free = self.free_nbytes
            nbytes = align_up(requested_nbytes) if requested_nbytes else self.default_nbytes(free)
            if nbytes > free or nbytes <= 0:
                raise OverBudgetError(
                    f"job {name!r} asks for a {requested_nbytes or nbytes}-byte arena but only "
                    f"{free} of the daemon's {self.budget_nbytes}-byte budget"
                    f"{self.budget_note} is free; ask for less or raise --arena-size")
            sized = nbytes, free
        return self._within_node_memory(name, requested_nbytes, *sized)

    def _within_node_memory(self, name: str, requested_nbytes: int, nbytes: int,
                            free: int) -> tuple[int, int]:
        """The sized arena checked against what the node can still pin (an arena named
        without a size gets its share of that instead); OverBudgetError past it.

        ``arena_size`` is a budget someone typed, maybe past the node's RAM (a shared
        config on a smaller node, a typo): arena pages are pinned shared memory, so an
        arena past what the node holds would end in the OOM killer, not in slow paging.
        """
        if self.hugepages != "off" and \
                free_huge_pages() * HUGE_PAGE_NBYTES >= align_up(nbytes, HUGE_PAGE_NBYTES):
            return nbytes, free  # from the reserved pool, which MemAvailable leaves out
        memory = node_memory()
        pending = self.pending_backing_nbytes(name)
        room = memory.room_nbytes - pending
        if not requested_nbytes and nbytes > room > 0:
            nbytes = self.default_nbytes(room)
        if nbytes <= room:
            return nbytes, free
        raise OverBudgetError(
            f"job {name!r} asks for a {nbytes}-byte arena but this node can pin only "
            f"{max(room, 0)} more bytes: {memory.available_nbytes} available "
            f"({memory.source('MemAvailable')}), less {pending} that other arenas will still "
            f"take and {memory.kept_nbytes} kept for the system; "
            "ask for less (arena_nbytes at hello), put the state on NVMe "
            "(offload_optimizer.device \"nvme\"), or free memory on the node")

    def pending_backing_nbytes(self, creator: str) -> int:
        """Bytes the node's arenas will still take from its memory: the pages of made
        arenas not allocated yet (being backed, or left to first touch) and the arenas
        being made for jobs other than ``creator``. hugetlb arenas take none (their pool
        was reserved at mmap)."""
        pending = sum(nbytes for job, nbytes in self.creating_nbytes.items() if job != creator)
        for job in self.jobs.values():
            if not job.arena.hugepages:
                try:
                    allocated = os.fstat(job.arena.fd).st_blocks * 512
                except OSError:  # closed meanwhile: it takes nothing more
                    continue
                pending += max(0, job.arena.nbytes - allocated)
        return pending

    @property
    def free_nbytes(self) -> int:
        """Budget bytes no arena holds or is being made with."""
        return self.budget_nbytes - self.reserved_nbytes

    def default_nbytes(self, room: int) -> int:
        """The arena of a hello that names no size, out of ``room`` bytes it may take."""
        return min(align_up(int(room * self.share)), room // 4096 * 4096)

    def close_job(self, name: str) -> None:
        job = self.jobs.pop(name)
        job.arena.close()

    def close(self) -> None:
        for name in list(self.jobs):
            self.close_job(name)
