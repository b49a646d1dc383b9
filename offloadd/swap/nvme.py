"""The NVMe tier: swap files per job and drive, chunked checksummed IO, eviction, flush.

Layout on disk, per swap dir (one per drive)::

    <swap_dir>/offloadd/<job>/swap.0          preallocated, grown in segments
    <swap_dir>/offloadd/<job>/manifest.json   (first swap dir only) the last flush

A shard's swap copy is a list of chunks (``chunk_size`` each) striped over
the swap dirs, each with an xxh3 checksum verified on every read. Writes
are copy-on-write: a new version goes to new extents, and the extents the
last manifest names are freed only after the next manifest replaces it, so
a crash at any point leaves the last flush intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from offloadd.errors import (
    JobQuarantinedError,
    LimitExceededError,
    OffloadError,
    OverBudgetError,
    ShardExistsError,
    SwapIOError,
)
from offloadd.memory.arena import Allocator, align_up
from offloadd.memory.shards import Chunk, ShardTable
from offloadd.metrics import JOB_LABEL, Counters, Histogram, gauge, histogram_family
from offloadd.swap.bounce import BouncePool, transparent_huge_pages
from offloadd.swap.ioengine import IOEngineError, VolatileCacheEngine, open_engine
from offloadd.swap.manifests import (
    has_manifest,
    jobs_with_manifests,
    manifest_ended_at,
    manifest_flushed_at,
    manifest_owner,
    read_job_manifest,
)
from offloadd.swap.retention import (
    SWAP_FILE,
    SwapRetention,
    end_job_files,
    shrink_kept_files,
)
from offloadd.swap.scheduler import IOQueue, IOTicket, Priority
from offloadd.swap.swapdirs import (
    FILE_FLAGS,
    SwapDir,
    lock_swap_dir,
    open_private_subdir,
    remove_job_dir,
    unlock_swap_dir,
)

if TYPE_CHECKING:
    from offloadd.config import DaemonConfig
    from offloadd.metrics import DaemonMetrics

log = logging.getLogger(__name__)


class JobOpener(Protocol):
    """The job registry as recovery uses it (``offloadd.service.registry.JobRegistry``): the swap
    space sits below the jobs, so it names what it needs instead of importing them."""

    def open(self, name: str, requested_nbytes: int,
             make_tier: Callable[[], Any] | None = None) -> tuple[Any, bool]: ...

    def close_job(self, name: str) -> None: ...

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
"""2: chunk checksums bound to their place, and the job's owner recorded; 1 is still read."""
READABLE_FORMATS = (1, 2)
DISABLE_BOUNCE_ENV = "OFFLOADD_DISABLE_SWAP_BOUNCE"
"""Set to 1 to do O_DIRECT swap IO of 4 KiB-page arenas in place, unstaged (A/B benchmarks)."""
POWER_LOSS_FAULT = "power_loss"
"""``OFFLOADD_IO_FAULT=power_loss``: writes stay in a volatile cache until synced (tests)."""
SEGMENT_NBYTES = 256 << 20
"""A job's swap file grows by at least this much at a time (one fallocate)."""
PREFETCH_HORIZON_S = 5.0
"""How far ahead in predicted time the learned prefetch reads."""


