"""Arenas within what the node can pin: a budget (``arena_size``) past the node's memory,
as a config shared with bigger nodes or a typo makes it, must not let a job's arena take
the node into the OOM killer. A real daemon, real hellos, a real memory cgroup where this
host lets us make one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import start_daemon
from test_daemon_metrics import scrape, value

from offloadd.errors import OverBudgetError
from offloadd.memory.arena import Arena
from offloadd.memory.node import node_memory
from offloadd.ops.embedded import PrivateDaemon
from offloadd.service.registry import JobRegistry
from trainer.client import OffloadClient
from trainer.offload.daemon_backend import DaemonBackend

GIB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")


def meminfo_field(key: str) -> int:
    """One /proc/meminfo figure in bytes, read here independently of the module under test."""
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024


def test_figures_match_the_kernels_without_a_tighter_cgroup() -> None:
    memory = node_memory()
    assert memory.total_nbytes <= os.sysconf("SC_PHYS_PAGES") * PAGE
    if memory.bound == "MemTotal":
        assert memory.total_nbytes == meminfo_field("MemTotal")
    assert 0 < memory.available_nbytes <= memory.total_nbytes
    assert abs(memory.available_nbytes - meminfo_field("MemAvailable")) < GIB \
        or memory.bound != "MemTotal"


def test_a_fake_cgroup_v2_tree_bounds_both_figures(tmp_path: Path) -> None:
    """The parsing of a v2 hierarchy, every level up, the tightest winning; the page cache
    a group could drop (file less shmem) counts as room."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(
        "MemTotal:       67108864 kB\nMemAvailable:   33554432 kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/box/job\n")
    root = tmp_path / "cg"
    (root / "box" / "job").mkdir(parents=True)
    (root / "box" / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "box" / "memory.current").write_text(f"{5 * GIB}\n")
    (root / "box" / "memory.stat").write_text(f"anon 1\nfile {2 * GIB}\nshmem {GIB}\n")
    (root / "box" / "job" / "memory.max").write_text("max\n")
    memory = node_memory(tmp_path / "proc", root)
    assert memory.total_nbytes == 8 * GIB
    assert memory.available_nbytes == 8 * GIB - 5 * GIB + (2 * GIB - GIB)
    assert memory.bound == str(root / "box")


def test_a_new_arena_counts_what_other_arenas_will_still_take(tmp_path: Path) -> None:
    """Two lazily backed arenas of 60% of the node each: the first is admitted, the second
    is refused though nothing is allocated yet (the first will take its pages)."""
    registry = JobRegistry(64 * 1024 * GIB, 1.0, lock=False, prefault="lazy")
    share = node_memory().available_nbytes * 6 // 10 // PAGE * PAGE
    try:
        first, _ = registry.open("first", share)
        with pytest.raises(OverBudgetError, match=r"can pin only .* less (\d+) that other"
                           r" arenas will still take") as refused:
            registry.open("second", share)
        found = re.search(r"less (\d+) that other", str(refused.value))
        assert found is not None, refused.value
        assert int(found.group(1)) == first.arena.nbytes  # no page of it is allocated yet
        first.arena.view[: 64 << 20] = b"\1" * (64 << 20)  # allocates 64 MiB of it
        assert registry.pending_backing_nbytes("second") == first.arena.nbytes - (64 << 20)
    finally:
        registry.close()


@pytest.fixture
def oversized_daemon(tmp_path: Path) -> Iterator[PrivateDaemon]:
    """A daemon whose budget (64 TiB) is far past any node's memory."""
    with start_daemon(tmp_path / "d", arena_size="64TiB",
                      extra_args=["--arena-prefault", "lazy"]) as daemon:
        yield daemon


