"""Large batches in slices: a request naming 200k shards must not hold the loop.

One acquire of 200k ids costs seconds of Python on the loop (lookup, conflict
check, lease, touch and reply per shard), which stalls every other job's
requests. Batches longer than ``SLICE_IDS`` are served ``SLICE_IDS`` ids at a
time with an ``await asyncio.sleep(0)`` between slices.

Hazard: other sessions run between slices. An acquire therefore re-checks each
slice when it leases it and, if any slice fails, gives back what the earlier
slices leased (clean), so the batch still succeeds or fails as a whole; other
sessions may meanwhile see those shards briefly leased. A release or drop that
fails mid-way keeps the slices already done (a release's ids are this session's
own leases, which no one else can take, so only a bad id fails it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from offloadd.protocol import Placed
from offloadd.shards import Lease, Shard

if TYPE_CHECKING:
    from offloadd.jobs import Job

SLICE_IDS = 2048
"""Ids handled per slice of a large batch (about 5-10 ms of loop time)."""


def _slices(ids: list[str]) -> list[list[str]]:
    return [ids[start : start + SLICE_IDS] for start in range(0, len(ids), SLICE_IDS)]


async def acquire_sliced(job: Job, rank: int, ids: list[str], mode: str,
                         leases: dict[Shard, Lease]) -> Placed:
    """``Job.acquire`` of a large batch, one slice at a time, all or nothing."""
    granted: list[Shard] = []
    placed = Placed(0, [], [], [], [])
    try:
        for part in _slices(ids):
            shards = job.table.lookup(rank, part)
            result = job.serve_batch(shards, leases, mode)
            if not isinstance(result, Placed):
                result = await result
            granted += shards
            placed.offsets += result.offsets
            placed.nbytes += result.nbytes
            placed.versions += result.versions
            placed.dtypes += result.dtypes
            await asyncio.sleep(0)
    except BaseException:
        for shard in granted:
            if shard in leases:  # a session that went away already gave back everything
                job.table.give_back(leases, shard, dirty=False)
        raise
    return placed


async def release_sliced(job: Job, rank: int, ids: list[str], dirty: bool,
                         leases: dict[Shard, Lease], torn: bool = False) -> None:
    for part in _slices(ids):
        job.release_batch(rank, part, dirty, leases, torn)
        await asyncio.sleep(0)


async def drop_sliced(job: Job, rank: int, ids: list[str]) -> None:
    for part in _slices(ids):
        pending: Awaitable[None] | None = job.drop_batch(rank, part)
        if pending is not None:
            await pending
        await asyncio.sleep(0)
