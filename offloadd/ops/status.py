"""Operator commands: ``offloadd status`` (what the node's daemon holds) and ``offloadd gc``.

Both talk to the daemon with one ``NodeStatus`` request over its unix
socket (the same framing and message types the ranks use). ``status`` turns
the reply into a table or JSON; IO rates and ratios are computed here, from
two samples of the daemon's counters, never kept as gauges in the daemon.

``gc`` reclaims the swap files the daemon neither serves nor keeps: it keeps every
live job's files and every ended job's files the daemon keeps for their owner to resume
(``offloadd.swap.retention``, which deletes those itself when their retention runs out),
and says for each job what it kept and why. What it removes is orphaned: files of no
job the daemon knows (a crash before any flush, a daemon started without
``--recover``), or of a job quarantined for a manifest it could not read. The NVMe
tier's layout is ``<swap_dir>/offloadd/<job>/`` holding ``swap.<n>`` files and
``manifest.json`` / ``manifest.<tag>.json``. Only files of that shape are
removed: a job directory holding anything else keeps it (and the directory).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offloadd import protocol as p
from offloadd.errors import UntrustedDaemonError
from offloadd.protocol import check_daemon_peer

SWAP_SUBDIR = "offloadd"
"""Folder inside each swap dir that holds one folder per job."""
_SWAP_FILE_RE = re.compile(r"^(swap\.\d+|manifest\.json|manifest\.[^/]+\.json)$")


class DaemonUnreachableError(OSError):
    """No daemon answered on the socket (not running, wrong path, or no permission)."""


# -- talking to the daemon ----------------------------------------------------------------


def query_node_status(socket_path: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """One NodeStatus round trip: ``{"node": {...}, "jobs": {name: stats}, "swap_dirs": [...]}``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(socket_path)
            check_daemon_peer(sock, socket_path)  # gc deletes what the reply leaves out
            sock.sendall(p.encode_frame(p.NodeStatus(rid=1)))
            (length,) = p.HEADER.unpack(_recv_exact(sock, p.HEADER_NBYTES))
            p.check_length(length)
            reply = p.reply_decoder.decode(_recv_exact(sock, length))
    except (OSError, ValueError, UntrustedDaemonError) as exc:
        raise DaemonUnreachableError(f"no offloadd answers on {socket_path}: {exc}") from exc
    if isinstance(reply, p.ErrorReply):
        raise DaemonUnreachableError(f"offloadd on {socket_path} refused: {reply.message}")
    if not isinstance(reply, p.StatsOk):
        raise DaemonUnreachableError(f"offloadd on {socket_path} sent {type(reply).__name__}")
    return reply.stats


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("daemon closed the connection")
        data += chunk
    return bytes(data)


# -- status ---------------------------------------------------------------------------

DIR_COUNTERS = ("read_nbytes", "written_nbytes")
"""Per swap dir byte counters (``node.swap.dirs[i]``) that ``status`` turns into rates."""


def sample_status(socket_path: str, interval_s: float) -> dict[str, Any]:
    """NodeStatus, plus ``swap_rates`` (bytes/s per swap dir) over ``interval_s`` when > 0."""
    first = query_node_status(socket_path)
    if interval_s <= 0:
        return first
    started = time.monotonic()
    time.sleep(interval_s)
    second = query_node_status(socket_path)
    elapsed = max(time.monotonic() - started, 1e-9)
    before = {d["path"]: d for d in swap_dirs_of(first)}
    second["swap_rates"] = {
        d["path"]: {f"{key}_per_s": (_number(d, key) - _number(before.get(d["path"], {}), key))
                    / elapsed for key in DIR_COUNTERS}
        for d in swap_dirs_of(second)
    }
    return second


def swap_dirs_of(status: dict[str, Any]) -> list[dict[str, Any]]:
    swap = status["node"].get("swap") or {}
    return [d for d in swap.get("dirs", []) if isinstance(d, dict) and "path" in d]