def test_an_arena_past_the_nodes_memory_is_refused_and_the_daemon_lives(
        oversized_daemon: PrivateDaemon) -> None:
    log = Path(oversized_daemon.log_path).read_text()
    assert "event=arena_size_past_node_memory" in log
    too_big = node_memory().total_nbytes + GIB
    before = meminfo_field("Shmem")
    started = time.monotonic()
    with pytest.raises(OverBudgetError) as refused:
        OffloadClient.connect(oversized_daemon.socket_path, job="huge", arena_nbytes=too_big)
    message = str(refused.value)
    assert f"asks for a {too_big}-byte arena" in message
    assert "cut to what this node can pin" in message
    assert "offload_optimizer.device" in message and "ask for less" in message
    assert time.monotonic() - started < 10
    assert meminfo_field("Shmem") - before < GIB  # nothing was pinned on its way
    # The daemon serves on: a hello naming no size gets its share of what the node holds,
    # not of the 64 TiB budget, and one that fits is admitted as asked.
    with OffloadClient.connect(oversized_daemon.socket_path, job="auto") as client:
        stats = client.stats()
        assert 0 < stats["arena_nbytes"] <= node_memory().available_nbytes
        # The budget uids' fair shares divide: cut to what the node can pin at all.
        assert stats["budget_nbytes"] == node_memory().pinnable_nbytes // (2 << 20) * (2 << 20)
        samples = scrape(oversized_daemon)  # what the ArenaSizePastNodeMemory alert reads
        assert value(samples, "offloadd_arena_size_bytes") == 64 << 40
        assert value(samples, "offloadd_arena_budget_bytes") == stats["budget_nbytes"]
    status = subprocess.run([sys.executable, "-m", "offloadd", "status", "--socket",
                             oversized_daemon.socket_path], capture_output=True, text=True,
                            timeout=60)
    assert "arena budget " in status.stdout and "(arena_size 64.0 TiB: cut to what this node " \
        "can pin)" in status.stdout, status
    with OffloadClient.connect(oversized_daemon.socket_path, job="fits",
                               arena_nbytes=64 << 20) as client:
        client.put("x", b"abc")
        assert client.get("x") == b"abc"


class MemoryCgroup:
    """A child memory cgroup of this process's own, limited to 1 GiB (a container's
    ``--memory 1g``), and the processes started in it; all killed and the group removed
    at the end."""

    LIMIT = GIB

    def __init__(self) -> None:
        self.directory = self._make()
        self.processes: list[subprocess.Popen[str]] = []

    def _make(self) -> Path:
        name = f"offloadd-test-{uuid.uuid4().hex[:8]}"
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _h, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if controllers == "":
                mount, limit_file = Path("/sys/fs/cgroup"), "memory.max"
            elif "memory" in controllers.split(","):
                mount, limit_file = Path("/sys/fs/cgroup") / controllers, "memory.limit_in_bytes"
            else:
                continue
            directory = mount / path.lstrip("/") / name
            try:
                directory.mkdir()
            except OSError:
                continue
            try:
                (directory / limit_file).write_text(str(self.LIMIT))
            except OSError:
                directory.rmdir()
                continue
            return directory
        pytest.skip("cannot make a memory cgroup here (needs root and a writable hierarchy)")

    def start(self, *python_args: str) -> subprocess.Popen[str]:
        """``python *python_args`` inside the group (it joins before it execs); its stdin
        and stdout are pipes."""
        process = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {self.directory / "cgroup.procs"} && exec "$@"', "sh",
             sys.executable, *python_args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        self.processes.append(process)
        return process

    def daemon(self, socket_path: str, *args: str) -> subprocess.Popen[str]:
        daemon = self.start("-m", "offloadd", "serve", "--socket", socket_path, *args)
        assert daemon.stdout is not None
        assert daemon.stdout.readline().startswith("offloadd ready")
        return daemon

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.communicate(timeout=30)
        for _ in range(50):  # the group empties once its processes are reaped
            try:
                self.directory.rmdir()
                return
            except OSError:
                time.sleep(0.1)


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    group = MemoryCgroup()
    try:
        yield group
    finally:
        group.close()


def test_a_containers_memory_limit_bounds_the_arenas(tmp_path: Path,
                                                      cgroup: MemoryCgroup) -> None:
    """The daemon in a 1 GiB memory cgroup on a bigger host: a 2 GiB arena is refused
    naming the cgroup; a 256 MiB one is served."""
    socket_path = str(tmp_path / "d.sock")
    daemon = cgroup.daemon(socket_path, "--arena-size", "64GiB", "--arena-prefault", "lazy")
    with pytest.raises(OverBudgetError, match=f"cgroup {re.escape(str(cgroup.directory))}\\)"):
        OffloadClient.connect(socket_path, job="big", arena_nbytes=2 * GIB)
    with OffloadClient.connect(socket_path, job="small", arena_nbytes=256 << 20) as client:
        client.put("x", b"\0" * (1 << 20))
        assert client.get("x") == b"\0" * (1 << 20)
    assert daemon.poll() is None


