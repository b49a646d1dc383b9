"""The node's memory as this process may use it: the kernel's figures, bounded by the
memory cgroup it runs in.

Arenas are pinned shared memory: the kernel can neither reclaim nor swap them, so an
arena past what the node can hold does not slow down, it ends in the OOM killer (the
daemon, or a rank, mid-run). The daemon's budget (``arena_size``) is a figure a person
typed; this module is what the node really has, read when it matters:

- ``total_nbytes``: MemTotal, or the cgroup's limit where lower (a container's
  ``--memory``, a systemd unit's ``MemoryMax=``);
- ``available_nbytes``: MemAvailable (the kernel's estimate of what can be allocated
  without swapping), or the cgroup's room where lower: its limit less what it holds,
  counting the page cache it could drop (file pages that are not shared memory) as room.

cgroup v2 (``memory.max``) and v1 (``memory.limit_in_bytes``) are read, every level from
the process's own group up to the root of the hierarchy it sees, the tightest winning.
Both sides read it: the daemon to admit arenas, a rank to size the one it asks for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KEPT_NBYTES = 1 << 30
"""Memory arenas leave the node (1/32 of a node smaller than 32 GiB)."""
UNLIMITED = 1 << 62
"""Limits at or past this are "no limit" (v1 writes 2^63 less a page; v2 writes "max")."""


@dataclass(frozen=True)
class NodeMemory:
    total_nbytes: int
    available_nbytes: int
    bound: str
    """What set the figures: "MemTotal", or the cgroup dir whose limit is tighter."""

    @property
    def kept_nbytes(self) -> int:
        """What arenas leave the node: the kernel, the daemon itself, the ranks' own
        growth, which the OOM killer takes first when pinned pages hold the rest."""
        return min(KEPT_NBYTES, self.total_nbytes // 32)

    @property
    def pinnable_nbytes(self) -> int:
        """The most all arenas together may ever pin here (the budget's ceiling)."""
        return self.total_nbytes - self.kept_nbytes

    @property
    def room_nbytes(self) -> int:
        """What arenas may still pin now: the available memory less what they leave."""
        return max(0, self.available_nbytes - self.kept_nbytes)

    def source(self, kernel_figure: str) -> str:
        """Where the figures come from, for messages: the kernel's ``kernel_figure``
        (MemTotal, MemAvailable), or the cgroup whose limit binds."""
        return kernel_figure if self.bound == "MemTotal" else f"cgroup {self.bound}"


def node_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
                ) -> NodeMemory:
    """This process's memory figures now (see the module doc); a few reads of /proc."""
    info = _meminfo(proc / "meminfo")
    page = os.sysconf("SC_PAGE_SIZE")
    total = info.get("MemTotal", os.sysconf("SC_PHYS_PAGES") * page)
    available = info.get("MemAvailable", os.sysconf("SC_AVPHYS_PAGES") * page)
    memory = NodeMemory(total, available, "MemTotal")
    for directory, limit, room in _cgroup_limits(proc / "self" / "cgroup", cgroup_root):
        if limit < memory.total_nbytes:
            memory = NodeMemory(limit, memory.available_nbytes, str(directory))
        if room < memory.available_nbytes:
            memory = NodeMemory(memory.total_nbytes, room, memory.bound)
    return memory


def _meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo's ``Key: N kB`` lines, in bytes."""
    values: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return values
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def _cgroup_limits(self_cgroup: Path, root: Path) -> list[tuple[Path, int, int]]:
    """(dir, limit, room) of every memory cgroup level above this process that has a
    limit, from its own group up."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":  # v2: one unified hierarchy
            found += _levels(root, path, "memory.max", "memory.current", "file", "shmem")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own
            found += _levels(root / controllers, path, "memory.limit_in_bytes",
                             "memory.usage_in_bytes", "total_cache", "total_shmem")
    return found


def _levels(mount: Path, path: str, limit_file: str, usage_file: str, cache_key: str,
            shmem_key: str) -> list[tuple[Path, int, int]]:
    if not mount.is_dir():
        return []
    found = []
    directory = mount / path.lstrip("/")
    while True:
        limit = _number(directory / limit_file)
        if limit is not None and limit < UNLIMITED:
            used = _number(directory / usage_file) or 0
            stat = _stat(directory / "memory.stat")
            droppable = max(0, stat.get(cache_key, 0) - stat.get(shmem_key, 0))
            found.append((directory, limit, max(0, limit - used + droppable)))
        if directory == mount or directory.parent == directory:
            return found
        directory = directory.parent


def _stat(path: Path) -> dict[str, int]:
    """A cgroup's ``memory.stat``: ``key value`` lines, values in bytes."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {key: int(value) for key, _, value in (line.partition(" ") for line in lines)
            if value.strip().isdigit()}


def _number(path: Path) -> int | None:
    """An integer file's value; None where it is missing or says "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def shortage(nbytes: int) -> str:
    """Why taking ``nbytes`` more now would eat into what arenas leave the node; "" when
    it would not. Read per backing chunk: the admission of an arena counted the memory
    free then, and another process (another daemon's arena, a rank, a job outside
    offloadd) may have taken it since."""
    memory = node_memory()
    if nbytes <= memory.room_nbytes:
        return ""
    return (f"the node's available memory fell to {memory.available_nbytes} bytes "
            f"({memory.source('MemAvailable')}), within {memory.kept_nbytes} kept for the "
            "system")


def pin_shortage(unbacked_nbytes: int, *, hugepages: bool = False,
                 backing_error: str = "") -> str:
    """Why pinning an arena (cudaHostRegister, which faults in every page) would take
    memory the node does not have; "" when it would not. A hugetlb arena's pages were
    reserved from the pool at mmap. An arena whose backing failed (``backing_error``) has
    its unbacked pages withheld. Otherwise its ``unbacked_nbytes`` would be allocated by
    the pinning process, where no backing watch stops them. Both sides ask: the daemon
    before its own pin, a rank (by the job's stats) before its."""
    if hugepages:
        return ""
    if backing_error:
        return (f"the daemon stopped backing it, short of memory ({backing_error}): its "
                "unbacked pages are withheld")
    memory = node_memory()
    if unbacked_nbytes <= memory.room_nbytes:
        return ""
    return (f"{unbacked_nbytes} bytes of it are not backed yet, past the "
            f"{memory.room_nbytes} bytes this node can still pin "
            f"({memory.source('MemAvailable')}, less what arenas leave the system)")
