"""What one uid sees of the node: the ``node_status`` reply and the node section of stats.

A uid sees its own jobs by name and root sees every job (``JobAuthority.visible``);
another uid's jobs are only counted (``node.num_jobs``), its retained files are not
listed, and a quarantined job is named only to its owner and root. Each job a uid sees
carries its ``metrics_label``, the opaque ``train_job`` label of its /metrics series.
"""

from __future__ import annotations

from typing import Any, Protocol

from offloadd.config import DaemonConfig
from offloadd.protocol import ROOT_UID
from offloadd.service.auth import JobAuthority
from offloadd.service.jobs import Job


class Node(Protocol):
    """What a view reads of the daemon (``offloadd.service.server.Daemon``)."""

    config: DaemonConfig
    auth: JobAuthority
    swap: Any
    """The swap space (``offloadd.swap.nvme.SwapSpace``), or None without --swap-dir."""

    def node_stats(self) -> dict[str, object]: ...


def node_stats(daemon: Node, uid: int) -> dict[str, object]:
    """``Daemon.node_stats`` as ``uid`` may see it: quarantined jobs it does not own are
    counted (``swap.num_quarantined``), not named."""
    stats = daemon.node_stats()
    swap = stats.get("swap")
    if isinstance(swap, dict) and "quarantined" in swap:
        quarantined: dict[str, Any] = swap["quarantined"]
        swap["num_quarantined"] = len(quarantined)
        if uid != ROOT_UID:
            swap["quarantined"] = {name: why for name, why in quarantined.items()
                                   if daemon.auth.visible(name, uid)}
    return stats


def job_stats(daemon: Node, uid: int, name: str, stats: dict[str, object],
              rank: int) -> dict[str, object]:
    """A rank's ``stats`` reply: its job's counts, the node as its uid sees it, and the
    job's /metrics label."""
    stats.update(node_stats(daemon, uid))
    stats["rank"] = rank
    stats["job"] = name
    stats["metrics_label"] = daemon.auth.metrics_label(name)
    return stats


def visible_jobs(daemon: Node, jobs: dict[str, Job], uid: int) -> list[Job]:
    """The live jobs ``uid`` may see by name."""
    auth = daemon.auth
    return [job for name, job in list(jobs.items()) if auth.visible(name, uid)]


def node_status(daemon: Node, uid: int, jobs: dict[str, dict[str, object]]
                ) -> dict[str, object]:
    """The ``node_status`` reply's stats for ``uid``, given its visible jobs' stats."""
    auth, swap = daemon.auth, daemon.swap
    for name, stats in jobs.items():
        stats["metrics_label"] = auth.metrics_label(name)
    retained = (swap.retention.listing(lambda r: uid == ROOT_UID or r.uid == uid)
                if swap is not None else {})
    return {"node": node_stats(daemon, uid), "jobs": jobs,
            "swap_dirs": list(daemon.config.swap_dirs), "scope": auth.scope(uid),
            "retained": retained}
