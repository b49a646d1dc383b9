"""The eviction index picks exactly the victims a scan of the whole table would.

An in-process job with a real swap tier (real swap files, the python IO engine) and
an arena a fraction of its shards runs a random workload of two ranks: batched
acquires for reading and writing, dirty, clean and torn releases, leases held
across requests, drops and re-creations, prefetches and step boundaries (so both
ranks' access traces drive next-use order). Every pick the tier makes is checked,
as it is made, against ``pick_victims`` over a brute-force scan (the code the index
replaced); after every operation the index's candidates, byte counts and IO in
flight are compared with the scan's too.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import pytest

from offloadd.config import DaemonConfig
from offloadd.errors import OffloadError
from offloadd.memory.eviction import SYNC_SLICE, EvictionIndex
from offloadd.memory.shards import IN_ARENA, Lease, Residency, Shard, ShardTable
from offloadd.memory.trace import pick_victims
from offloadd.metrics import DaemonMetrics
from offloadd.protocol import Placed
from offloadd.service.batches import SLICE_IDS
from offloadd.service.jobs import Job
from offloadd.service.registry import JobRegistry
from offloadd.swap.nvme import SwapSpace
from offloadd.swap.tier import JobTier, open_tier

KIB = 1 << 10
PAGE = 4096
ARENA_NBYTES = 256 * KIB
NUM_SHARDS = int(os.environ.get("OFFLOADD_TEST_EVICTION_SHARDS", "60"))
NUM_OPS = int(os.environ.get("OFFLOADD_TEST_EVICTION_OPS", "1500"))


def scan(tier: JobTier, table: ShardTable) -> list[tuple[Shard, float]]:
    """The candidates a pass over every shard finds (what the index replaced)."""
    return [(shard, tier.next_use_s(shard)) for shard in table.shards.values()
            if shard.io is None and shard.residency in IN_ARENA and not shard.pins
            and not shard.leased]


def reference_pick(candidates: list[tuple[Shard, float]], dirty: bool, need_nbytes: int,
                   floor: float | None, above: float | None, skip: Container[Shard]
                   ) -> list[Shard]:
    pool = [(s, t) for s, t in candidates
            if (s.residency is Residency.ARENA_DIRTY) == dirty and s not in skip
            and (floor is None or t >= floor)]
    return pick_victims(pool, need_nbytes, above)


class Checked:
    """Wraps ``EvictionIndex.pick``: every pick is compared with the scan's as it is made."""

    def __init__(self, tier: JobTier, table: ShardTable) -> None:
        self.tier, self.table = tier, table
        self.picks = 0
        self.nonempty = 0
        self.real_pick = EvictionIndex.pick

    def pick(self, index: EvictionIndex, dirty: bool, need_nbytes: int, *,
             floor: float | None = None, above: float | None = None,
             skip: Container[Shard] = ()) -> list[tuple[Shard, float]]:
        expected = reference_pick(scan(self.tier, self.table), dirty, need_nbytes, floor,
                                  above, skip)
        got = self.real_pick(index, dirty, need_nbytes, floor=floor, above=above, skip=skip)
        assert [s for s, _t in got] == expected, (dirty, need_nbytes, floor, above)
        assert all(t == self.tier.next_use_s(s) for s, t in got)
        self.picks += 1
        self.nonempty += bool(got)
        return got


def check_state(tier: JobTier, table: ShardTable, rng: random.Random) -> None:
    """The index agrees with a scan on everything the tier asks of it."""
    index = tier._index(table)
    candidates = scan(tier, table)
    for dirty in (False, True):
        everything = reference_pick(candidates, dirty, 1 << 62, None, None, ())
        assert [s for s, _t in index.pick(dirty, 1 << 62)] == everything
        assert index.candidate_nbytes(dirty) == sum(s.arena_nbytes for s in everything)
        times = [t for s, t in candidates if (s.residency is Residency.ARENA_DIRTY) == dirty]
        assert index.furthest_next_use(dirty) == (max(times) if times else None)
        finite = [t for t in times if t != float("inf")]
        floor = rng.choice(finite) if finite else None
        need = rng.randrange(1, 64 * KIB)
        skip = {s for s, _t in candidates if rng.random() < 0.2}
        for bound, above, skipped in ((floor, None, ()), (None, floor, ()), (None, None, skip)):
            expected = reference_pick(candidates, dirty, need, bound, above, skipped)
            got = index.pick(dirty, need, floor=bound, above=above, skip=skipped)
            assert [s for s, _t in got] == expected
    progress = {shard.io for shard in table.shards.values() if shard.io is not None
                and shard not in tier.cleaning
                and (shard.offset is not None or shard.residency is Residency.WRITING)}
    assert set(tier._io_progress(table)) == progress


