"""The daemon: listens on the unix socket, owns jobs, tiers, metrics and the optimizer."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from offloadd import __version__
from offloadd.compute import native_adam
from offloadd.compute.cpus import pin_process, plan_cpus
from offloadd.compute.optimizer import OptimizerService
from offloadd.config import SERVICE_SOCKET_DIR, ConfigError, DaemonConfig, parse_host_port
from offloadd.errors import JobQuarantinedError
from offloadd.metrics import JOB_LABEL, DaemonMetrics, build_registry, gauge, serve_metrics
from offloadd.protocol import ROOT_UID, socket_peer
from offloadd.service.auth import JobAuthority, mask_job_labels
from offloadd.service.device_copies import DeviceCopiesService
from offloadd.service.jobs import Job
from offloadd.service.lifecycle import IdleExit, JobLifecycle
from offloadd.service.limits import LimitGuard
from offloadd.service.registry import JobRegistry, node_budget
from offloadd.service.session import Session
from offloadd.swap.swapdirs import ScratchClaim, claim_scratch_dir, release_scratch_dir

log = logging.getLogger(__name__)
LAG_PERIOD_S = 0.25


def adam_kernel() -> str:
    """The kernel optimizer steps use: the best native one, else "torch" (the fallback)."""
    return next(iter(native_adam.kernels()), "torch")


def sd_notify(message: str) -> None:
    """Tell systemd about readiness/watchdog when run as a Type=notify service."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
        sock.sendto(message.encode(), address)


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


