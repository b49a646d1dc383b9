"""The background write-back (write-behind) of one job's NVMe tier keeps going after a
burst of releases: an in-process job on real swap files, with a gate on its writes.

A job whose shards outgrow its arena has every dirty shard past the quarter of the arena
it keeps dirty (``TierEviction._clean_background``) written back in the background, so
that a later request finds clean room instead of waiting for a write. Releases that
arrive while the write-behind is at its cap used to be forgotten (the pass that found no
room still reset the count of bytes dirtied, and a pass stopped by the cap was never
resumed), so when the writes in flight ended nothing started the next ones: the rest
stayed dirty until a request needed their room. A daemon-process bench saw it now and
then (45 of 47 written back after 63 concurrent puts); the gate makes it certain.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _tier_job import settle, tier_job
from test_crash_commit import until

from offloadd.memory.shards import Lease, Residency, Shard
from offloadd.service.jobs import Job

KIB = 1 << 10
SHARD_NBYTES = 64 * KIB  # one chunk each
ARENA_SHARDS = 16


def test_releases_during_a_full_write_behind_are_written_back_once_it_drains(
        tmp_path: Path, run_async: Callable[..., Any]) -> None:
    async def body() -> None:
        async with tier_job(tmp_path, "behind", ARENA_SHARDS * SHARD_NBYTES,
                            chunk_nbytes=SHARD_NBYTES) as job:
            ids = [f"s{i}" for i in range(2 * ARENA_SHARDS)]  # twice the arena
            await settle(job.alloc(0, ids, [SHARD_NBYTES] * len(ids), ["uint8"] * len(ids)))
            assert job.table.overcommitted()
            tier, space = job.tier, job.tier.space
            cap = tier.write_behind_nbytes(job.table) // SHARD_NBYTES
            kept = job.table.arena.nbytes // 4 // SHARD_NBYTES  # the dirty it leaves dirty
            writes_open, held = asyncio.Event(), []
            real_io = space.io

            async def gated_io(op: str, *args: Any, **kwargs: Any) -> int | None:
                if op == "write":
                    held.append(args)
                    await writes_open.wait()
                return await real_io(op, *args, **kwargs)

            space.io = gated_io
            put = ids[:ARENA_SHARDS - 1]  # they all fit: no request ever needs room
            for index, shard_id in enumerate(put):
                await write(job, shard_id, bytes([index + 1]) * SHARD_NBYTES)
            await until(lambda: len(held) == cap)  # the write-behind is at its cap, held
            assert len(tier.cleaning) == cap
            writes_open.set()
            expected = len(put) - kept
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    until(lambda: not tier.cleaning and clean(job, put) >= expected), 5)
            assert clean(job, put) == expected, (
                f"{clean(job, put)} of {len(put)} dirty shards written back ({cap} were in "
                f"flight when the writes were let go): all but the {kept} kept dirty should be")
            for index, shard_id in enumerate(put):  # and their bytes are the ones put
                assert await read(job, shard_id) == bytes([index + 1]) * SHARD_NBYTES

    run_async(body())


async def write(job: Job, shard_id: str, data: bytes) -> None:
    leases: dict[Shard, Lease] = {}
    await settle(job.acquire(0, [shard_id], "w", leases))
    shard = job.table.get(0, shard_id)
    assert shard.offset is not None
    job.arena.slice(shard.offset, len(data))[:] = data
    await settle(job.release(0, [shard_id], True, leases))


async def read(job: Job, shard_id: str) -> bytes:
    leases: dict[Shard, Lease] = {}
    await settle(job.acquire(0, [shard_id], "r", leases))
    shard = job.table.get(0, shard_id)
    assert shard.offset is not None
    data = bytes(job.arena.slice(shard.offset, shard.nbytes))
    await settle(job.release(0, [shard_id], False, leases))
    return data


def clean(job: Job, ids: list[str]) -> int:
    """How many of ``ids`` are in the arena and on swap alike."""
    return sum(1 for shard_id in ids
               if job.table.get(0, shard_id).residency is Residency.ARENA_CLEAN)