async def workload(root: Path, seed: int, checked_picks: list[Checked]) -> None:
    config = DaemonConfig(swap_dirs=[str(root / "nvme0")], io_engine="python",
                          chunk_size=16 * KIB, mlock=False, arena_hugepages="off")
    space = SwapSpace(config, DaemonMetrics())
    await space.open()
    registry = JobRegistry(4 * ARENA_NBYTES, 1.0, lock=False)
    job, _ = registry.open("index", ARENA_NBYTES, make_tier=lambda: open_tier(space, "index"))
    tier = job.tier
    assert isinstance(tier, JobTier)
    checked = Checked(tier, job.table)
    checked_picks.append(checked)
    original = EvictionIndex.pick
    EvictionIndex.pick = lambda index, *args, **kwargs: checked.pick(index, *args, **kwargs)  # type: ignore[method-assign]
    try:
        await run_ops(job, tier, random.Random(seed))
    finally:
        EvictionIndex.pick = original  # type: ignore[method-assign]
        await space.close()
        registry.close()


async def run_ops(job: Job, tier: JobTier, rng: random.Random) -> None:
    ranks = (0, 1)
    leases: dict[int, dict[Shard, Lease]] = {rank: {} for rank in ranks}
    held: dict[int, list[tuple[str, str]]] = {rank: [] for rank in ranks}
    sizes = {f"s{i}": rng.choice([4, 8, 12, 16, 24]) * KIB - rng.randrange(2) for i in
             range(NUM_SHARDS)}
    order = {rank: list(sizes) for rank in ranks}
    position = dict.fromkeys(ranks, 0)
    for rank in ranks:
        job.step_begin(rank)

    async def settle(result: Any) -> Any:
        return result if isinstance(result, Placed) or result is None else await result

    for _op in range(NUM_OPS):
        rank = rng.choice(ranks)
        roll = rng.random()
        try:
            if roll < 0.55:  # the rank's next shards, mostly in its learned order
                count = rng.randrange(1, 4)
                start = position[rank]
                ids = list(dict.fromkeys(order[rank][(start + k) % NUM_SHARDS]
                                         for k in range(count)))
                position[rank] = (start + count) % NUM_SHARDS
                if rng.random() < 0.1:
                    ids = [rng.choice(order[rank])]
                mode = "w" if rng.random() < 0.4 else "r"
                await settle(job.alloc(rank, ids, [sizes[i] for i in ids],
                                       ["uint8"] * len(ids), leases[rank], mode))
                held[rank] += [(i, mode) for i in ids]
            elif roll < 0.8 and held[rank]:
                shard_id, mode = held[rank].pop(rng.randrange(len(held[rank])))
                dirty = mode == "w" and rng.random() < 0.8
                torn = mode == "w" and not dirty and rng.random() < 0.3
                await settle(job.release(rank, [shard_id], dirty, leases[rank], torn=torn))
            elif roll < 0.85:
                job.step_begin(rank)
                position[rank] = 0
                if rng.random() < 0.3:  # the order changes a little between steps
                    a, b = rng.randrange(NUM_SHARDS), rng.randrange(NUM_SHARDS)
                    order[rank][a], order[rank][b] = order[rank][b], order[rank][a]
            elif roll < 0.9:
                ids = [rng.choice(order[rank])]
                if (rank, ids[0]) in job.table.shards and ids[0] not in dict(held[rank]):
                    await settle(job.drop(rank, ids))
            elif roll < 0.95:
                ids = [i for i in rng.sample(order[rank], 3) if (rank, i) in job.table.shards]
                job.prefetch(rank, ids, rng.random() * 0.01)
            else:
                await asyncio.sleep(0.002 * rng.random())  # write-behind and prefetch run
        except OffloadError:
            pass  # conflicts and over-budget are part of the workload, not of the check
        await asyncio.sleep(0)
        check_state(tier, job.table, rng)
    for rank in ranks:
        for shard_id, _mode in held[rank]:
            await settle(job.release(rank, [shard_id], False, leases[rank]))
    await tier.quiesce()
    check_state(tier, job.table, rng)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_index_picks_what_a_scan_of_the_table_would(
        tmp_path: Path, run_async: Callable[..., Any], seed: int) -> None:
    checked: list[Checked] = []
    run_async(workload(tmp_path, seed, checked), timeout_s=120)
    # The workload must make the tier evict, or the comparison proves nothing.
    assert checked[0].nonempty > 50, (checked[0].picks, checked[0].nonempty)