class Daemon:
    """One per node. ``await start()`` then ``await wait_closed()``; ``stop()`` from anywhere."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.cpu_plan, no_plan = plan_cpus(config.optimizer_cpus)
        """The optimizer's CPUs and everyone else's (offloadd.compute.cpus), or None."""
        if self.cpu_plan is not None:  # first: the threads made from here on inherit it
            pin_process(self.cpu_plan.rest)
            log.info("event=cpus_pinned optimizer=%s loop=%s",
                     _cpu_list(self.cpu_plan.optimizer), _cpu_list(self.cpu_plan.rest))
        elif config.optimizer_cpus != "off":
            log.info("event=cpus_not_pinned optimizer_cpus=%s reason=%s",
                     config.optimizer_cpus, no_plan)
        self.metrics = DaemonMetrics()
        budget, memory = node_budget(config.arena_size)
        self.jobs = JobRegistry(budget, config.job_arena_share, lock=config.mlock,
                                hugepages=config.arena_hugepages,
                                prefault=config.arena_prefault,
                                prefault_rate=config.arena_prefault_rate,
                                prefault_threads=config.arena_prefault_threads)
        if memory is not None:
            # Not refused: one config may serve nodes of several sizes (JobRegistry also
            # admits each arena against what the node can still pin).
            log.warning("event=arena_size_past_node_memory arena_size=%d node_nbytes=%d "
                        "bound=%s budget_nbytes=%d note=\"the budget is cut to what the node "
                        "can pin; set arena_size to the DRAM the daemon may pin\"",
                        config.arena_size, memory.total_nbytes, memory.bound, budget)
            self.jobs.cut_to_node(config.arena_size, memory)
        self.optimizer = OptimizerService(
            config.optimizer_threads, self.cpu_plan.optimizer if self.cpu_plan else None)
        self.sessions: set[Session] = set()
        self.auth = JobAuthority(require_job_secret=config.require_job_secret)
        self.lifecycle = JobLifecycle(self, config.job_linger_s)
        self.idle_exit = (IdleExit(self, config.exit_when_idle_s)
                          if config.exit_when_idle_s is not None else None)
        """A private daemon's end once its ranks are gone; None for a node daemon."""
        self.limits = LimitGuard(config.limits(), self.metrics, self.jobs,
                                 swap_dirs=len(config.swap_dirs), lifecycle=self.lifecycle)
        self.swap: Any = None
        self.scratch: list[ScratchClaim] = []
        """The scratch dirs this daemon claimed; it deletes them (only them) at exit."""
        self._session_ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._metrics_server: Any = None
        self._stopped = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self.started_at = time.time()
        self.metrics.sources.append(self._families)
        self.metrics.sources.append(self.optimizer.families)
        self.device_copies = DeviceCopiesService()
        """Daemon-driven copies between arenas and ranks' GPU staging slots."""
        self.metrics.sources.append(self.device_copies.metrics.families)

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        for path in self.config.scratch_dirs:  # first: its socket and swap dirs may be in them
            self.scratch.append(claim_scratch_dir(Path(path)))
        if self.config.swap_dirs:
            from offloadd.swap.nvme import SwapSpace

            self.swap = SwapSpace(self.config, self.metrics, reject=self.limits.reject,
                                  owner_of=lambda name: getattr(self.jobs.jobs.get(name),
                                                                "owner_uid", None))
            await self.swap.open()
            self.swap.retention.on_reclaimed = self._kept_files_gone
            if self.config.recover:
                recovered = await self.swap.recover(
                    self.jobs, lambda name: self._open_tier(name, recovering=True))
                self._adopt_recovered(recovered)
        self._server = await self._listen()
        if self.config.metrics_addr:
            host, port = parse_host_port(self.config.metrics_addr)
            try:
                self._metrics_server = serve_metrics(
                    mask_job_labels(build_registry(self.metrics), self.auth.metrics_label),
                    host, port,
                    idle_timeout_s=self.config.metrics_idle_timeout_s,
                    max_connections=self.config.max_metrics_connections)
            except OSError as exc:  # a host that does not resolve, a port in use
                raise ConfigError("metrics_addr", f"metrics_addr {self.config.metrics_addr!r} "
                                  f"cannot be served: {exc.strerror or exc}; write a local "
                                  "address and a free port, e.g. metrics_addr = "
                                  "\"127.0.0.1:9400\" (port 0: any free one)") from exc
        self._background.append(asyncio.ensure_future(self._watch_loop_lag()))
        if self.idle_exit is not None:
            self.idle_exit.start()
        sd_notify("READY=1")

    async def _listen(self) -> asyncio.AbstractServer:
        path = self.config.socket
        if os.path.dirname(path) == SERVICE_SOCKET_DIR:  # the default of a root daemon
            os.makedirs(SERVICE_SOCKET_DIR, mode=0o755, exist_ok=True)
        directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            raise ConfigError("socket", f"socket {path}: its dir {directory} does not exist; "
                              "create it (writable only by the daemon's uid) or set socket "
                              "(--socket) to a path in a dir that exists")
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise ConfigError("socket", f"socket {path}: {len(os.fsencode(path))} bytes, "
                              f"and a unix socket's path holds at most {UNIX_PATH_MAX}; set "
                              "socket (--socket) to a shorter path, e.g. "
                              "/run/offloadd/offloadd.sock")
        with contextlib.suppress(FileNotFoundError):
            if os.path.exists(path) and not _socket_in_use(path):
                os.unlink(path)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(
            lambda: Session(self, next(self._session_ids)), path, backlog=512)
        os.chmod(path, 0o660)
        return server

    async def wait_closed(self) -> None:
        await self._stopped.wait()

    def request_stop(self) -> None:
        self._stopped.set()

    async def stop(self) -> None:
        """Close the listener and every session, finish IO, release every arena."""
        if self._server is not None:
            self._server.close()
        for session in list(self.sessions):
            if session.transport is not None:
                session.transport.close()
        await asyncio.sleep(0)
        for task in self._background:
            task.cancel()
        if self.idle_exit is not None:
            self.idle_exit.close()
        await self.lifecycle.close()
        if self.swap is not None:
            await self.swap.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.optimizer.close()
        self.jobs.close()
        # Only a daemon that listened owns the path: one that failed to start because
        # another daemon serves there must not delete that daemon's socket.
        if self._server is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket)
        # A private daemon may outlive the rank that made these dirs: it removes them.
        for claim in self.scratch:
            release_scratch_dir(claim)
        self.scratch = []
        self._stopped.set()

    def open_job(self, name: str, arena_nbytes: int) -> Job:
        make_tier = (lambda: self._open_tier(name)) if self.swap is not None else None
        job, _created = self.jobs.open(name, arena_nbytes, make_tier)
        return job

    def _open_tier(self, name: str, *, recovering: bool = False) -> Any:
        from offloadd.swap.tier import open_tier  # with the swap space: only for --swap-dir

        assert self.swap is not None
        return open_tier(self.swap, name, recovering=recovering,
                         owner_record=lambda: self.auth.record(name))

    async def open_job_async(self, name: str, arena_nbytes: int) -> Job:
        """``open_job`` with a new arena made off the loop (see ``JobRegistry.open_async``).

        A name whose ended job's files are kept (``offloadd.swap.retention``) is claimed:
        the job resumes from its last flush. Only its owner gets here (the owner record
        stays in ``auth`` while the files are kept, and the hello checked it).
        """
        make_tier = (lambda: self._open_tier(name)) if self.swap is not None else None
        if self.swap is not None:
            await self.lifecycle.settled(name)  # its files kept or gone, not half-closed
            if (name in self.swap.retention.jobs and name not in self.jobs.jobs
                    and name not in self.jobs.creating):
                return await self._claim_kept(name, arena_nbytes)
        # The lifecycle owns the job from its creation: a hello that is cancelled (its
        # client left, or its hello timer fired) while the arena is made leaves no leak.
        return await self.jobs.open_async(name, arena_nbytes, make_tier,
                                          on_created=self.lifecycle.created)

    # -- recovered and kept jobs --------------------------------------------------

    def _adopt_recovered(self, recovered: list[str]) -> None:
        """Jobs ``--recover`` brought back: owned and charged as before the restart, and
        lingering like a job whose ranks are gone; kept files keep their names for their
        owners."""
        for name in recovered:
            job, owner = self.jobs.jobs[name], self.swap.tiers[name].recovered_owner
            self.auth.restore(name, owner)  # None (an older manifest): root's
            self.limits.claim_job(job, owner.uid if owner is not None else ROOT_UID)
            self.lifecycle.created(job)
            self.swap.stage_ahead(job.table)  # its shards may already outgrow its arena
        for name, kept in self.swap.retention.jobs.items():
            self.auth.restore(name, kept.owner)

    def _kept_files_gone(self, name: str) -> None:
        if name not in self.jobs.jobs and name not in self.jobs.creating:
            self.auth.forget(name)

    async def _claim_kept(self, name: str, arena_nbytes: int) -> Job:
        """The owner's hello for a name whose files are kept: the job resumes from them."""
        from offloadd.swap.manifests import mark_ended, read_job_manifest

        loop, first = asyncio.get_running_loop(), self.swap.dirs[0]
        try:
            manifest = await loop.run_in_executor(None, read_job_manifest,
                                                  first.job_dir(name), first.root_fd)
        except Exception as exc:
            self.swap.retention.claim(name, "unreadable")  # uncounted: gc reclaims the files
            self.swap.quarantine(name, first.job_dir(name), exc)
            raise JobQuarantinedError(self.swap.quarantined[name]) from exc
        claimed = []

        def make_tier() -> Any:
            kept = self.swap.retention.claim(name)
            if kept is None:  # reclaimed while the arena was made: a new job
                return self._open_tier(name)
            try:
                tier = self._open_tier(name, recovering=True)
            except BaseException:
                self.swap.retention.unclaim(kept)
                raise
            claimed.append(kept)
            return tier

        def on_created(job: Job) -> None:
            if claimed:
                try:
                    self.swap.tiers[name].load_manifest(job.table, manifest)
                except Exception as exc:
                    del self.jobs.jobs[name]
                    self.swap.quarantine(name, first.job_dir(name), exc)
                    self.lifecycle.abandon(job)
                    raise JobQuarantinedError(self.swap.quarantined[name]) from exc
                self.swap.stage_ahead(job.table)  # the kept shards may outgrow the arena
            self.lifecycle.created(job)

        nbytes = arena_nbytes or manifest["arena_nbytes"]
        job = await self.jobs.open_async(name, nbytes, make_tier, on_created=on_created)
        tier = self.swap.tiers.get(name)
        if claimed and tier is not None:  # live again: a restart now recovers it
            async with tier.commit_lock:
                try:
                    await loop.run_in_executor(None, mark_ended, first.job_dir(name),
                                               first.root_fd, None)
                except Exception as exc:  # its next flush writes a live manifest anyway
                    log.warning("event=mark_live_failed job=%s error=%r", name, str(exc))
            log.info("event=job_claimed job=%s shards=%d tag=%s", name,
                     len(job.table.shards), manifest["tag"])
        return job

    # -- health and stats ---------------------------------------------------------

    async def _watch_loop_lag(self) -> None:
        """Measure how late timers fire; also feeds systemd's watchdog from the loop itself."""
        loop = asyncio.get_running_loop()
        watchdog = self.config.watchdog and bool(os.environ.get("WATCHDOG_USEC"))
        while True:
            expected = loop.time() + LAG_PERIOD_S
            await asyncio.sleep(LAG_PERIOD_S)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - expected))
            if watchdog:
                sd_notify("WATCHDOG=1")

    def node_stats(self) -> dict[str, object]:
        return {
            "daemon_pid": os.getpid(),
            "daemon_version": __version__,
            "uptime_s": time.time() - self.started_at,
            "budget_nbytes": self.jobs.budget_nbytes,
            "arena_size_nbytes": self.config.arena_size,
            "reserved_nbytes": self.jobs.reserved_nbytes,
            "num_jobs": len(self.jobs.jobs),
            "num_sessions": len(self.sessions),
            "adam_kernel": adam_kernel(),
            "swap": self.swap.stats() if self.swap is not None else None,
            "optimizer": self.optimizer.stats(),
        }

    def _families(self) -> Iterator[Any]:
        jobs = list(self.jobs.jobs.values())
        yield gauge("offloadd_arena_budget_bytes", "The daemon's DRAM budget for all arenas.",
                    self.jobs.budget_nbytes)
        yield gauge("offloadd_arena_size_bytes", "arena_size as configured (above the budget "
                    "where it was cut to what the node can pin).", self.config.arena_size)
        per_job = [
            ("offloadd_arena_capacity_bytes", "Arena size of each job.",
             lambda j: j.arena.nbytes),
            ("offloadd_arena_backed_bytes", "Arena bytes the prefault has backed so far "
             "(pages past it are backed on first touch).", lambda j: j.arena.backed_nbytes),
            ("offloadd_arena_withheld_bytes", "Arena bytes not handed out: the node ran "
             "short of memory while backing them (until it has room again).",
             lambda j: j.arena.allocator.withheld_nbytes),
            ("offloadd_arena_used_bytes", "Arena bytes allocated to shards.",
             lambda j: j.arena.allocator.used_nbytes),
            ("offloadd_arena_largest_free_bytes", "Largest free extent (fragmentation).",
             lambda j: j.arena.allocator.largest_free()),
            ("offloadd_arena_leased_bytes", "Arena bytes pinned by leases.",
             lambda j: j.table.leased_nbytes()),
            ("offloadd_shards", "Shards known per job.", lambda j: len(j.table.shards)),
            ("offloadd_job_swap_used_bytes", "Swap bytes holding each job's chunks (all dirs).",
             lambda j: j.swap_usage()[0]),
        ]
        for name, doc, read in per_job:
            yield gauge(name, doc, 0, [JOB_LABEL], [([j.name], read(j)) for j in jobs])
        yield gauge("offloadd_sessions", "Connected rank sessions.", len(self.sessions))
        sessions = list(self.sessions)
        yield gauge("offloadd_client_buffered_bytes", "Bytes buffered for clients: requests "
                    "not yet answered and replies not yet read (max_pending_nbytes_per_uid).",
                    sum(s.pending_nbytes + s.reply_nbytes for s in sessions))
        yield gauge("offloadd_connections_unread", "Connections not read until their client "
                    "reads its replies.", sum(1 for s in sessions if s.writing_paused))
        yield gauge("offloadd_build_info", "Build and active code paths.", 1,
                    ["version", "adam_kernel", "io_engine", "python"],
                    [([__version__, adam_kernel(), self._io_engine_name(),
                       platform.python_version()], 1)])

    def _io_engine_name(self) -> str:
        engine = getattr(self.swap, "engine", None)
        return str(getattr(engine, "name", "none"))