HOG = """
import sys, time
block = bytearray(int(sys.argv[1]))  # zeroed: every page is taken
print("held", flush=True)
time.sleep(120)
"""


def test_backing_stops_before_the_node_runs_out(tmp_path: Path, cgroup: MemoryCgroup) -> None:
    """An arena admitted while memory was free, then a process taking most of it while the
    arena is backed (slowly here, 40 MB/s): the backing stops short of what arenas leave
    the node, and both the daemon and the other process live (in a 1 GiB memory cgroup:
    pinning the whole arena had its OOM killer end the daemon)."""
    socket_path = str(tmp_path / "d.sock")
    daemon = cgroup.daemon(socket_path, "--arena-size", "1GiB",
                           "--arena-prefault-rate", "40000000")
    with OffloadClient.connect(socket_path, job="slow", arena_nbytes=600 << 20) as client:
        hog = cgroup.start("-c", HOG, str(500 << 20))
        assert hog.stdout is not None
        assert hog.stdout.readline() == "held\n"
        deadline = time.monotonic() + 60
        while (stats := client.stats())["arena_backing"] == "backing":
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert stats["arena_backing"] == "failed", stats
        assert "available memory fell to" in stats["arena_backing_error"], stats
        assert stats["arena_backed_nbytes"] < 600 << 20
        client.put("x", b"still served")
        assert client.get("x") == b"still served"
    assert hog.poll() is None and daemon.poll() is None


RANK_AFTER_THE_HOG = """
import json, sys, time
from trainer.client import OffloadClient
socket_path, nbytes, job = sys.argv[1], int(sys.argv[2]), sys.argv[3]
client = OffloadClient.connect(socket_path, job=job, arena_nbytes=nbytes)
print("connected", flush=True)
sys.stdin.readline()  # another process now holds most of the group's memory
while (before := client.stats())["arena_backing"] == "backing":
    time.sleep(0.1)
"""
"""A rank's start in the 1 GiB group: its hello, then (told to go) the end of the backing;
the script it starts goes on from there and prints one JSON line."""


def short_node_args(prefault: str) -> list[str]:
    """A daemon whose arenas the hog finds half backed: a background prefault at 40 MB/s,
    or none (lazy)."""
    args = ["--arena-size", "1GiB", "--arena-prefault", prefault]
    return [*args, "--arena-prefault-rate", "40000000"] if prefault == "background" else args


def rank_after_the_hog(cgroup: MemoryCgroup, daemon: subprocess.Popen[str], socket_path: str,
                       body: str, nbytes: int, *args: str
                       ) -> tuple[dict[str, Any], subprocess.Popen[str], subprocess.Popen[str]]:
    """Start a rank (``RANK_AFTER_THE_HOG`` then ``body``) with a ``nbytes`` arena, then
    the hog taking 500 MiB of the group, then let the rank go on: (its JSON line, the
    rank, the hog)."""
    rank = cgroup.start("-c", RANK_AFTER_THE_HOG + body, socket_path, str(nbytes), *args)
    assert rank.stdout is not None and rank.stdin is not None
    assert rank.stdout.readline() == "connected\n"
    hog = cgroup.start("-c", HOG, str(500 << 20))
    assert hog.stdout is not None
    assert hog.stdout.readline() == "held\n"
    rank.stdin.write("go\n")
    rank.stdin.flush()
    line = rank.stdout.readline()
    assert line, f"the rank died (rc {rank.wait(timeout=30)}; daemon {daemon.poll()}, " \
        f"other process {hog.poll()})"
    return json.loads(line), rank, hog


