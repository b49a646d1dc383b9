"""Daemon configuration: one keyword-only dataclass, filled from flags or a TOML file."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import tomllib

from offloadd.protocol import MAX_FRAME_NBYTES

LogLevel = Literal["debug", "info", "warning", "error"]
IOEngineKind = Literal["auto", "native", "io_uring", "threads", "python"]
HugePages = Literal["auto", "on", "off"]
"""Back the arena with 2 MiB pages: always, never, or when the kernel has them free."""
Prefault = Literal["now", "background", "lazy"]
"""When an arena's pages are touched in: at creation, behind it, or on first use."""
Bytes = Annotated[int, "bytes"]
"""A byte count: a plain int, or (in a file or a flag) a size such as ``"64GiB"``."""
MAX_UID = (1 << 32) - 2
"""The largest uid (uid_t is 32 bits; -1 is reserved)."""


class ConfigError(ValueError):
    """A config value of the wrong type or outside its range, or an unknown key; ``key``
    names the setting (``swap_dirs``, or ``swap_dirs[1]`` for one item) and the message
    says what to write instead."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key

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


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8} (the kernel's cpulist format); ValueError if not one."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (write e.g. \"2-15\" or \"2,4,6\")")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"{part!r} in {text!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def check_cpu_setting(setting: str) -> None:
    """ValueError unless ``setting`` is "off", "auto" or a CPU list."""
    if setting not in ("off", "auto"):
        parse_cpu_list(setting)



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
    max_arena_nbytes_per_uid: int | None


def check_limits(limits: Limits, max_frame_nbytes: int = MAX_FRAME_NBYTES) -> None:
    """Raise ConfigError naming the knob for a limit outside its range."""
    for knob in ("max_sessions", "max_sessions_per_uid", "max_ids_per_request",
                 "max_shards_per_job", "max_prefetches_per_job", "max_jobs_per_uid",
                 "max_fds_per_uid", "max_shards_per_uid", "max_metadata_nbytes_per_uid",
                 "max_queued_steps_per_uid", "max_pending_nbytes_per_uid",
                 "max_requests_in_flight", "max_ranks_per_job"):
        if getattr(limits, knob) < 1:
            raise ConfigError(knob, f"{knob} must be >= 1, got {getattr(limits, knob)}")
    for knob in ("hello_timeout_s", "frame_timeout_s"):
        if getattr(limits, knob) <= 0:
            raise ConfigError(knob, f"{knob} must be > 0 seconds, got {getattr(limits, knob)}")
    if limits.node_status_interval_s < 0:
        raise ConfigError("node_status_interval_s", f"node_status_interval_s must be >= 0 "
                          f"seconds, got {limits.node_status_interval_s}")
    if not 4096 <= limits.max_partial_frame_nbytes <= max_frame_nbytes:
        raise ConfigError("max_partial_frame_nbytes", f"max_partial_frame_nbytes must be in "
                          f"[4096, {max_frame_nbytes}] bytes, got "
                          f"{limits.max_partial_frame_nbytes}")


@dataclass(kw_only=True)
class DaemonConfig:
    """Every setting of the daemon. Each value is checked by its annotated type and its range
    when the config is made (``check_types``, then ``__post_init__``), wherever it came from:
    a TOML file (``from_toml``), the flags or Python; a bad one raises ConfigError."""

    socket: str = field(default_factory=default_socket_path)
    """Path of the unix control socket."""
    arena_size: Bytes = 1 << 30
    """Total pinned DRAM (bytes) for all job arenas together; a hard limit."""
    job_arena_share: float = 0.5
    """Fraction of the free budget a job gets when its hello names no size (0 < x <= 1)."""
    swap_dirs: list[str] = field(default_factory=list)
    """Directories (ideally one per NVMe drive) holding the swap files."""
    swap_size: Bytes = 64 << 30
    """Swap budget per swap dir, bytes."""
    chunk_size: Bytes = 4 << 20
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
    """Absolute paths of dirs the daemon deletes, whole, when it exits (a private daemon's
    own swap and socket dirs: nobody else is left to remove them). Each must not exist yet
    (the daemon creates it) or be one offloadd made as scratch (``make_scratch_dir``): a
    daemon deletes only dirs that carry its own marker (``offloadd.swap.swapdirs``)."""
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
    node fails the hello instead of a rank's first touch), "lazy" on first touch. Not
    "lazy": the swap tier's bounce slots are also backed in the background once a job
    outgrows its arena (offloadd.swap.nvme.SwapSpace.stage_ahead)."""
    arena_prefault_rate: Bytes = 0
    """Bytes per second the background prefault backs at most (0: unthrottled); keeps
    it from taking cores and DRAM bandwidth from training on small machines."""
    arena_prefault_threads: int = 0
    """Threads that back (and lock) a new arena's pages, each a 64 MiB chunk at a time;
    0: one per CPU the daemon may run on, at most 8 (offloadd.memory.arena)."""
    optimizer_threads: int = 0
    """Threads for the CPU optimizer step; 0 = one per CPU it may run on."""
    optimizer_cpus: str = "off"
    """Where the optimizer step runs (offloadd.compute.cpus): "off" (anywhere), "auto"
    (one logical CPU of every physical core but the first, which keeps the event loop, IO
    and hash threads; from 4 physical cores) or a CPU list such as "2-15"."""
    watchdog: bool = True
    """Answer systemd's watchdog (WATCHDOG_USEC) from the event loop."""
    job_linger_s: float = 300.0
    """Seconds a job with no sessions left keeps its arena and shards (a restarting rank
    can reattach) before it is freed; close_job frees it at once, and a new job of the
    same uid that needs its room sooner."""
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
    max_partial_frame_nbytes: Bytes = 16 << 20
    """Bytes of one request frame the daemon buffers for a connection (<= 16 MiB)."""
    frame_timeout_s: float = 30.0
    """Seconds a request frame may take to arrive in full, from its first byte."""
    max_jobs_per_uid: int = 256
    """Live jobs (lingering ones included) one uid may own at once."""
    max_fds_per_uid: int = 4096
    """Descriptors the daemon may hold for one uid, lingering jobs included: one per
    connection, two per job arena (the memfd and its mapping's copy), two per job swap
    file (the file and its dir). Sized from the daemon's RLIMIT_NOFILE as it is now:
    max(64, 1/8) of it is kept for the daemon, a uid gets at most half of the rest."""
    max_shards_per_uid: int = 1 << 21
    """Shards all jobs of one uid may hold together."""
    max_metadata_nbytes_per_uid: Bytes = 512 << 20
    """Bytes of shard metadata (about 400 per shard plus its id) one uid's jobs may hold;
    lower still, 8 MiB plus a quarter of the uid's arena bytes."""
    max_queued_steps_per_uid: int = 4096
    """Optimizer steps of one uid queued or running in the daemon at once."""
    max_pending_nbytes_per_uid: Bytes = 64 << 20
    """Bytes the daemon buffers for one uid's connections: requests received but not yet
    answered (partial frames, frames held back) and replies its clients have not read yet.
    Past it, a connection's new request bytes close it and a connection holding replies is
    not read until they drain."""
    max_requests_in_flight: int = 256
    """Requests of one connection that may wait for IO or the optimizer at once; more are
    left unread in the socket until one ends (backpressure, not an error)."""
    max_ranks_per_job: int = 1024
    """Distinct rank numbers that may attach to one job on this node."""
    node_status_interval_s: float = 0.02
    """Seconds between two node_status answers to one uid (later ones wait their turn)."""
    metrics_idle_timeout_s: float = 10.0
    """Seconds a /metrics connection has, from connect, to send its request and take the
    reply (a whole-request deadline: a byte at a time does not extend it)."""
    max_metrics_connections: int = 8
    """/metrics connections served at once (one thread each); when all are taken, the
    oldest one still sending its request gives its slot to the newcomer."""
    max_swap_nbytes_per_uid: Bytes | None = None
    """Bytes of swap files one uid's jobs may hold in all swap dirs, ended and flushed jobs'
    kept files included; None: only the swap dirs' budgets (swap_size) bound them."""
    max_arena_nbytes_per_uid: Bytes | None = None
    """Bytes of the DRAM budget (arena_size) one uid's live job arenas may hold (its
    lingering ones are freed for its new ones). None: a fair share, arena_size divided
    among the uids that hold arenas or ask for one; a uid may use free room past it while
    no other uid waits for room, and a uid asking within it gets lingering arenas of uids
    past theirs freed first."""
    flushed_job_retention_s: float = 86400.0
    """Seconds an ended job's flushed swap files are kept for --recover before the daemon
    deletes them (earlier, oldest first, when their owner or swap dir needs the room)."""
    require_job_secret: bool = False
    """Refuse hellos without a job secret (OFFLOADD_JOB_SECRET in every rank's env)."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.arena_size < 4096:
            raise ConfigError("arena_size", f"arena_size must be at least 4KiB, got "
                              f"{self.arena_size} bytes")
        if not 0 < self.job_arena_share <= 1:
            raise ConfigError("job_arena_share", f"job_arena_share must be in (0, 1], got "
                              f"{self.job_arena_share}")
        if self.chunk_size <= 0 or self.chunk_size % 4096:
            raise ConfigError("chunk_size", f"chunk_size must be a positive multiple of 4KiB, "
                              f"got {self.chunk_size}")
        for knob in ("io_queue_depth", "max_metrics_connections"):
            if getattr(self, knob) < 1:
                raise ConfigError(knob, f"{knob} must be >= 1, got {getattr(self, knob)}")
        try:
            check_cpu_setting(self.optimizer_cpus)
        except ValueError as error:
            raise ConfigError("optimizer_cpus", f"optimizer_cpus must be \"off\", \"auto\" "
                              f"or a CPU list: {error}") from None
        for knob in ("hash_threads", "optimizer_threads", "arena_prefault_threads"):
            if (getattr(self, knob) or 0) < 0:
                raise ConfigError(knob, f"{knob} must be >= 0, got {getattr(self, knob)}")
        for knob in ("job_linger_s", "flushed_job_retention_s", "exit_when_idle_s"):
            if (getattr(self, knob) or 0) < 0:
                raise ConfigError(knob, f"{knob} must be >= 0 seconds, got "
                                  f"{getattr(self, knob)}")
        if self.metrics_idle_timeout_s <= 0:
            raise ConfigError("metrics_idle_timeout_s", f"metrics_idle_timeout_s must be > 0 "
                              f"seconds, got {self.metrics_idle_timeout_s}")
        if self.metrics_addr is not None:
            parse_host_port(self.metrics_addr)
        for index, uid in enumerate(self.allowed_uids):
            if not 0 <= uid <= MAX_UID:
                raise ConfigError(f"allowed_uids[{index}]", f"allowed_uids[{index}] must be a "
                                  f"uid in [0, {MAX_UID}], got {uid}")
        for index, path in enumerate(self.scratch_dirs):
            if not os.path.isabs(path) or os.path.realpath(path) == "/":
                raise ConfigError(f"scratch_dirs[{index}]", (
                    f"scratch_dirs[{index}] must be an absolute path below / (the daemon deletes "
                    f"it at exit), got {path!r}; write e.g. scratch_dirs = [\"/run/offloadd-x\"]"))
        check_limits(self.limits())

    def limits(self) -> Limits:
        return Limits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Limits)})

    def resolved_hash_threads(self) -> int:
        if self.hash_threads is not None:
            return self.hash_threads
        cores = os.cpu_count() or 1
        return 0 if cores <= 4 else min(8, cores // 4)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> DaemonConfig:
        """Load a TOML file whose keys are the field names (``-`` or ``_``), at the top level
        or in an ``[offloadd]`` table; overrides (the flags) that are not None win."""
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
        values = _file_values(raw, path, known={f.name for f in dataclasses.fields(cls)})
        given = {key: value for key, value in overrides.items() if value is not None}
        try:
            return cls(**{**values, **given})
        except ConfigError as exc:
            if exc.key.partition("[")[0] in set(values) - set(given):
                raise ConfigError(exc.key, f"{path}: {exc}") from None
            raise


def _file_values(raw: dict[str, Any], path: str | Path, *, known: set[str]) -> dict[str, Any]:
    """The settings of a parsed TOML file by field name; unknown or doubled keys raise."""
    if "offloadd" in raw:
        table, outside = raw["offloadd"], sorted(set(raw) - {"offloadd"})
        if not isinstance(table, dict):
            raise ConfigError("offloadd", f"{path}: offloadd must be a table ([offloadd]) of "
                              f"settings, got {_describe(table)}")
        if outside:
            raise ConfigError(outside[0], f"{path}: {outside} are outside the [offloadd] table; "
                              "put every setting in it (or none: a file of top-level keys)")
        raw = table
    unknown = sorted(key.replace("-", "_") for key in raw if key.replace("-", "_") not in known)
    if unknown:
        close = {key: difflib.get_close_matches(key, sorted(known), n=1) for key in unknown}
        hints = "".join(f"did you mean {near[0]!r} for {key!r}? " for key, near in close.items()
                        if near)
        raise ConfigError(unknown[0], f"{path}: unknown keys {unknown}; {hints}known keys are "
                          f"{sorted(known)}")
    values: dict[str, Any] = {}
    for spelled, value in raw.items():
        key = spelled.replace("-", "_")
        if key in values:
            raise ConfigError(key, f"{path}: {key} is set twice (spelled with - and with _); "
                              "keep one")
        values[key] = value
    return values


def check_types(config: Any) -> None:
    """Check (and normalise) every field of a config dataclass by its annotation: an int is
    never a bool, a list never a string, a size string becomes bytes, a float is finite;
    raises ConfigError naming the key and what to write instead."""
    hints = get_type_hints(type(config), include_extras=True)
    for item in dataclasses.fields(config):
        setattr(config, item.name, _checked(item.name, hints[item.name],
                                            getattr(config, item.name)))


def _checked(key: str, hint: Any, value: Any) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [arg for arg in args if arg is not type(None)]
        origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated and "bytes" in args[1:]:
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            try:
                return parse_size(value, knob=key)
            except ValueError as exc:
                raise ConfigError(key, str(exc)) from None
    elif origin is Literal:
        if isinstance(value, str) and value in args:
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)):
            return [_checked(f"{key}[{index}]", args[0], item)
                    for index, item in enumerate(value)]
    elif hint is str and isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text and "\0" not in text:
            return text
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value):
            return float(value)
    elif isinstance(value, bool) if hint is bool else (hint is int and isinstance(value, int)
                                                      and not isinstance(value, bool)):
        return value
    raise ConfigError(key, f"{key} must be {_expected(hint)}, got {_describe(value)}; "
                      f"write e.g. {_example(key, hint, value)}")


def _expected(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        return "a byte count (an integer >= 0, or a size string such as \"64GiB\")"
    if origin is Literal:
        return "one of " + "|".join(args)
    if origin is list:
        return f"a list of {_expected(args[0]).removeprefix('a ').removeprefix('an ')}s"
    return {str: "a non-empty string", float: "a finite number", int: "an integer",
            bool: "true or false"}[hint]


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value!r}"


def _example(key: str, hint: Any, value: Any) -> str:
    """A TOML line that would be accepted, from the bad ``value`` where it helps."""
    name = key.partition("[")[0]
    text = _example_value(hint, value)
    return f"{name} = [{text}]" if "[" in key else f"{name} = {text}"


def _example_value(hint: Any, value: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is list:
        if isinstance(value, str) and args[0] is str:  # one path meant as a list of one
            return f"[{json.dumps(value)}]"
        return f"[{_example_value(args[0], None)}]"
    if origin is Annotated:
        return '"64GiB"'
    if origin is Literal:
        return json.dumps(args[0])
    return {str: '"..."', float: "30.0", int: "4", bool: "true"}[hint]


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an empty host: 127.0.0.1) as a pair; ConfigError names metrics_addr."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError("metrics_addr", f"metrics_addr must be HOST:PORT, got {text!r}; "
                          'write e.g. metrics_addr = "127.0.0.1:9400"')
    return host or "127.0.0.1", int(port)
