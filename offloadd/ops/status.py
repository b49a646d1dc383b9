"""Operator commands: ``offloadd status`` (what the node's daemon holds) and ``offloadd gc``.

Both talk to the daemon with one ``NodeStatus`` request over its unix
socket (the same framing and message types the ranks use). ``status`` turns
the reply into a table or JSON; IO rates and ratios are computed here, from
two samples of the daemon's counters, never kept as gauges in the daemon.

``gc`` reclaims the swap files of jobs the daemon no longer knows. The NVMe
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
from collections.abc import Iterable
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
        *(f"ended job {job} (uid {kept['uid']}): {format_nbytes(kept['nbytes'])} of swap "
          + ("being deleted" if kept.get("deleting") else
             f"kept for --recover, deleted in {kept['expires_in_s']:.0f}s")
          for job, kept in sorted(status.get("retained", {}).items())),
    ]


def render_status(status: dict[str, Any]) -> str:
    node, jobs = status["node"], status["jobs"]
    rank_sessions = sum(int(_number(stats, "sessions")) for stats in jobs.values())
    lines = [
        f"offloadd {node.get('daemon_version')} pid={node.get('daemon_pid')} "
        f"uptime={node.get('uptime_s', 0):.0f}s adam_kernel={node.get('adam_kernel')} "
        f"jobs={len(jobs)} rank_sessions={rank_sessions}",
        f"arena budget {format_nbytes(_number(node, 'budget_nbytes'))}, reserved by jobs "
        f"{format_nbytes(_number(node, 'reserved_nbytes'))}",
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


def find_garbage(swap_dirs: list[str], live: set[str]) -> list[JobSwap]:
    return [job for d in swap_dirs for job in scan_swap_dir(d) if job.job not in live]


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def live_jobs(socket_path: str, swap_dirs: list[str], *, force: bool) -> set[str] | str:
    """The jobs a running daemon holds, or a message saying why gc must refuse."""
    try:
        status = query_node_status(socket_path)
    except DaemonUnreachableError as exc:
        if force:
            return set()
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
    return set(status["jobs"])


def gc_main(swap_dirs: list[str], socket_path: str, *, dry_run: bool, force: bool) -> int:
    if not swap_dirs:
        print("offloadd gc: no swap dirs; pass --swap-dir DIR or --config with swap_dirs")
        return 2
    live = live_jobs(socket_path, swap_dirs, force=force)
    if isinstance(live, str):
        print(f"offloadd gc: {live}", flush=True)
        return 3
    garbage = find_garbage(swap_dirs, live)
    if garbage and not dry_run:
        # Narrow the race with a job that (re)connected since the first query.
        again = live_jobs(socket_path, swap_dirs, force=force)
        garbage = [job for job in garbage if not isinstance(again, set) or job.job not in again]
        for job in garbage:
            job.remove()
    verb = "would remove" if dry_run else "removed"
    for job in garbage:
        kept = f"; kept foreign entries {job.foreign}" if job.foreign else ""
        print(f"{verb} job {job.job!r} in {job.path.parent.parent}: {len(job.files)} files, "
              f"{format_nbytes(job.nbytes)}{kept}")
    total = format_nbytes(sum(job.nbytes for job in garbage))
    print(f"{verb} {len(garbage)} job(s), {total}; kept {len(live)} live job(s)")
    return 0