FILL = """
from offloadd.errors import OverBudgetError
shard_nbytes = int(sys.argv[4])
count = nbytes // shard_nbytes

def fill(start):
    put, error = start, ""
    try:
        for index in range(start, count):
            client.put(f"s{index}", bytes([index % 251]) * shard_nbytes)
            put += 1
    except OverBudgetError as exc:
        error = str(exc)
    return put, error

def intact(put):
    return all(client.get(f"s{index}") == bytes([index % 251]) * shard_nbytes
               for index in range(put))
"""
"""A rank's ``fill(start)``: shards ``start``.. of its arena (``argv[4]`` bytes each) until
all are put or the daemon refuses one; ``intact(put)`` reads the first ``put`` back."""

FILLER = FILL + """
put, error = fill(0)
print(json.dumps({"before": before, "put": put, "error": error, "intact": intact(put),
                  "after": client.stats()}), flush=True)
client.close()
"""


@pytest.mark.parametrize("prefault", ["background", "lazy"])
@pytest.mark.parametrize("swap", [False, True], ids=["no-swap", "swap"])
def test_what_the_node_could_not_back_is_never_handed_out(
        tmp_path: Path, cgroup: MemoryCgroup, swap: bool, prefault: str) -> None:
    """As above, then the rank (in the same 1 GiB group) fills its whole 600 MiB arena:
    the pages the backing could not take are withheld (a lazy arena, which no thread
    backs: once a placement finds the node short). Without a swap tier the rank gets
    OverBudgetError naming them once the backed pages are used; with one, its shards go
    to NVMe and all 600 MiB are written and read back. Every process lives (handing the
    unbacked pages out had the group's OOM killer end the daemon or the other process)."""
    socket_path = str(tmp_path / "d.sock")
    args = short_node_args(prefault)
    if swap:
        args += ["--swap-dir", str(tmp_path / "swap")]
    daemon = cgroup.daemon(socket_path, *args)
    shard, count = 8 << 20, 75
    result, _rank, hog = rank_after_the_hog(cgroup, daemon, socket_path, FILLER, shard * count,
                                            "filled", str(shard))
    assert result["before"]["arena_backing"] == ("failed" if prefault == "background"
                                                 else "lazy"), result["before"]
    after = result["after"]
    assert after["arena_backing"] == "failed", after
    assert "available memory fell to" in after["arena_backing_error"], after
    withheld = after["arena_withheld_nbytes"]
    assert withheld > 0 and after["arena_nbytes"] - withheld < 600 << 20, after
    assert result["intact"], result
    if swap:
        assert result["put"] == count and not result["error"], result
        assert after["swap_used_nbytes"] > 0, after
    else:
        assert 0 < result["put"] < count, result
        assert "arena is full" in result["error"], result
        assert f"{withheld} bytes of it withheld: the node ran short of memory" \
            in result["error"], result
        assert result["put"] * shard <= after["arena_nbytes"] - withheld
    assert hog.poll() is None and daemon.poll() is None


REFILLER = FILL + """
put, error = fill(0)
print(json.dumps({"put": put, "error": error, "stats": client.stats()}), flush=True)
sys.stdin.readline()  # the other process has ended
deadline = time.monotonic() + 60
while put < count and time.monotonic() < deadline:
    put, error = fill(put)
    if put < count:
        time.sleep(0.5)
print(json.dumps({"put": put, "error": error, "intact": intact(put),
                  "stats": client.stats()}), flush=True)
client.close()
"""


def test_withheld_pages_come_back_once_the_process_that_took_them_ends(
        tmp_path: Path, cgroup: MemoryCgroup) -> None:
    """As above without a swap tier: the rank fills its 600 MiB arena, and gets
    OverBudgetError once only withheld pages are left. The other process then ends: at
    the rank's next tries the daemon finds the room back and hands the withheld pages out
    again, and the rank fills the whole arena, every shard intact, every process alive."""
    socket_path = str(tmp_path / "d.sock")
    daemon = cgroup.daemon(socket_path, *short_node_args("background"))
    shard, count = 8 << 20, 75
    short, rank, hog = rank_after_the_hog(cgroup, daemon, socket_path, REFILLER,
                                          shard * count, "refilled", str(shard))
    withheld = short["stats"]["arena_withheld_nbytes"]
    assert withheld > 0 and 0 < short["put"] < count, short
    assert f"{withheld} bytes of it withheld" in short["error"], short
    hog.kill()
    hog.wait(timeout=30)
    assert rank.stdin is not None and rank.stdout is not None
    rank.stdin.write("ended\n")
    rank.stdin.flush()
    line = rank.stdout.readline()
    assert line, f"the rank died (rc {rank.wait(timeout=30)}; daemon {daemon.poll()})"
    result = json.loads(line)
    stats = result["stats"]
    assert result["put"] == count and result["intact"], result
    assert stats["arena_withheld_nbytes"] == 0, stats
    assert stats["arena_restored_nbytes"] >= withheld, stats
    assert rank.wait(timeout=60) == 0 and daemon.poll() is None


