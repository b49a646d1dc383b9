"""When the swap tier writes: background write-back of a job that outgrows its arena,
none for a job that fits, and none ever for shards that were never written.

Each test runs its own daemon, so the daemon-wide swap counters are this test's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import connect_reserving

from offloadd.errors import OverBudgetError
from offloadd.memory.arena import HUGE_PAGE_NBYTES, free_huge_pages
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

MIB = 1 << 20
ARENA_NBYTES = 32 * MIB
SHARD_NBYTES = 4 * MIB
JOB = "writeback"


def start(tmp_path: Path, name: str = "d", *extra: str) -> PrivateDaemon:
    return PrivateDaemon.start(tmp_path / name, arena_size=2 * ARENA_NBYTES,
                               swap_dirs=[str(tmp_path / "swap")], extra_args=list(extra))


def connect(daemon: PrivateDaemon) -> OffloadClient:
    return OffloadClient.connect(daemon.socket_path, job=JOB, arena_nbytes=ARENA_NBYTES)


def swap_stats(client: OffloadClient) -> dict:
    return client.stats()["swap"]


def written(client: OffloadClient) -> int:
    return sum(d["written_nbytes"] for d in swap_stats(client)["dirs"])


def write_shards(client: OffloadClient, ids: list[str]) -> dict[str, bytes]:
    payloads = {}
    for shard_id in ids:
        payloads[shard_id] = os.urandom(SHARD_NBYTES)
        with client.acquire(shard_id, "w") as lease:
            lease.view[:] = payloads[shard_id]
    return payloads


def test_a_job_outgrowing_its_arena_writes_back_before_the_arena_fills(tmp_path: Path) -> None:
    with start(tmp_path) as daemon, connect(daemon) as client:
        ids = [f"s{i}" for i in range(2 * ARENA_NBYTES // SHARD_NBYTES)]
        client.alloc(ids, SHARD_NBYTES)  # twice the arena: eviction is certain
        # Three quarters of the arena: room is never short, so make_room never runs.
        payloads = write_shards(client, ids[:6])
        deadline = time.monotonic() + 30
        while written(client) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = swap_stats(client)
        assert written(client) > 0, stats
        assert stats["evictions"] == {}, "the write-back was not forced by a full arena"
        # The dirty shards needed soonest stay dirty: only the excess over a quarter
        # of the arena is written back early.
        assert written(client) <= 6 * SHARD_NBYTES - ARENA_NBYTES // 4
        for shard_id, payload in payloads.items():
            assert client.get(shard_id) == payload


def test_a_job_that_fits_its_arena_writes_nothing_until_flush(tmp_path: Path) -> None:
    with start(tmp_path) as daemon, connect(daemon) as client:
        ids = [f"s{i}" for i in range(ARENA_NBYTES // SHARD_NBYTES)]
        client.alloc(ids, SHARD_NBYTES)  # exactly the arena
        write_shards(client, ids)
        time.sleep(0.5)  # time enough for a background write-back to show
        assert written(client) == 0
        client.flush("fits")
        assert written(client) == ARENA_NBYTES


def test_never_written_shards_are_evicted_without_io_and_left_out_of_the_manifest(
        tmp_path: Path) -> None:
    blank = [f"blank{i}" for i in range(ARENA_NBYTES // SHARD_NBYTES)]
    used = [f"used{i}" for i in range(ARENA_NBYTES // SHARD_NBYTES)]
    with start(tmp_path) as daemon, connect(daemon) as client:
        client.alloc(blank, SHARD_NBYTES)  # fills the arena; never written
        client.alloc(used, SHARD_NBYTES)
        payloads = write_shards(client, used)  # room for these evicts every blank one
        assert client.stats()["residency"]["nvme"] >= len(blank)
        client.flush("blanks")
        # Only the written shards ever reached swap, each once.
        assert written(client) == len(used) * SHARD_NBYTES
        manifest = json.loads(next((tmp_path / "swap").rglob("manifest.json")).read_text())
        chunks = {entry["id"]: entry["chunks"] for entry in manifest["shards"]}
        # Issue 12, defect 5: a shard allocated but never committed is not named.
        assert not set(blank) & set(chunks)
        assert all(chunks[i] for i in used)
        with client.acquire(blank[0]) as lease:  # placed again on first use
            assert len(lease.view) == SHARD_NBYTES
    with start(tmp_path, "again", "--recover") as daemon, connect(daemon) as client:
        assert client.stats()["num_shards"] == len(used)
        for shard_id, payload in payloads.items():
            assert client.get(shard_id) == payload
        client.alloc([blank[-1]], SHARD_NBYTES)  # allocated again after the restart
        with client.acquire(blank[-1], "w") as lease:
            lease.view[:] = b"\x01" * SHARD_NBYTES
        assert client.get(blank[-1]) == b"\x01" * SHARD_NBYTES


# -- a hugetlb arena -----------------------------------------------------------------------


def test_a_hugetlb_arena_serves_and_swaps_like_any_other(tmp_path: Path, huge_pages) -> None:
    with start(tmp_path, "d", "--arena-hugepages", "on") as daemon, connect_reserving(
            daemon.socket_path, huge_pages, job=JOB, arena_nbytes=ARENA_NBYTES) as client:
        stats = client.stats()
        assert stats["arena_hugepages"] and stats["arena_nbytes"] == ARENA_NBYTES
        ids = [f"s{i}" for i in range(2 * ARENA_NBYTES // SHARD_NBYTES)]
        client.alloc(ids, SHARD_NBYTES)
        payloads = write_shards(client, ids)  # twice the arena: half goes to swap
        for shard_id in ids:
            assert client.get(shard_id) == payloads[shard_id]
        assert written(client) >= ARENA_NBYTES


def test_arena_hugepages_on_without_the_pages_fails_the_hello_not_the_daemon(
        tmp_path: Path, huge_pages: Callable[[int], None]) -> None:
    """``huge_pages`` only holds the pool's lock: a test of another process growing the
    pool between the count and the hello let the arena be made (1 run in ~20 of this file
    beside test_swap_bounce.py)."""
    free = free_huge_pages()
    if free > 64:
        pytest.skip(f"{free} free huge pages: too many to exhaust in a test")
    nbytes = (free + 1) * HUGE_PAGE_NBYTES
    with PrivateDaemon.start(tmp_path / "d", arena_size=nbytes + ARENA_NBYTES,
                             extra_args=["--arena-hugepages", "on"]) as daemon:
        with pytest.raises(OverBudgetError, match=r"vm\.nr_hugepages"):
            OffloadClient.connect(daemon.socket_path, job="greedy", arena_nbytes=nbytes)
        assert daemon.process.poll() is None
        with pytest.raises(OverBudgetError):  # nothing half-made was left behind
            OffloadClient.connect(daemon.socket_path, job="greedy", arena_nbytes=nbytes)


# -- swap usage per job ----------------------------------------------------------------------


def test_swap_usage_is_reported_per_job(tmp_path: Path) -> None:
    with start(tmp_path) as daemon, connect(daemon) as big, \
            OffloadClient.connect(daemon.socket_path, job="small",
                                  arena_nbytes=ARENA_NBYTES) as small:
        big_ids = [f"b{i}" for i in range(3 * ARENA_NBYTES // SHARD_NBYTES)]
        big.alloc(big_ids, SHARD_NBYTES)
        write_shards(big, big_ids)
        small.alloc(["only"], SHARD_NBYTES)
        write_shards(small, ["only"])
        big.flush("big")
        small.flush("small")
        big_stats, small_stats = big.stats(), small.stats()
        # Every shard of each job has a swap copy after its flush, and nothing more
        # (no flush came before these, so no old copy is kept).
        assert big_stats["swap_used_nbytes"] == len(big_ids) * SHARD_NBYTES
        assert small_stats["swap_used_nbytes"] == SHARD_NBYTES
        swap_files = {job: sum(f.stat().st_size for f in (tmp_path / "swap").rglob("swap.*")
                               if f.parent.name == job) for job in (JOB, "small")}
        assert big_stats["swap_reserved_nbytes"] == swap_files[JOB]
        assert small_stats["swap_reserved_nbytes"] == swap_files["small"]
        # The dir's total is the sum of its jobs' files.
        assert big_stats["swap"]["dirs"][0]["reserved_nbytes"] == sum(swap_files.values())