def test_a_large_backlog_is_rekeyed_a_slice_at_a_time(
        tmp_path: Path, run_async: Callable[..., Any]) -> None:
    """The first eviction of a job with many shards (the index is made: every shard is
    in its backlog), and one after a pass over every resident shard, re-key at most
    about ``SYNC_SLICE`` shards between two turns of the loop."""
    num_pages = 2 * SYNC_SLICE
    ids = [f"s{i}" for i in range(2 * num_pages)]

    async def scenario() -> None:
        config = DaemonConfig(swap_dirs=[str(tmp_path / "nvme0")], io_engine="python",
                              mlock=False, arena_hugepages="off")
        space = SwapSpace(config, DaemonMetrics())
        await space.open()
        registry = JobRegistry(num_pages * PAGE, 1.0, lock=False)
        job, _ = registry.open("backlog", num_pages * PAGE,
                               make_tier=lambda: open_tier(space, "backlog"))
        refreshes, longest = [0], [0]
        real_refresh = EvictionIndex._refresh

        def counting_refresh(index: EvictionIndex, shard: Shard) -> None:
            refreshes[0] += 1
            real_refresh(index, shard)

        async def ticker(stop: asyncio.Event) -> None:
            seen = refreshes[0]
            while not stop.is_set():
                await asyncio.sleep(0)
                longest[0] = max(longest[0], refreshes[0] - seen)
                seen = refreshes[0]

        async def evicting_acquire(shard_id: str) -> None:
            stop = asyncio.Event()
            ticking = asyncio.ensure_future(ticker(stop))
            await asyncio.sleep(0)
            leases: dict[Shard, Lease] = {}
            result = job.acquire(0, [shard_id], "r", leases)
            assert not isinstance(result, Placed), "the shard was resident: no eviction"
            await result
            job.release(0, [shard_id], False, leases)
            stop.set()
            await ticking

        EvictionIndex._refresh = counting_refresh  # type: ignore[method-assign, assignment]
        try:
            for start in range(0, len(ids), SLICE_IDS):
                part = ids[start:start + SLICE_IDS]
                assert isinstance(job.alloc(0, part, [PAGE] * len(part), ["uint8"] * len(part)),
                                  Placed)
            await evicting_acquire(ids[-1])
            first = refreshes[0]
            assert first >= len(ids)  # the whole table was re-keyed once...
            assert longest[0] <= SYNC_SLICE + 16, longest  # ...a slice per loop turn
            resident = [i for i in ids if job.table.shards[(0, i)].in_arena]
            leases: dict[Shard, Lease] = {}
            for start in range(0, len(resident), SLICE_IDS):  # touch every resident shard
                part = resident[start:start + SLICE_IDS]
                assert isinstance(job.acquire(0, part, "r", leases), Placed)
                job.release(0, part, False, leases)
            longest[0] = 0
            await evicting_acquire(next(i for i in ids if not job.table.shards[(0, i)].in_arena))
            assert refreshes[0] - first >= len(resident)
            assert longest[0] <= SYNC_SLICE + 16, longest
        finally:
            EvictionIndex._refresh = real_refresh  # type: ignore[method-assign]
            await space.close()
            registry.close()

    run_async(scenario())