FIRST_JOB = FILL + """
put, _error = fill(0)
print(json.dumps({"put": put, "stats": client.stats()}), flush=True)
sys.stdin.readline()
client.close_job()  # the job ends: its daemon frees its arena
"""


def test_two_daemons_that_admitted_too_much_hand_the_node_to_the_job_that_stays(
        tmp_path: Path, cgroup: MemoryCgroup) -> None:
    """Two private daemons on one node (two jobs without a node daemon) each admit a 600 MiB
    arena against the same free memory of the 1 GiB group: neither counts the other's
    pending pages. Both jobs fill their arenas: the node runs short, pages are withheld,
    and no process is killed. Then the first job ends: the second gets its withheld pages
    back at its next tries and fills its whole arena."""
    shard, count = 8 << 20, 75
    # Lazy arenas: no thread backs them, so the second hello finds the first arena's pages
    # not taken yet however late it comes (a background backing could have taken them).
    daemons = [cgroup.daemon(str(tmp_path / f"{name}.sock"), *short_node_args("lazy"))
               for name in ("a", "b")]
    first = cgroup.start("-c", RANK_AFTER_THE_HOG + FIRST_JOB, str(tmp_path / "a.sock"),
                         str(shard * count), "first", str(shard))
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline() == "connected\n"
    second = cgroup.start("-c", RANK_AFTER_THE_HOG + REFILLER, str(tmp_path / "b.sock"),
                          str(shard * count), "second", str(shard))
    assert second.stdout is not None and second.stdin is not None
    assert second.stdout.readline() == "connected\n"
    for rank in (first, second):  # both fill at once
        rank.stdin.write("go\n")
        rank.stdin.flush()
    lines = [first.stdout.readline(), second.stdout.readline()]
    assert all(lines), f"a rank died (rc {first.poll()}, {second.poll()}; daemons " \
        f"{[daemon.poll() for daemon in daemons]})"
    filled_first, short = (json.loads(line) for line in lines)
    assert filled_first["put"] + short["put"] < 2 * count, (filled_first, short)
    assert short["put"] < count and short["stats"]["arena_withheld_nbytes"] > 0, short
    first.stdin.write("end\n")
    first.stdin.flush()
    assert first.wait(timeout=60) == 0
    second.stdin.write("ended\n")
    second.stdin.flush()
    line = second.stdout.readline()
    assert line, f"the rank died (rc {second.wait(timeout=30)})"
    result = json.loads(line)
    assert result["put"] == count and result["intact"], result
    assert result["stats"]["arena_withheld_nbytes"] == 0, result["stats"]
    assert second.wait(timeout=60) == 0
    assert all(daemon.poll() is None for daemon in daemons)


RANK_PINS = """
import warnings
from trainer.device.copy_engine import TwinCopyEngine
from trainer.dist.collectives import Collectives
from trainer.offload.daemon_backend import DaemonBackend
twin = TwinCopyEngine()  # registers as cudaHostRegister does: every page faulted in
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backend = DaemonBackend(client, collectives=Collectives(), copies=twin)
client.put("x", b"served")
print(json.dumps({"pinned": backend.arena_pinned, "registered": sum(twin.registered.values()),
                  "warnings": [str(w.message) for w in caught], "x": client.get("x").decode(),
                  "stats": client.stats()}), flush=True)
backend.close()
twin.close()
"""