def _number(stats: dict[str, Any], key: str) -> float:
    value = stats.get(key, 0)
    return float(value) if isinstance(value, int | float) else 0.0


def format_nbytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


JOB_COLUMNS = ["JOB", "SESSIONS", "SHARDS", "ON NVME", "ARENA USED", "UTIL", "LARGEST FREE",
               "LEASED", "PAGES", "SWAP USED"]


def job_row(name: str, stats: dict[str, Any]) -> list[str]:
    capacity, used = _number(stats, "arena_nbytes"), _number(stats, "arena_used_nbytes")
    residency = stats.get("residency") or {}
    return [
        name,
        str(stats.get("sessions", 0)),
        str(stats.get("num_shards", 0)),
        str(residency.get("nvme", 0)),
        f"{format_nbytes(used)} / {format_nbytes(capacity)}",
        _percent(used, capacity),
        format_nbytes(_number(stats, "arena_largest_free_nbytes")),
        format_nbytes(_number(stats, "leased_nbytes")),
        "2M" if stats.get("arena_hugepages") else "4K",
        format_nbytes(_number(stats, "swap_used_nbytes")),
    ]


SWAP_COLUMNS = ["SWAP DIR", "USED", "UTIL", "O_DIRECT", "READ", "WRITE"]


def swap_row(swap_dir: dict[str, Any], rates: dict[str, float] | None) -> list[str]:
    used, budget = _number(swap_dir, "reserved_nbytes"), _number(swap_dir, "budget_nbytes")
    return [
        str(swap_dir["path"]),
        f"{format_nbytes(used)} / {format_nbytes(budget)}",
        _percent(used, budget),
        "yes" if swap_dir.get("direct") else "no (buffered)",
        *(f"{format_nbytes(rates[f'{key}_per_s'])}/s" if rates else "-" for key in DIR_COUNTERS),
    ]


def render_table(rows: Iterable[list[str]], header: list[str]) -> str:
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def render_swap(status: dict[str, Any]) -> list[str]:
    swap = status["node"].get("swap")
    if not swap:
        return ["swap: none (DRAM only)"]
    rates = status.get("swap_rates", {})
    issued = _number(swap, "prefetch_issued")
    return [
        render_table([swap_row(d, rates.get(d["path"])) for d in swap_dirs_of(status)],
                     SWAP_COLUMNS),
        f"swap engine={swap.get('engine')} io_in_flight={swap.get('io_in_flight')} "
        f"demand_reads={swap.get('demand_reads')} prefetch: issued={issued:.0f} "
        f"hit={_percent(_number(swap, 'prefetch_hits'), issued)} "
        f"late={_percent(_number(swap, 'prefetch_late'), issued)} "
        f"wasted={_percent(_number(swap, 'prefetch_wasted'), issued)}; "
        f"errors: checksum_failures={swap.get('checksum_failures', 0)} "
        f"rank_stall={_number(swap, 'stall_s'):.1f}s",
        *(f"QUARANTINED {why}" for _job, why in sorted(swap.get("quarantined", {}).items())),
        *(_kept_line(job, kept) for job, kept in sorted(status.get("retained", {}).items())),
        *_kept_by_owner(status.get("retained", {})),
    ]


def _kept_line(job: str, kept: dict[str, Any]) -> str:
    what = "ended job" if kept.get("state", "ended") == "ended" else "unrecovered live job"
    fate = ("being deleted" if kept.get("deleting") else
            f"kept for its owner to resume, deleted in {_number(kept, 'expires_in_s'):.0f}s")
    note = f" ({kept['note']})" if kept.get("note") else ""
    return (f"{what} {job} (uid {kept.get('uid')}): {format_nbytes(_number(kept, 'nbytes'))} "
            f"of swap {fate}{note}")


