"""Daemon configuration: one keyword-only dataclass, filled from flags or a TOML file."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomllib

from offloadd.protocol import MAX_FRAME_NBYTES

LogLevel = Literal["debug", "info", "warning", "error"]
IOEngineKind = Literal["auto", "native", "io_uring", "threads", "python"]
HugePages = Literal["auto", "on", "off"]
"""Back the arena with 2 MiB pages: always, never, or when the kernel has them free."""
Prefault = Literal["now", "background", "lazy"]
"""When an arena's pages are touched in: at creation, behind it, or on first use."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int, *, knob: str = "size") -> int:
    """Parse ``1GiB``, ``512MiB``, ``4096`` into bytes; ``knob`` names the setting in errors."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{knob} must be >= 0 bytes, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(
            f"{knob}: cannot parse size {text!r}; use e.g. 1GiB, 512MiB or plain bytes")
    number, unit = match.groups()
    scale = _UNITS[(unit or "").upper()[:1] if unit and unit.upper() != "B" else ""]
    return int(float(number) * scale)


SERVICE_SOCKET_DIR = "/run/offloadd"
"""The node daemon's runtime dir (systemd's RuntimeDirectory=, or made by a root daemon)."""


def default_socket_path() -> str:
    """``offloadd.sock`` in a runtime dir: $RUNTIME_DIRECTORY (systemd), /run/offloadd where it
    exists or for root, else $XDG_RUNTIME_DIR; /tmp only where none of them is.

    Hazard: in a world-writable dir anyone can create the path first, so the daemon cannot
    start and clients would talk to the squatter (they check who listens, see
    ``offloadd.protocol.check_daemon_peer``, but the daemon is still kept out).
    """
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if not runtime and (os.geteuid() == 0 or os.path.isdir(SERVICE_SOCKET_DIR)):
        runtime = SERVICE_SOCKET_DIR
    runtime = runtime or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return str(Path(runtime) / "offloadd.sock")


@dataclass(kw_only=True, frozen=True)
class Limits:
    """The per-client limit values, copied from DaemonConfig (see its docstrings); enforced by
    ``offloadd.service.limits``."""

    max_sessions: int
    max_sessions_per_uid: int
    hello_timeout_s: float
    max_ids_per_request: int
    max_shards_per_job: int
    max_prefetches_per_job: int
    max_partial_frame_nbytes: int
    frame_timeout_s: float
    max_jobs_per_uid: int
    max_fds_per_uid: int
    max_shards_per_uid: int
    max_metadata_nbytes_per_uid: int
    max_queued_steps_per_uid: int
    max_pending_nbytes_per_uid: int
    max_requests_in_flight: int
    max_ranks_per_job: int
    node_status_interval_s: float
    max_swap_nbytes_per_uid: int | None


def check_limits(limits: Limits, max_frame_nbytes: int = MAX_FRAME_NBYTES) -> None:
    """Raise ValueError naming the knob for a limit outside its range."""
    for knob in ("max_sessions", "max_sessions_per_uid", "max_ids_per_request",
                 "max_shards_per_job", "max_prefetches_per_job", "max_jobs_per_uid",
                 "max_fds_per_uid", "max_shards_per_uid", "max_metadata_nbytes_per_uid",
                 "max_queued_steps_per_uid", "max_pending_nbytes_per_uid",
                 "max_requests_in_flight", "max_ranks_per_job"):
        if getattr(limits, knob) < 1:
            raise ValueError(f"{knob} must be >= 1, got {getattr(limits, knob)}")
    for knob in ("hello_timeout_s", "frame_timeout_s"):
        if getattr(limits, knob) <= 0:
            raise ValueError(f"{knob} must be > 0 seconds, got {getattr(limits, knob)}")
    if limits.node_status_interval_s < 0:
        raise ValueError(f"node_status_interval_s must be >= 0 seconds, "
                         f"got {limits.node_status_interval_s}")
    if not 4096 <= limits.max_partial_frame_nbytes <= max_frame_nbytes:
        raise ValueError(f"max_partial_frame_nbytes must be in [4096, {max_frame_nbytes}] bytes, "
                         f"got {limits.max_partial_frame_nbytes}")


@dataclass(kw_only=True)
class DaemonConfig:
    socket: str = field(default_factory=default_socket_path)
    """Path of the unix control socket."""
    arena_size: int = 1 << 30
    """Total pinned DRAM (bytes) for all job arenas together; a hard limit."""
    job_arena_share: float = 0.5
    """Fraction of the free budget a job gets when its hello names no size (0 < x <= 1)."""
    swap_dirs: list[str] = field(default_factory=list)
    """Directories (ideally one per NVMe drive) holding the swap files."""
    swap_size: int = 64 << 30
    """Swap budget per swap dir, bytes."""
    chunk_size: int = 4 << 20
    """Swap IO chunk, bytes (multiple of 4 KiB); shards are striped across dirs in chunks."""
    io_engine: IOEngineKind = "auto"
    """Which IO engine moves chunks between the arena and swap files."""
    io_queue_depth: int = 32
    """Swap requests in flight per daemon."""
    hash_threads: int | None = None
    """Threads that checksum swap chunks; 0 hashes on the event loop (~0.1-0.3 ms per
    4 MiB chunk, cheaper than a thread hand-off where cores are few). None: 0 on
    machines with at most 4 cores, else one per 4 cores (at most 8)."""
    recover: bool = False
    """At start, restore every job from the last flushed manifest in the swap dirs."""
    release_swap_at_exit: bool = False
    """At stop, delete the swap files of every job this daemon created (flushed or not;
    recovered jobs are kept). The trainer's private daemon sets it."""
    exit_when_idle_s: float | None = None
    """A private daemon's lifetime: stop once no rank session has been attached for this
    many seconds (counted from the start and from the moment the last session left), and
    at once when the last session left after every job was closed. None: serve until
    SIGTERM (a node daemon)."""
    scratch_dirs: list[str] = field(default_factory=list)
    """Directories the daemon deletes, whole, when it exits (a private daemon's own swap
    and socket dirs: nobody else is left to remove them)."""
    metrics_addr: str | None = None
    """HOST:PORT for the Prometheus /metrics endpoint; None disables it."""
    log_level: LogLevel = "info"
    """Log verbosity."""
    allowed_uids: list[int] = field(default_factory=lambda: [os.getuid()])
    """Peer uids allowed to connect (checked with SO_PEERCRED); root is always allowed."""
    mlock: bool = True
    """Lock arenas in RAM when RLIMIT_MEMLOCK allows."""
    arena_hugepages: HugePages = "auto"
    """Back arenas with 2 MiB hugetlb pages: "auto" when the reserved pool
    (vm.nr_hugepages) holds the arena, "on" insists (a hello fails otherwise), "off"."""
    arena_prefault: Prefault = "background"
    """When a new arena's pages are backed (and locked): "background" on a thread of
    its own after the hello is answered, "now" before the hello is answered (a short
    node fails the hello instead of a rank's first touch), "lazy" on first touch."""
    arena_prefault_rate: int = 0
    """Bytes per second the background prefault backs at most (0: unthrottled); keeps
    it from taking cores and DRAM bandwidth from training on small machines."""
    optimizer_threads: int = 0
    """Threads for the CPU optimizer step; 0 = one per core."""
    watchdog: bool = True
    """Answer systemd's watchdog (WATCHDOG_USEC) from the event loop."""
    job_linger_s: float = 300.0
    """Seconds a job with no sessions left keeps its arena and shards (a restarting rank
    can reattach) before it is freed; close_job frees it at once."""
    max_sessions: int = 4096
    """Connections the daemon serves at once (offloadd.service.limits)."""
    max_sessions_per_uid: int = 1024
    """Connections one uid may hold at once."""
    hello_timeout_s: float = 30.0
    """Seconds a new connection has to send hello (or an admin query) before it is closed."""
    max_ids_per_request: int = 1 << 20
    """Shard ids one request may carry."""
    max_shards_per_job: int = 1 << 22
    """Shards one job may hold (every rank together)."""
    max_prefetches_per_job: int = 1 << 16
    """Explicit prefetches one job may have in flight, a request's ids included."""
    max_partial_frame_nbytes: int = 16 << 20
    """Bytes of one request frame the daemon buffers for a connection (<= 16 MiB)."""
    frame_timeout_s: float = 30.0
    """Seconds a request frame may take to arrive in full, from its first byte."""
    max_jobs_per_uid: int = 256
    """Live jobs (lingering ones included) one uid may own at once."""
    max_fds_per_uid: int = 4096
    """Descriptors the daemon may hold for one uid: one per connection, one per job arena
    and one per job swap file; at most half the daemon's RLIMIT_NOFILE is used."""
    max_shards_per_uid: int = 1 << 21
    """Shards all jobs of one uid may hold together."""
    max_metadata_nbytes_per_uid: int = 512 << 20
    """Bytes of shard metadata (about 400 per shard plus its id) one uid's jobs may hold."""
    max_queued_steps_per_uid: int = 4096
    """Optimizer steps of one uid queued or running in the daemon at once."""
    max_pending_nbytes_per_uid: int = 64 << 20
    """Request bytes received but not yet answered that the daemon buffers for one uid
    (partial frames and frames held back while a connection does not read its replies)."""
    max_requests_in_flight: int = 256
    """Requests of one connection that may wait for IO or the optimizer at once; more are
    left unread in the socket until one ends (backpressure, not an error)."""
    max_ranks_per_job: int = 1024
    """Distinct rank numbers that may attach to one job on this node."""
    node_status_interval_s: float = 0.02
    """Seconds between two node_status answers to one uid (later ones wait their turn)."""
    metrics_idle_timeout_s: float = 10.0
    """Seconds a /metrics connection may stay silent before the daemon closes it."""
    max_metrics_connections: int = 8
    """/metrics connections served at once (one thread each); more are closed at once."""
    max_swap_nbytes_per_uid: int | None = None
    """Bytes of swap files one uid's jobs may hold in all swap dirs, ended and flushed jobs'
    kept files included; None: only the swap dirs' budgets (swap_size) bound them."""
    flushed_job_retention_s: float = 86400.0
    """Seconds an ended job's flushed swap files are kept for --recover before the daemon
    deletes them (earlier, oldest first, when their owner or swap dir needs the room)."""
    require_job_secret: bool = False
    """Refuse hellos without a job secret (OFFLOADD_JOB_SECRET in every rank's env)."""

    def __post_init__(self) -> None:
        self.arena_size = parse_size(self.arena_size, knob="arena_size")
        self.swap_size = parse_size(self.swap_size, knob="swap_size")
        self.chunk_size = parse_size(self.chunk_size, knob="chunk_size")
        self.arena_prefault_rate = parse_size(self.arena_prefault_rate,
                                              knob="arena_prefault_rate")
        if self.arena_size < 4096:
            raise ValueError(f"arena_size must be at least 4KiB, got {self.arena_size} bytes")
        if not 0 < self.job_arena_share <= 1:
            raise ValueError(f"job_arena_share must be in (0, 1], got {self.job_arena_share}")
        if self.chunk_size <= 0 or self.chunk_size % 4096:
            raise ValueError(
                f"chunk_size must be a positive multiple of 4KiB, got {self.chunk_size}")
        if self.io_queue_depth < 1:
            raise ValueError(f"io_queue_depth must be >= 1, got {self.io_queue_depth}")
        if self.hash_threads is not None and self.hash_threads < 0:
            raise ValueError(f"hash_threads must be >= 0 (0: on the event loop), "
                             f"got {self.hash_threads}")
        if self.arena_hugepages not in ("auto", "on", "off"):
            raise ValueError(
                f"arena_hugepages must be auto|on|off, got {self.arena_hugepages!r}")
        if self.arena_prefault not in ("now", "background", "lazy"):
            raise ValueError(
                f"arena_prefault must be now|background|lazy, got {self.arena_prefault!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")
        if self.io_engine not in ("auto", "native", "io_uring", "threads", "python"):
            raise ValueError(
                f"io_engine must be auto|native|io_uring|threads|python, got {self.io_engine!r}"
            )
        if self.metrics_addr is not None:
            parse_host_port(self.metrics_addr)
        check_limits(self.limits())
        if self.metrics_idle_timeout_s <= 0:
            raise ValueError(f"metrics_idle_timeout_s must be > 0 seconds, "
                             f"got {self.metrics_idle_timeout_s}")
        if self.max_metrics_connections < 1:
            raise ValueError(f"max_metrics_connections must be >= 1, "
                             f"got {self.max_metrics_connections}")
        if self.flushed_job_retention_s < 0:
            raise ValueError(f"flushed_job_retention_s must be >= 0 seconds, "
                             f"got {self.flushed_job_retention_s}")
        if self.max_swap_nbytes_per_uid is not None:
            self.max_swap_nbytes_per_uid = parse_size(self.max_swap_nbytes_per_uid,
                                                      knob="max_swap_nbytes_per_uid")
        if self.job_linger_s < 0:
            raise ValueError(f"job_linger_s must be >= 0 seconds, got {self.job_linger_s}")
        if self.exit_when_idle_s is not None and self.exit_when_idle_s < 0:
            raise ValueError(f"exit_when_idle_s must be >= 0 seconds (or unset: never), "
                             f"got {self.exit_when_idle_s}")

    def limits(self) -> Limits:
        return Limits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Limits)})

    def resolved_hash_threads(self) -> int:
        if self.hash_threads is not None:
            return self.hash_threads
        cores = os.cpu_count() or 1
        return 0 if cores <= 4 else min(8, cores // 4)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> DaemonConfig:
        """Load a TOML file whose keys are the field names (``-`` or ``_``); overrides win."""
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
        raw = raw.get("offloadd", raw)
        values = {key.replace("-", "_"): value for key, value in raw.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known keys are {sorted(known)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics_addr must be HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)