@pytest.mark.parametrize("prefault", ["background", "lazy"])
def test_a_rank_does_not_pin_pages_the_node_cannot_back(
        tmp_path: Path, cgroup: MemoryCgroup, prefault: str) -> None:
    """A rank's pin (cudaHostRegister, which the twin plays) faults in every page of its
    arena. In the 1 GiB group, once another process took most of the memory, the pages
    the daemon could not back (its watch stopped the backing) or never backed (a lazy
    arena) must not be faulted in by the rank instead: it skips the pin with a warning
    naming why, and copies still work. Pinning anyway had the group's OOM killer end
    the rank."""
    socket_path = str(tmp_path / "d.sock")
    daemon = cgroup.daemon(socket_path, *short_node_args(prefault))
    result, rank, hog = rank_after_the_hog(cgroup, daemon, socket_path, RANK_PINS, 600 << 20,
                                           "pinned")
    assert result["pinned"] == "skipped" and result["registered"] == 0, result
    assert result["x"] == "served"
    (message,) = [w for w in result["warnings"] if "not pinning" in w]
    if prefault == "background":
        assert result["stats"]["arena_backing"] == "failed", result["stats"]
        assert "the daemon stopped backing it, short of memory" in message
    else:
        assert "are not backed yet, past the" in message
        assert f"cgroup {cgroup.directory}" in message
    assert rank.wait(timeout=60) == 0
    assert hog.poll() is None and daemon.poll() is None


DAEMON_PINS = """
import fcntl, os
from offloadd import protocol as p
staging = os.memfd_create("staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
os.ftruncate(staging, p.twin_staging_nbytes(2, 4096))
fcntl.fcntl(staging, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
reply = client.request(p.StagingOpen(0, "twin", "twin-0", 2, 4096, staging_fd=staging))
client.put("x", b"served")
print(json.dumps({"path": reply.path, "reason": reply.reason, "x": client.get("x").decode(),
                  "stats": client.stats()}), flush=True)
client.close()
"""


def test_the_daemon_does_not_pin_pages_the_node_cannot_back(
        tmp_path: Path, cgroup: MemoryCgroup) -> None:
    """The same for daemon copies: at staging_open the daemon pins the job's arena in its
    own process (cudaHostRegister; the twin faults the pages in as it does). With the
    node short, it copies from pageable memory instead; faulting the withheld pages in
    had the group's OOM killer end a process."""
    socket_path = str(tmp_path / "d.sock")
    daemon = cgroup.daemon(socket_path, *short_node_args("background"))
    result, rank, hog = rank_after_the_hog(cgroup, daemon, socket_path, DAEMON_PINS,
                                           600 << 20, "daemon-pins")
    assert (result["path"], result["reason"], result["x"]) == ("daemon", "", "served"), result
    stats = result["stats"]
    assert stats["arena_backing"] == "failed", stats
    assert stats["arena_withheld_nbytes"] > 0, stats  # no page of them was faulted in
    assert stats["arena_allocated_nbytes"] + stats["arena_withheld_nbytes"] \
        <= stats["arena_nbytes"], stats
    assert rank.wait(timeout=60) == 0
    assert hog.poll() is None and daemon.poll() is None


def test_a_hugetlb_arena_counts_as_backed_for_pinning(huge_pages) -> None:
    """A hugetlb arena's pages were reserved from the pool at mmap (which MemAvailable
    leaves out): pinning it takes nothing more, however large it is against the node's
    room, so neither side skips the pin (a GPU node with a reserved pool kept its arenas
    unpinned otherwise)."""
    huge_pages(1)
    arena = Arena("huge-pin", 2 << 20, lock=False, hugepages="on", prefault="lazy")
    try:
        assert arena.hugepages and arena.allocated_nbytes() == arena.nbytes
        assert arena.pin_shortage() == ""
    finally:
        arena.close()
    past_the_node = 2 * node_memory().total_nbytes
    stats = {"arena_backing": "lazy", "arena_allocated_nbytes": 0, "arena_hugepages": True}
    assert DaemonBackend._pin_would_take_missing_memory(stats, past_the_node) == ""
    assert "are not backed yet" in DaemonBackend._pin_would_take_missing_memory(
        {**stats, "arena_hugepages": False}, past_the_node)