def _kept_by_owner(retained: dict[str, dict[str, Any]]) -> list[str]:
    """One line per owner: the swap its ended jobs' kept files take (charged to it)."""
    by_uid: dict[str, list[float]] = {}
    for kept in retained.values():
        by_uid.setdefault(str(kept.get("uid")), []).append(_number(kept, "nbytes"))
    return [f"kept swap of uid {uid}: {len(sizes)} job(s), {format_nbytes(sum(sizes))}"
            for uid, sizes in sorted(by_uid.items())]


def _cut(node: dict[str, Any]) -> str:
    """Where the budget is less than arena_size: the daemon cut it to the node's memory."""
    configured = _number(node, "arena_size_nbytes")
    if configured <= _number(node, "budget_nbytes"):
        return ""
    return f" (arena_size {format_nbytes(configured)}: cut to what this node can pin)"


def render_status(status: dict[str, Any]) -> str:
    node, jobs = status["node"], status["jobs"]
    rank_sessions = sum(int(_number(stats, "sessions")) for stats in jobs.values())
    lines = [
        f"offloadd {node.get('daemon_version')} pid={node.get('daemon_pid')} "
        f"uptime={node.get('uptime_s', 0):.0f}s adam_kernel={node.get('adam_kernel')} "
        f"jobs={len(jobs)} rank_sessions={rank_sessions} "
        f"kept_jobs={len(status.get('retained') or {})}",
        f"arena budget {format_nbytes(_number(node, 'budget_nbytes'))}{_cut(node)}, reserved "
        f"by jobs {format_nbytes(_number(node, 'reserved_nbytes'))}",
        "",
    ]
    if jobs:
        rows = [job_row(name, stats) for name, stats in sorted(jobs.items())]
        lines.append(render_table(rows, JOB_COLUMNS))
    else:
        lines.append("no jobs")
    return "\n".join([*lines, "", *render_swap(status)])


def status_main(socket_path: str, *, as_json: bool, interval_s: float) -> int:
    try:
        status = sample_status(socket_path, interval_s)
    except DaemonUnreachableError as exc:
        print(f"offloadd status: {exc}", flush=True)
        return 1
    print(json.dumps(status, indent=2, sort_keys=True) if as_json else render_status(status))
    return 0


# -- gc -------------------------------------------------------------------------------


@dataclass
class JobSwap:
    """One job's folder in one swap dir, and the files in it gc may remove."""

    path: Path
    files: list[Path] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    """Entries that are not swap files or manifests: never removed."""
    nbytes: int = 0
    """Bytes on disk (allocated blocks: swap files may be sparse or preallocated)."""

    @property
    def job(self) -> str:
        return self.path.name

    def remove(self) -> None:
        for path in self.files:
            path.unlink(missing_ok=True)
        if not self.foreign:
            self.path.rmdir()


def scan_swap_dir(swap_dir: str | os.PathLike[str]) -> list[JobSwap]:
    root = Path(swap_dir) / SWAP_SUBDIR
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        # Job names never start with '.', and a symlink is never followed out of the swap dir.
        if entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        job = JobSwap(entry)
        for item in sorted(entry.iterdir()):
            if _SWAP_FILE_RE.match(item.name) and item.is_file() and not item.is_symlink():
                job.files.append(item)
                job.nbytes += item.lstat().st_blocks * 512
            else:
                job.foreign.append(item.name)
        found.append(job)
    return found


def find_garbage(swap_dirs: list[str], keep: Collection[str]) -> list[JobSwap]:
    return [job for d in swap_dirs for job in scan_swap_dir(d) if job.job not in keep]


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


@dataclass
class DaemonHolds:
    """What the daemon holds in its swap dirs, as gc sees it: job name -> why it is kept,
    and the quarantined jobs (gc removes their files) -> why they are quarantined."""

    kept: dict[str, str] = field(default_factory=dict)
    quarantined: dict[str, str] = field(default_factory=dict)

    @property
    def num_live(self) -> int:
        return sum(1 for why in self.kept.values() if why == LIVE)


LIVE = "live"


