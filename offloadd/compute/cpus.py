"""Where the optimizer's threads run: the ``optimizer_cpus`` setting turned into two CPU
sets, one for the Adam pool and one for everything else (the event loop, IO and hash
threads), so the step that streams the whole optimizer state through DRAM does not take
the loop's core and the loop does not preempt Adam's.

"off" pins nothing. "auto" gives Adam one logical CPU of every physical core the daemon
may run on but the first; that core, with its siblings, keeps the rest. It pins only
where at least ``AUTO_MIN_CORES`` physical cores are there: on fewer, one core less for
Adam costs more than the loop's interference. A CPU list ("2-15,18") names Adam's CPUs
and leaves the others to the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from offloadd.config import parse_cpu_list

AUTO_MIN_CORES = 4
SYS_CPUS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuPlan:
    """The two disjoint CPU sets of a pinned daemon."""

    optimizer: frozenset[int]
    rest: frozenset[int]


def physical_cores(allowed: frozenset[int], sys_cpus: Path = SYS_CPUS) -> list[list[int]]:
    """The logical CPUs of ``allowed`` grouped by physical core (package, core id), cores
    in order of their lowest CPU; CPUs without topology are cores of their own."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(allowed):
        topology = sys_cpus / f"cpu{cpu}" / "topology"
        try:
            key = ((topology / "physical_package_id").read_text().strip(),
                   (topology / "core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


def plan_cpus(setting: str, allowed: frozenset[int] | None = None,
              sys_cpus: Path = SYS_CPUS) -> tuple[CpuPlan | None, str]:
    """The plan for ``setting`` within ``allowed`` (default: this process's affinity),
    and a word on why there is none when there is none."""
    if setting == "off":
        return None, "optimizer_cpus is off"
    allowed = allowed if allowed is not None else frozenset(os.sched_getaffinity(0))
    if setting == "auto":
        cores = physical_cores(allowed, sys_cpus)
        if len(cores) < AUTO_MIN_CORES:
            return None, (f"{len(cores)} physical cores (auto pins from {AUTO_MIN_CORES})")
        optimizer = frozenset(core[0] for core in cores[1:])
    else:
        optimizer = parse_cpu_list(setting) & allowed
        if not optimizer:
            return None, f"none of {setting!r} is among the CPUs this daemon may use"
    rest = allowed - optimizer
    if not rest:
        return None, f"{setting!r} would leave no CPU for the event loop"
    return CpuPlan(optimizer=optimizer, rest=rest), ""


def pin_process(cpus: frozenset[int]) -> None:
    """Restrict every thread this process has now (a library's pool started at import
    included) and every thread they start later to ``cpus``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            pass  # ended meanwhile


def pin_this_thread(cpus: frozenset[int]) -> None:
    """Restrict the calling thread (and the threads it starts later) to ``cpus``."""
    os.sched_setaffinity(0, cpus)