class JobFile:
    """One job's swap file on one swap dir, with an extent allocator inside it."""

    def __init__(self, swap_dir: SwapDir, job: str, *, existing: bool,
                 before_grow: Callable[[JobFile, int], Awaitable[int | None]] | None = None,
                 when_full: Callable[[JobFile], Awaitable[bool]] | None = None) -> None:
        self.dir = swap_dir
        self.job = job
        self.before_grow = before_grow
        """Called before the file grows by at least ``need`` bytes; may free room (ended
        jobs' files) and returns the bytes the owner may still add (None: no cap)."""
        self.when_full = when_full
        """Called when the file system has no room for even ``need`` bytes: deletes an
        ended job's kept files there (True) or finds none to delete (False)."""
        self.path = swap_dir.root / job / SWAP_FILE
        self.dir_fd = open_private_subdir(swap_dir.root_fd, job, self.path.parent)
        """The job's dir, checked: manifests are written relative to it."""
        flags = os.O_RDWR | os.O_CREAT | FILE_FLAGS | (os.O_DIRECT if swap_dir.direct else 0)
        try:
            self.fd = os.open(self.path.name, flags, 0o600, dir_fd=self.dir_fd)
        except BaseException:
            os.close(self.dir_fd)
            raise
        size = os.fstat(self.fd).st_size if existing else 0
        if not existing:
            os.ftruncate(self.fd, 0)
        self.allocator = Allocator(size // 4096 * 4096)
        swap_dir.reserved_nbytes += self.allocator.capacity
        self._grow_lock = asyncio.Lock()

    async def alloc(self, nbytes: int) -> int:
        offset = self.allocator.alloc(nbytes)
        while offset is None:
            async with self._grow_lock:
                offset = self.allocator.alloc(nbytes)
                if offset is None:
                    await self._grow(align_up(nbytes))
                    offset = self.allocator.alloc(nbytes)
        return offset

    async def _grow(self, need: int) -> None:
        """Grow by a segment, or by less when the budget or the file system is nearly full.

        Segments keep the file in few large extents; but a dir with less than one
        segment left must still be usable up to its last byte, so the growth
        shrinks to what the budget allows and, on ENOSPC, to exactly ``need``.
        """
        swap_dir = self.dir
        owner_room = await self.before_grow(self, need) if self.before_grow else None
        room = swap_dir.budget_nbytes - swap_dir.reserved_nbytes
        if need > room:
            # Copy-on-write: until the next flush retires them, the extents of the last
            # flushed version stay reserved beside the new one, so a job can need up to
            # twice its swapped bytes (README "Swap space").
            raise OverBudgetError(
                f"swap dir {swap_dir.path} would exceed its {swap_dir.budget_nbytes}-byte budget "
                f"(--swap-size): {need} more bytes needed, {max(room, 0)} left; set --swap-size "
                f"to at least {swap_dir.reserved_nbytes + need} bytes (copy-on-write keeps the "
                "last flushed version beside the new one), add a --swap-dir, or drop shards")
        # A quarter of the room at most: one job's segment must not take a tight
        # budget that other jobs share.
        add = max(need, min(SEGMENT_NBYTES, room // 4) // 4096 * 4096)
        if owner_room is not None:
            add = max(need, min(add, owner_room // 4096 * 4096))
        add = await self._fallocate_what_fits(add, need)
        swap_dir.reserved_nbytes += add
        self.allocator.grow(self.allocator.capacity + add)

    async def _fallocate_what_fits(self, add: int, need: int) -> int:
        """Allocate ``add`` bytes, or on ENOSPC ``need``; while even that does not fit,
        ended jobs' kept files in this dir go first (oldest first): a live job's write
        fails only once there are none left. Returns the bytes added."""
        while True:
            try:
                await self._fallocate(add)
                return add
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise self._grow_error(exc, add) from exc
                if add > need:
                    add = need
                elif self.when_full is None or not await self.when_full(self):
                    raise self._grow_error(exc, add) from exc

    async def _fallocate(self, add: int) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, os.posix_fallocate, self.fd, self.allocator.capacity, add)

    def _grow_error(self, exc: OSError, add: int) -> SwapIOError:
        reason = "is full" if exc.errno == errno.ENOSPC else f"failed: {exc.strerror}"
        return SwapIOError(f"swap dir {self.dir.path} {reason} (growing {self.path} by {add} "
                           "bytes); free space there, add a --swap-dir, or drop shards")

    def free(self, chunk: Chunk) -> None:
        self.allocator.free(chunk.offset, chunk.nbytes)

    def close(self) -> None:
        for fd in (self.fd, self.dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class SwapCounters:
    io_seconds: dict[str, Histogram] = field(
        default_factory=lambda: {"read": Histogram(), "write": Histogram()})
    io_errors: Counters = field(default_factory=lambda: Counters(
        "offloadd_swap_io_errors", "Swap IO requests that failed.", ["op"]))
    evictions: Counters = field(default_factory=lambda: Counters(
        "offloadd_evictions", "Shards evicted from the arena, by reason.", ["reason"]))
    flushes: Counters = field(default_factory=lambda: Counters(
        "offloadd_flushes", "Flush requests, by status.", ["status"]))
    stall_seconds: Counters = field(default_factory=lambda: Counters(
        "offloadd_rank_stall_seconds", "Time rank requests waited for swap IO.",
        [JOB_LABEL, "rank"]))
    kind_nbytes: Counters = field(default_factory=lambda: Counters(
        "offloadd_swap_shard_bytes", "Bytes of shard copies read from or written to swap, by "
        "op and shard kind (the id's suffix: param, grad, master, exp_avg, exp_avg_sq, other).",
        ["op", "kind"]))
    writeback_nbytes: int = 0
    reread_nbytes: int = 0
    """Bytes of swap copies read into the arena again (one version read twice)."""
    writeback_unneeded_nbytes: int = 0
    """Bytes of write-backs superseded or dropped before anything relied on them."""
    clean_writeback_nbytes: int = 0
    """Bytes written back whose swap copy already held that version (a write for nothing)."""
    prefetch_issued: int = 0
    prefetch_hits: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    demand_reads: int = 0
    checksum_failures: int = 0


class SwapSpace:
    """The daemon-wide NVMe tier: swap dirs, the IO engine, and one JobTier per job."""

    def __init__(self, config: DaemonConfig, metrics: DaemonMetrics, *,
                 owner_of: Callable[[str], int | None] = lambda _job: None,
                 reject: Callable[[str, str], OffloadError] | None = None) -> None:
        self.config = config
        self.owner_of = owner_of
        """The uid a live job's swap counts against (None: nobody's yet)."""
        self.reject = reject or (lambda knob, message: OverBudgetError(f"{message} ({knob})"))
        self.dirs = [SwapDir(i, Path(p).resolve(), config.swap_size)
                     for i, p in enumerate(config.swap_dirs)]
        self.counters = SwapCounters()
        self.queue = IOQueue(config.io_queue_depth)
        threads = config.resolved_hash_threads()
        self.hash_pool = (ThreadPoolExecutor(threads, thread_name_prefix="offloadd-hash")
                          if threads else None)
        self.engine: Any = None
        self.sync_fault_nth = 0
        """Test hook: fail the nth fdatasync (0: never)."""
        self.tiers: dict[str, Any] = {}
        self.created: set[str] = set()
        """Jobs whose swap files this daemon created (not recovered ones)."""
        self.lock_fds: list[int] = []
        self.quarantined: dict[str, str] = {}
        """Jobs whose manifest could not be recovered -> why (shown by status)."""
        self.tickets: dict[asyncio.Future[None], IOTicket] = {}
        """IO tickets of the residency transitions in flight, by the shard's io future."""
        self.bounce: BouncePool | None = None
        """Staging slots for O_DIRECT IO of 4 KiB-page arenas (``offloadd.swap.bounce``);
        None when ``OFFLOADD_DISABLE_SWAP_BOUNCE`` is set."""
        self.bounce_prefault: asyncio.Future[None] | None = None
        """The bounce slots being backed ahead of the first swap-out (``stage_ahead``)."""
        self.copy_pool: ThreadPoolExecutor | None = None
        """Where bounce copies run: the hash threads, or one or two threads of their own
        without them (a copy on the loop would stall it ~1 ms a chunk)."""
        self.retention = SwapRetention(self.dirs, config.flushed_job_retention_s)
        metrics.sources.append(self.families)

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        for swap_dir in self.dirs:
            await loop.run_in_executor(None, swap_dir.prepare)
            self.lock_fds.append(lock_swap_dir(swap_dir.root_fd, swap_dir.root))
        if os.environ.get(DISABLE_BOUNCE_ENV, "") in ("", "0"):
            self.bounce = BouncePool(self.config.io_queue_depth, self.config.chunk_size)
            self.copy_pool = self.hash_pool or ThreadPoolExecutor(
                min(2, max(1, (os.cpu_count() or 1) // 2)), thread_name_prefix="offloadd-bounce")
        fault = os.environ.get("OFFLOADD_IO_FAULT", "")  # test hook: "read:3" fails the 3rd read
        if fault == POWER_LOSS_FAULT:
            self.engine = VolatileCacheEngine()
        else:
            self.engine = open_engine(self.config.io_engine,
                                      queue_depth=self.config.io_queue_depth)
        if fault and fault != POWER_LOSS_FAULT:
            op, _, nth = fault.partition(":")
            if op == "sync":  # "sync:2": the 2nd fdatasync fails with EIO
                self.sync_fault_nth = int(nth or 1)
            else:
                self.engine.inject_fault(nth=int(nth or 1), op=op)
        log.info("event=swap_ready dirs=%s engine=%s direct=%s bounce=%s thp=%s",
                 [str(d.path) for d in self.dirs], getattr(self.engine, "kind", self.engine.name),
                 [d.direct for d in self.dirs], self.bounce is not None,
                 transparent_huge_pages() or "unknown")

    def stage_ahead(self, table: ShardTable) -> None:
        """Back the bounce slots in the background once a job's shards outgrow its arena
        (its swap IO is then certain) if they will carry that IO: its arena is on 4 KiB
        pages and a swap dir takes O_DIRECT. Not where arenas are left to their first
        touch (``arena_prefault`` "lazy"), and once per daemon.

        Left to the first swap-outs, the slots' huge pages were faulted in by their
        copies: up to a second of a fresh daemon's first write-backs on the 2-core VM
        (bench/README.md, eighth session)."""
        if (self.bounce is None or self.bounce_prefault is not None
                or self.config.arena_prefault == "lazy" or table.arena.hugepages
                or not table.overcommitted() or not any(d.direct for d in self.dirs)):
            return
        self.bounce_prefault = asyncio.ensure_future(self.bounce.prefault(self.copy_pool))

    def job_files(self, job: str, *, recovering: bool = False) -> list[JobFile]:
        """Open (or, ``recovering``, reopen) a job's file in every swap dir.

        The caller (``offloadd.swap.tier.open_tier``) wraps them in the job's tier and
        registers it with ``adopt``: the swap space sits below the tier.
        """
        if job in self.quarantined:
            raise JobQuarantinedError(self.quarantined[job])
        if not recovering:
            stale = [d.job_dir(job) for d in self.dirs
                     if d.job_dir(job).exists() and any(d.job_dir(job).iterdir())]
            if stale:
                raise ShardExistsError(
                    f"swap files of an earlier job {job!r} exist in {stale[0]}; restart the daemon "
                    "with --recover to restore them, or reclaim them with `offloadd gc`")
        return [JobFile(d, job, existing=recovering, before_grow=self.before_grow,
                        when_full=self.reclaim_for_disk) for d in self.dirs]

    async def before_grow(self, jobfile: JobFile, need: int) -> int | None:
        """Room for ``need`` more bytes in ``jobfile``: the owner's cap first, then the dir's
        budget, each reclaiming ended jobs' files (oldest first) before it refuses."""
        retention, cap = self.retention, self.config.max_swap_nbytes_per_uid
        uid = self.owner_of(jobfile.job)
        if uid is not None and cap is not None:
            while (used := self.uid_nbytes(uid)) + need > cap:
                if not await retention.reclaim_oldest(lambda r: r.uid == uid, "owner_cap"):
                    raise self.reject("max_swap_nbytes_per_uid", (
                        f"uid {uid}'s jobs hold {used} bytes of swap files (ended, flushed jobs "
                        f"included); growing {jobfile.path} by {need} would pass {cap}; drop "
                        "shards or end jobs"))
        swap_dir = jobfile.dir
        while swap_dir.budget_nbytes - swap_dir.reserved_nbytes < need:
            if not await retention.reclaim_oldest(
                    lambda r: swap_dir.index in r.nbytes_by_dir, "dir_full"):
                break
        return None if uid is None or cap is None else cap - self.uid_nbytes(uid)

    async def reclaim_for_disk(self, jobfile: JobFile) -> bool:
        """The file system of ``jobfile``'s dir is full: delete the oldest kept job there."""
        index = jobfile.dir.index
        return await self.retention.reclaim_oldest(
            lambda r: index in r.nbytes_by_dir and r.job != jobfile.job, "disk_full")

    def uid_nbytes(self, uid: int) -> int:
        """Swap file bytes of ``uid``: its live jobs' files and its ended jobs' kept ones."""
        live = sum(jobfile.allocator.capacity for name, tier in self.tiers.items()
                   if self.owner_of(name) == uid for jobfile in tier.files)
        return live + self.retention.uid_nbytes(uid)

    def adopt(self, job: str, tier: Any, *, recovering: bool) -> None:
        self.tiers[job] = tier
        if not recovering:
            self.created.add(job)

    async def release_job(self, job: str, *, keep_flushed: bool = False,
                          owner_uid: int | None = None) -> int:
        """Give a job's swap space back: close its files and delete them in every swap dir.

        Call once the job has no sessions and left the registry (``JobRegistry.close_job``):
        it ended, was dropped, or the daemon stops.
        ``keep_flushed`` keeps the files of a job that has a manifest, so its owner can
        resume from its last flush (``claim``, or after a restart with ``--recover``):
        its manifest is marked ended and its files cut to what it names, and they stay
        counted against their owner and their dirs until ``offloadd.swap.retention``
        reclaims them. Returns the bytes freed.
        """
        tier = None
        if job in self.tiers:
            tier = await self.close_tier(job)  # files closed and budget returned in every case
        stalls = self.counters.stall_seconds.values  # an ended job's series end with it
        for labels in [labels for labels in stalls if labels[0] == job]:
            del stalls[labels]
        if keep_flushed and has_manifest(self.dirs[0].job_dir(job)):
            sizes = {f.dir.index: f.allocator.capacity for f in tier.files} if tier else {}
            await self._retain_ended(job, owner_uid, sizes)
            return 0
        self.created.discard(job)
        loop = asyncio.get_running_loop()
        freed = 0
        for swap_dir in self.dirs:
            freed += await loop.run_in_executor(None, remove_job_dir, swap_dir.root_fd,
                                                swap_dir.job_dir(job))
        log.info("event=swap_released job=%s freed_nbytes=%d", job, freed)
        return freed

    async def _retain_ended(self, job: str, owner_uid: int | None,
                            sizes: dict[int, int]) -> None:
        """Keep an ended job's files (listed and counted at once), mark its manifest ended
        and cut its files to what the manifest names (see release_job)."""
        loop, ended_at = asyncio.get_running_loop(), time.time()
        self.retention.keep(job, None, sizes, ended_at=ended_at, uid=owner_uid, settling=True)
        try:
            owner, kept = await loop.run_in_executor(None, end_job_files, self.dirs, job,
                                                     ended_at)
        except Exception as exc:  # unreadable manifests: what is on disk stays for gc
            self.retention.claim(job, "unreadable")
            log.error("event=swap_retain_failed job=%s error=%r", job, str(exc))
            self.quarantine(job, self.dirs[0].job_dir(job), exc)
            return
        self.retention.settle(job, owner, kept)

    def quarantine(self, name: str, job_dir: Path, exc: BaseException) -> None:
        self.quarantined[name] = (
            f"job {name!r} is quarantined: its manifest in {job_dir} could not be "
            f"recovered ({exc}); its swap files are kept. Restart with the swap dirs "
            "it was flushed with, or reclaim it with `offloadd gc`")
        log.error("event=job_quarantined job=%s error=%r", name, str(exc))

    async def recover(self, registry: JobOpener, open_tier: Callable[[str], Any]) -> list[str]:
        """Bring back the jobs that were live when the daemon stopped; keep ended ones as
        files for their owners (``offloadd.swap.retention``). Returns the recovered names.

        Live jobs take the DRAM budget in ``recovery_order`` (no ended job, and no name,
        decides who gets it); one that finds no room is kept as files for its owner to
        claim, never quarantined. A job whose manifest is bad is quarantined (logged, in
        status, refused at hello). Whatever a manifest holds costs its job only: any
        exception while one is read or loaded (deep nesting is a RecursionError, odd types
        an AttributeError) quarantines it.
        """
        live: list[tuple[str, dict[str, Any]]] = []
        for job_dir in jobs_with_manifests(self.dirs[0].root):
            name = job_dir.name
            try:
                manifest = read_job_manifest(job_dir, self.dirs[0].root_fd)
                ended_at = manifest_ended_at(manifest)
                owner = manifest_owner(manifest)
                if ended_at is not None:
                    await self._keep_from_disk(name, owner, ended_at, "ended before the restart")
                else:
                    live.append((name, manifest))
            except Exception as exc:
                self.quarantine(name, job_dir, exc)
        recovered = []
        for name, manifest in recovery_order(live):
            try:
                count = await self._recover_job(registry, name, manifest,
                                                functools.partial(open_tier, name))
            except (OverBudgetError, LimitExceededError) as exc:  # no room: its files wait
                log.warning("event=job_not_recovered job=%s error=%r", name, exc.message)
                await self._keep_from_disk(name, manifest_owner(manifest), None,
                                           f"no room at the restart: {exc.message}")
                continue
            except Exception as exc:
                self.quarantine(name, self.dirs[0].job_dir(name), exc)
                continue
            recovered.append(name)
            log.info("event=job_recovered job=%s shards=%d tag=%s", name, count, manifest["tag"])
        return recovered

    async def _keep_from_disk(self, name: str, owner: Any, ended_at: float | None,
                              note: str) -> None:
        loop = asyncio.get_running_loop()
        kept = await loop.run_in_executor(None, shrink_kept_files, self.dirs, name)
        self.retention.keep(name, owner, kept, ended_at=ended_at, note=note)

    async def _recover_job(self, registry: JobOpener, name: str, manifest: dict[str, Any],
                           make_tier: Callable[[], Any]) -> int:
        job, _created = registry.open(name, manifest["arena_nbytes"], make_tier=make_tier)
        assert job.tier is not None
        try:
            return job.tier.load_manifest(job.table, manifest)
        except BaseException:
            registry.close_job(name)
            await self.close_tier(name)
            raise

    async def close_tier(self, job: str) -> Any:
        """Close a job's files and return their budget; the files stay on disk."""
        tier = self.tiers.pop(job)
        await tier.quiesce()
        await tier.close()
        for jobfile in tier.files:
            jobfile.dir.reserved_nbytes -= jobfile.allocator.capacity
            if self.engine is not None:
                self.engine.forget_fd(jobfile.fd)
        return tier

    def ticket_for(self, transition: asyncio.Future[None] | None, priority: Priority
                   ) -> IOTicket | None:
        """The ticket of a shard's transition (its ``io`` future), made on first use."""
        if transition is None:
            return None
        ticket = self.tickets.get(transition)
        if ticket is None:
            ticket = self.tickets[transition] = IOTicket(priority)
            transition.add_done_callback(self.tickets.pop)
        return ticket

    def hurry(self, transition: asyncio.Future[None] | None, priority: Priority) -> None:
        """Someone at ``priority`` waits for this transition: its queued IO runs as they would."""
        ticket = self.ticket_for(transition, priority)
        if ticket is None or ticket.priority <= priority:
            return  # nothing in flight, already as urgent, or queued from now on at priority
        ticket.priority = priority
        self.queue.raise_priority(ticket, priority)
        for future in ticket.in_engine:
            self.engine.raise_priority(future, int(priority))

    async def io(self, op: str, jobfile: JobFile, offset: int, view: memoryview,
                 priority: Priority, ticket: IOTicket | None = None, *,
                 in_place: bool = False, seed: int | None = None) -> int | None:
        """Read into or write from ``view`` at ``offset`` of ``jobfile``, queued by priority;
        returns the xxh3 checksum seeded with ``seed`` of the bytes moved (None: no seed).

        ``in_place``: ``view`` is on huge pages (a hugetlb arena) and goes to the kernel
        as it is; otherwise an O_DIRECT transfer is staged through a bounce slot
        (``offloadd.swap.bounce``), and the checksum is taken as the slot is copied.
        """
        staged = not in_place and self.bounce is not None and jobfile.dir.direct
        # Buffered IO copies through the page cache anyway; huge pages need no slot.
        checksum = None
        if seed is not None and op == "write" and not staged:
            checksum = await self.checksum(view, seed)
        await self.queue.enter(priority, ticket)
        if ticket is not None:
            priority = min(priority, ticket.priority)
        started = time.perf_counter()
        try:
            if staged:
                checksum = await self._staged(op, jobfile, offset, view, priority, ticket, seed)
            else:
                await self._submit(op, jobfile, offset, view, priority, ticket)
        except (IOEngineError, OSError) as exc:
            self.counters.io_errors.add((op,))
            raise SwapIOError(f"swap {op} of {len(view)} bytes at {offset} in {jobfile.path} "
                              f"failed: {exc}") from exc
        finally:
            self.queue.leave()
        self.counters.io_seconds[op].observe(time.perf_counter() - started)
        if op == "read":
            jobfile.dir.read_nbytes += len(view)
            if checksum is None and seed is not None:
                checksum = await self.checksum(view, seed)
        else:
            jobfile.dir.written_nbytes += len(view)
        return checksum

    async def _submit(self, op: str, jobfile: JobFile, offset: int, view: memoryview,
                      priority: Priority, ticket: IOTicket | None) -> None:
        future = self.engine.submit(op, jobfile.fd, offset, view, int(priority))
        if ticket is not None:
            ticket.in_engine.add(future)
            future.add_done_callback(ticket.in_engine.discard)
        await future

    async def _staged(self, op: str, jobfile: JobFile, offset: int, view: memoryview,
                      priority: Priority, ticket: IOTicket | None, seed: int | None
                      ) -> int | None:
        """A transfer through a bounce slot, or in place where no slot fits (counted);
        returns the checksum taken on the way (None: take it from ``view``)."""
        pool = self.bounce
        assert pool is not None
        slot = pool.take(len(view))
        if slot is None:
            pool.direct_count += 1
            checksum = await self.checksum(view, seed) if seed is not None and op == "write" \
                else None
            await self._submit(op, jobfile, offset, view, priority, ticket)
            return checksum
        # Hazard: the kernel (or the copy thread) may still use the slot when the caller
        # is cancelled; the transfer's own task gives it back, once they are done.
        transfer = asyncio.ensure_future(pool.transfer(
            op, view, slot, seed, self.copy_pool,
            lambda buffer: self._submit(op, jobfile, offset, buffer, priority, ticket)))
        transfer.add_done_callback(_consume_result)
        return await asyncio.shield(transfer)

    async def sync(self, jobfile: JobFile) -> None:
        """fdatasync one swap file off the loop; failure is a SwapIOError naming the file."""
        try:
            if self.sync_fault_nth:
                self.sync_fault_nth -= 1
                if not self.sync_fault_nth:
                    raise OSError(errno.EIO, "injected fdatasync fault")
            sync = getattr(self.engine, "sync", None)
            if sync is not None:
                await sync(jobfile.fd)
            else:
                await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, jobfile.fd)
        except OSError as exc:
            self.counters.io_errors.add(("sync",))
            raise SwapIOError(f"fdatasync of {jobfile.path} failed: {exc}") from exc

    async def checksum(self, view: memoryview, seed: int = 0) -> int:
        if self.hash_pool is None:
            return xxhash.xxh3_64_intdigest(view, seed)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.hash_pool, xxhash.xxh3_64_intdigest, view, seed)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "dirs": [{"path": str(d.path), "direct": d.direct, "reserved_nbytes": d.reserved_nbytes,
                      "budget_nbytes": d.budget_nbytes, "read_nbytes": d.read_nbytes,
                      "written_nbytes": d.written_nbytes} for d in self.dirs],
            "io_in_flight": self.queue.in_flight,
            "io_seconds": {op: h.total for op, h in c.io_seconds.items()},
            "engine": getattr(self.engine, "kind", getattr(self.engine, "name", "")),
            "writeback_nbytes": c.writeback_nbytes, "demand_reads": c.demand_reads,
            "by_kind": _by_kind(c.kind_nbytes),
            "reread_nbytes": c.reread_nbytes,
            "writeback_unneeded_nbytes": c.writeback_unneeded_nbytes,
            "clean_writeback_nbytes": c.clean_writeback_nbytes,
            "prefetch_issued": c.prefetch_issued, "prefetch_hits": c.prefetch_hits,
            "prefetch_late": c.prefetch_late, "prefetch_wasted": c.prefetch_wasted,
            "checksum_failures": c.checksum_failures,
            "bounce": self._bounce_stats(),
            "quarantined": dict(self.quarantined),
            **self.retention.stats(),
            "io_errors": {labels[0]: n for labels, n in c.io_errors.values.items()},
            "evictions": {labels[0]: n for labels, n in c.evictions.values.items()},
            "stall_s": sum(c.stall_seconds.values.values()),
        }

    def _bounce_stats(self) -> dict[str, Any]:
        pool = self.bounce
        if pool is None:
            return {"enabled": False}
        return {"enabled": True, "slots": pool.num_slots, "slot_nbytes": pool.slot_nbytes,
                "in_use": pool.in_use, "read_nbytes": pool.staged_nbytes["read"],
                "written_nbytes": pool.staged_nbytes["write"], "in_place": pool.direct_count,
                "prefaulted_slots": pool.prefaulted,
                "prefault_running": (self.bounce_prefault is not None
                                     and not self.bounce_prefault.done())}

    def families(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily

        c = self.counters
        dirs = [str(d.path) for d in self.dirs]
        out: list[Any] = [
            gauge("offloadd_swap_capacity_bytes", "Swap budget per dir.", 0, ["dir"],
                  [([p], d.budget_nbytes) for p, d in zip(dirs, self.dirs)]),
            gauge("offloadd_swap_used_bytes", "Swap file bytes allocated per dir.", 0, ["dir"],
                  [([p], d.reserved_nbytes) for p, d in zip(dirs, self.dirs)]),
            gauge("offloadd_swap_direct_io", "1 if the dir uses O_DIRECT, 0 if buffered.", 0,
                  ["dir"], [([p], 1.0 if d.direct else 0.0) for p, d in zip(dirs, self.dirs)]),
            gauge("offloadd_swap_io_in_flight", "Swap IO requests in flight.",
                  self.queue.in_flight),
            histogram_family("offloadd_swap_io_duration_seconds", "Swap IO request latency.",
                             ["op"], [([op], h) for op, h in c.io_seconds.items()]),
            c.io_errors.family(), c.evictions.family(), c.flushes.family(),
            c.stall_seconds.family(), c.kind_nbytes.family(),
        ]
        for name, doc, values in (
            ("offloadd_swap_read_bytes", "Bytes read from swap.",
             [d.read_nbytes for d in self.dirs]),
            ("offloadd_swap_written_bytes", "Bytes written to swap.",
             [d.written_nbytes for d in self.dirs]),
        ):
            family = CounterMetricFamily(name, doc, labels=["dir"])
            for path, value in zip(dirs, values):
                family.add_metric([path], value)
            out.append(family)
        for name, doc, value in (
            ("offloadd_writeback_bytes", "Dirty bytes written back.", c.writeback_nbytes),
            ("offloadd_swap_reread_bytes", "Bytes of swap copies read into the arena again.",
             c.reread_nbytes),
            ("offloadd_writeback_unneeded_bytes",
             "Bytes written back, then superseded or dropped before anything relied on them.",
             c.writeback_unneeded_nbytes),
            ("offloadd_clean_writeback_bytes",
             "Bytes written back whose swap copy already held that version.",
             c.clean_writeback_nbytes),
            ("offloadd_prefetch_issued", "Prefetch reads started.", c.prefetch_issued),
            ("offloadd_prefetch_hits", "Acquires served by a completed prefetch.", c.prefetch_hits),
            ("offloadd_prefetch_late", "Acquires that waited on a prefetch in flight.",
             c.prefetch_late),
            ("offloadd_prefetch_wasted", "Prefetched shards evicted before use.",
             c.prefetch_wasted),
            ("offloadd_demand_reads", "Swap reads started by a blocked request.", c.demand_reads),
            ("offloadd_checksum_failures", "Swap chunks whose checksum did not match.",
             c.checksum_failures),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            out.append(family)
        return out

    async def close(self) -> None:
        await self.retention.close()
        if self.config.release_swap_at_exit:
            for job in sorted(self.created):
                await self.release_job(job)
        for tier in self.tiers.values():
            await tier.quiesce()
            await tier.close()
        if self.engine is not None:
            await self.engine.aclose()
        if self.bounce_prefault is not None:
            await asyncio.wait([self.bounce_prefault])  # its slots go back as it ends
        if self.bounce is not None:
            self.bounce.close()
        if self.copy_pool is not None and self.copy_pool is not self.hash_pool:
            self.copy_pool.shutdown(wait=True)
        if self.hash_pool is not None:
            self.hash_pool.shutdown(wait=True)
        for fd in self.lock_fds:
            unlock_swap_dir(fd)
        self.lock_fds.clear()
        for swap_dir in self.dirs:
            swap_dir.close()


def _consume_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved; whoever awaited it (if anyone) got it already


def recovery_order(live: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """The order live jobs take the DRAM budget at ``--recover``: owners take turns (each
    owner's first job before anyone's second), each turn smallest arena first (then by
    uid), each owner's jobs last-flushed first. Names play no part, so a name chosen to
    sort first gains nothing, and many jobs of one uid take no more than one turn each."""
    by_uid: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for name, manifest in live:
        owner = manifest_owner(manifest)
        by_uid.setdefault(owner.uid if owner is not None else 0, []).append((name, manifest))
    for jobs in by_uid.values():
        jobs.sort(key=lambda job: -manifest_flushed_at(job[1]))
    order = []
    for turn in range(max((len(jobs) for jobs in by_uid.values()), default=0)):
        round_ = [(_arena_nbytes(jobs[turn][1]), uid, jobs[turn])
                  for uid, jobs in by_uid.items() if turn < len(jobs)]
        order += [job for _nbytes, _uid, job in sorted(round_, key=lambda r: r[:2])]
    return order


def _arena_nbytes(manifest: dict[str, Any]) -> int:
    nbytes = manifest.get("arena_nbytes")
    return nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) else 0


def _by_kind(kind_nbytes: Counters) -> dict[str, dict[str, int]]:
    """``{kind: {"read_nbytes": .., "written_nbytes": ..}}`` for every kind that moved."""
    out: dict[str, dict[str, int]] = {}
    for (op, kind), nbytes in list(kind_nbytes.values.items()):
        moved = out.setdefault(kind, {"read_nbytes": 0, "written_nbytes": 0})
        moved["read_nbytes" if op == "read" else "written_nbytes"] = int(nbytes)
    return out