def daemon_holds(socket_path: str, swap_dirs: list[str], *, force: bool) -> DaemonHolds | str:
    """What a running daemon serves or keeps in ``swap_dirs``, or a message saying why gc
    must refuse (no daemon, another daemon's dirs, a view of one uid's jobs only)."""
    try:
        status = query_node_status(socket_path)
    except DaemonUnreachableError as exc:
        if force:
            return DaemonHolds()
        return (f"{exc}.\nWithout a daemon gc cannot tell which jobs still exist, and a daemon "
                "started with --recover restores jobs from these manifests. Refusing. If no "
                "daemon will use these swap dirs again, rerun with --force (removes the swap "
                "files of EVERY job found).")
    served = status.get("swap_dirs") or []
    unserved = [d for d in swap_dirs if not any(_same_dir(d, s) for s in served)]
    if unserved and not force:
        return (f"the daemon on {socket_path} does not use swap dir(s) {unserved} (it uses "
                f"{served or 'none'}), so its job list says nothing about them. Refusing; point "
                "--socket at the daemon that owns them, or use --force.")
    if status.get("scope", "all") != "all":
        return ("the daemon shows this uid only its own jobs, so every other job would look "
                "dead. Refusing; run gc as root.")
    holds = DaemonHolds({name: LIVE for name in status["jobs"]})
    for name, kept in (status.get("retained") or {}).items():
        holds.kept.setdefault(name, _why_kept(kept))
    swap = status["node"].get("swap") or {}
    holds.quarantined = dict(swap.get("quarantined") or {})
    return holds


def _why_kept(kept: dict[str, Any]) -> str:
    if kept.get("deleting"):
        return f"the daemon is deleting it (uid {kept.get('uid')}'s, retention over)"
    what = "ended" if kept.get("state", "ended") == "ended" else "live at the restart, no room"
    return (f"{what}, kept for uid {kept.get('uid')} to resume for "
            f"{_number(kept, 'expires_in_s'):.0f}s more")


def live_jobs(socket_path: str, swap_dirs: list[str], *, force: bool) -> set[str] | str:
    """The jobs a running daemon serves, or a message saying why gc must refuse."""
    holds = daemon_holds(socket_path, swap_dirs, force=force)
    if isinstance(holds, str):
        return holds
    return {name for name, why in holds.kept.items() if why == LIVE}


def gc_main(swap_dirs: list[str], socket_path: str, *, dry_run: bool, force: bool) -> int:
    if not swap_dirs:
        print("offloadd gc: no swap dirs; pass --swap-dir DIR or --config with swap_dirs")
        return 2
    holds = daemon_holds(socket_path, swap_dirs, force=force)
    if isinstance(holds, str):
        print(f"offloadd gc: {holds}", flush=True)
        return 3
    garbage = find_garbage(swap_dirs, holds.kept)
    if garbage and not dry_run:
        # Narrow the race with a job that (re)connected or ended since the first query.
        again = daemon_holds(socket_path, swap_dirs, force=force)
        garbage = [job for job in garbage
                   if not isinstance(again, DaemonHolds) or job.job not in again.kept]
        for job in garbage:
            job.remove()
    verb = "would remove" if dry_run else "removed"
    for job in (j for d in swap_dirs for j in scan_swap_dir(d) if j.job in holds.kept):
        print(f"kept job {job.job!r} in {job.path.parent.parent}: {holds.kept[job.job]}")
    for job in garbage:
        kept = f"; kept foreign entries {job.foreign}" if job.foreign else ""
        why = (f"quarantined: {holds.quarantined[job.job]}" if job.job in holds.quarantined
               else "no live job and no kept files of the daemon (orphaned)")
        print(f"{verb} job {job.job!r} in {job.path.parent.parent}: {len(job.files)} files, "
              f"{format_nbytes(job.nbytes)}{kept} ({why})")
    total = format_nbytes(sum(job.nbytes for job in garbage))
    print(f"{verb} {len(garbage)} job(s), {total}; kept {holds.num_live} live job(s) and "
          f"{len(holds.kept) - holds.num_live} ended job(s) kept for their owners")
    return 0
