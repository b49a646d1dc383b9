"""Victim selection on the acquire slow path: the eviction index vs a scan of the table.

    python bench/eviction_index.py [--shards 10000,100000] [--arena-pages 1024] [--requests 3000]

An in-process job with a real swap tier (one swap dir in a temp directory) and an
arena of ``--arena-pages`` 4 KiB pages holds ``--shards`` one-page shards, most of
them not resident. Never-written shards need no swap IO, so every acquire of a
non-resident one costs exactly what this measures: a ``make_room`` that picks and
evicts one clean victim, then the placement. A ``step_begin`` every 1,000 acquires
gives the rank an access trace, so next-use order is in play.

- ours_us_per_evicting_acquire: one ``acquire`` ('r') + ``release`` that evicts.
- index_pick_us / scan_pick_us: choosing one victim at the same state, by the
  index (``EvictionIndex.pick``) and by the scan it replaced (every shard's
  candidacy and next use, then ``pick_victims``), the peer.

The last line printed is one JSON object; ``ratio_vs_table_scan_<shards>`` is
scan_pick_us / index_pick_us (> 1: the index is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from offloadd.config import DaemonConfig
from offloadd.memory.shards import IN_ARENA, Lease, Residency, Shard
from offloadd.memory.trace import pick_victims
from offloadd.metrics import DaemonMetrics
from offloadd.protocol import Placed
from offloadd.service.registry import JobRegistry
from offloadd.swap.nvme import SwapSpace
from offloadd.swap.tier import JobTier, open_tier

PAGE = 4096


def scan_pick(tier: JobTier, shards: dict[tuple[int, str], Shard]) -> list[Shard]:
    """The victim a scan of the whole table picks (what make_room did per pass)."""
    clean = [(s, tier.next_use_s(s)) for s in shards.values()
             if s.io is None and s.residency in IN_ARENA and not s.pins and not s.leased
             and s.residency is Residency.ARENA_CLEAN]
    return pick_victims(clean, PAGE)


async def measure(num_shards: int, arena_pages: int, requests: int, root: Path
                  ) -> dict[str, float]:
    config = DaemonConfig(swap_dirs=[str(root)], io_engine="python", mlock=False,
                          arena_hugepages="off")
    space = SwapSpace(config, DaemonMetrics())
    await space.open()
    registry = JobRegistry(arena_pages * PAGE, 1.0, lock=False)
    job, _ = registry.open("bench", arena_pages * PAGE, make_tier=lambda: open_tier(space, "bench"))
    tier = job.tier
    assert isinstance(tier, JobTier)
    ids = [f"s{i}" for i in range(num_shards)]
    for start in range(0, num_shards, 2048):
        part = ids[start:start + 2048]
        result = job.alloc(0, part, [PAGE] * len(part), ["uint8"] * len(part))
        if not isinstance(result, Placed):
            await result
    leases: dict[Shard, Lease] = {}
    job.step_begin(0)
    timings, index_picks, scan_picks = [], [], []
    for n in range(requests):
        shard_id = ids[(arena_pages + n * 7) % num_shards]
        if n % 1000 == 999:
            job.step_begin(0)
        started = time.perf_counter()
        result = job.acquire(0, [shard_id], "r", leases)
        if not isinstance(result, Placed):
            await result
        job.release(0, [shard_id], False, leases)
        timings.append(time.perf_counter() - started)
        if n % 50 == 0:
            index = tier._index(job.table)
            started = time.perf_counter()
            picked = [s for s, _t in index.pick(False, PAGE)]
            index_picks.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert scan_pick(tier, job.table.shards) == picked
            scan_picks.append(time.perf_counter() - started)
    await space.close()
    registry.close()
    index_us = statistics.median(index_picks) * 1e6
    scan_us = statistics.median(scan_picks) * 1e6
    return {"ours_us_per_evicting_acquire": round(statistics.median(timings) * 1e6, 2),
            "index_pick_us": round(index_us, 2), "scan_pick_us": round(scan_us, 1),
            "ratio_vs_table_scan": round(scan_us / index_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", default="10000,100000")
    parser.add_argument("--arena-pages", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    summary: dict[str, object] = {"arena_pages": args.arena_pages, "requests": args.requests}
    for num_shards in (int(n) for n in args.shards.split(",")):
        with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
            figures = asyncio.run(measure(num_shards, args.arena_pages, args.requests,
                                          Path(root)))
        print(f"shards={num_shards}: {figures}", flush=True)
        for key, value in figures.items():
            summary[f"{key}_{num_shards}"] = value
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
