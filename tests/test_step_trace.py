"""A queued optimizer step's accesses enter its rank's access trace once, in the rank's
program order (``JobTier.expect``), and never again when the daemon's worker leases them.

The worker's acquire ran whenever the queue got to it. Recorded there too, every
optimizer shard stood in the trace twice, once a unit or two after the other, and the
next step's cursor, matching the later copy, took a freshly put gradient as not needed
until the following step: it was written to swap and read straight back
(tests/_zero_steps.py, 36 units, arena 3/8 of the working set: 1.2-1.7x the bytes
that do not fit read per step, a gradient in every step; 1.05-1.2x and none since).
The resident case (every shard of the step in the arena, the acquire's fast path)
was the one recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _tier_job import settle, tier_job

from offloadd.memory.shards import Lease, Shard
from offloadd.swap.tier import JobTier

KIB = 1 << 10
SHARD_NBYTES = 16 * KIB
STEP_KINDS = ("grad", "master", "exp_avg", "exp_avg_sq")


async def worker_acquire_is_not_traced(root: Path, arena_units: int) -> list[str]:
    """Two steps of a 4-unit rank whose arena holds ``arena_units`` units; returns the
    second step's trace (shard ids in recorded order)."""
    arena = arena_units * (1 + len(STEP_KINDS)) * SHARD_NBYTES
    async with tier_job(root, "trace", arena, chunk_nbytes=16 * KIB) as job:
        tier = job.tier
        assert isinstance(tier, JobTier)
        units = [f"u{n}" for n in range(4)]
        ids = [f"{u}.{kind}" for u in units for kind in ("param", *STEP_KINDS)]
        await settle(job.alloc(0, ids, [SHARD_NBYTES] * len(ids), ["uint8"] * len(ids)))
        for _step in range(2):
            job.step_begin(0)
            leases: dict[Shard, Lease] = {}
            for unit in units:
                await settle(job.acquire(0, [f"{unit}.param"], "r", leases))
                await settle(job.release(0, [f"{unit}.param"], False, leases))
            for unit in reversed(units):
                step_ids = [f"{unit}.{kind}" for kind in STEP_KINDS]
                shards = job.table.lookup(0, step_ids)
                job.expect_step(0, shards, shards, due_s=0.0)
                worker: dict[Shard, Lease] = {}
                await settle(job.acquire_for_step(0, step_ids, worker))
                job.unexpect_step(shards)
                await settle(job.release(0, step_ids, True, worker))
            await tier.quiesce()
        return [shard.shard_id for shard, _t in tier.traces[0].current]


@pytest.mark.parametrize("arena_units", [4, 1], ids=["resident", "swapping"])
def test_a_steps_shards_are_traced_once_in_program_order(
        tmp_path: Path, run_async: Callable[..., Any], arena_units: int) -> None:
    trace = run_async(worker_acquire_is_not_traced(tmp_path, arena_units), timeout_s=60)
    forward = [f"u{n}.param" for n in range(4)]
    steps = [f"u{n}.{kind}" for n in reversed(range(4)) for kind in STEP_KINDS]
    assert trace == forward + steps