UNIX_PATH_MAX = 107
"""Longest AF_UNIX path Linux binds (``sun_path`` is 108 bytes with its NUL)."""


def _socket_in_use(path: str) -> bool:
    """A live daemon answers on the path; a stale file from a crash does not."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        pid, uid = socket_peer(probe)
    raise RuntimeError(f"another process (pid {pid}, uid {uid}) is listening on {path}; stop "
                       "it or pick another --socket (in a dir only the daemon's uid can write)")


def run(config: DaemonConfig, *, ready_message: bool = True) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the process exit code."""
    import uvloop

    return uvloop.run(_main(config, ready_message))


async def _main(config: DaemonConfig, ready_message: bool) -> int:
    daemon = Daemon(config)
    try:
        await daemon.start()
    except (OSError, RuntimeError, ValueError) as exc:
        log.error("event=start_failed error=%r", str(exc))
        print(f"offloadd: cannot start: {exc}", file=sys.stderr, flush=True)
        await daemon.stop()
        return 1
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_stop)
    if ready_message:
        metrics = ""
        if daemon._metrics_server is not None:  # the bound port, also when asked for port 0
            host, port = daemon._metrics_server.server_address[:2]
            metrics = f" metrics_addr={host}:{port}"
        print(f"offloadd ready socket={config.socket} pid={os.getpid()} "
              f"arena_size={config.arena_size}{metrics}", flush=True)
    await daemon.wait_closed()
    log.info("event=stopping sessions=%d", len(daemon.sessions))
    await daemon.stop()
    return 0
