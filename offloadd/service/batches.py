"""Large batches in slices: a request naming 200k shards must not hold the loop.

One acquire of 200k ids costs seconds of Python on the loop (lookup, conflict
check, lease, touch and reply per shard), which stalls every other job's
requests. Batches longer than ``SLICE_IDS`` are served ``SLICE_IDS`` ids at a
time with an ``await asyncio.sleep(0)`` between slices.

Allocs and puts (``alloc_sliced``) validate the whole batch first, then create it
a slice at a time, and undo a failed one a slice at a time; single-slice batches
keep the synchronous fast paths in jobs.py.

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
from typing import Protocol

from offloadd.memory.arena import align_up
from offloadd.memory.shards import Lease, Shard, ShardTable, check_shard_ids
from offloadd.protocol import Placed

SLICE_IDS = 2048
"""Ids handled per slice of a large batch (about 5-10 ms of loop time)."""


class Job(Protocol):
    """What slicing needs of a job: its one-slice operations (``offloadd.service.jobs.Job``,
    which calls into this module for batches longer than ``SLICE_IDS``)."""

    table: ShardTable

    def validate_batch(self, rank: int, ids: list[str], nbytes: list[int], dtypes: list[str],
                       fresh: dict[str, tuple[int, str]] | None = None
                       ) -> dict[str, tuple[int, str]]: ...

    def check_batch_fits(self, need_nbytes: int, new_nbytes: int, mode: str | None) -> None: ...

    def place_what_fits(self, shards: list[Shard], created: list[Shard]) -> Placed: ...

    def serve_batch(self, shards: list[Shard], leases: dict[Shard, Lease], mode: str
                    ) -> Placed | Awaitable[Placed]: ...

    def forget_unwritten(self, created: list[Shard]) -> None: ...

    def release_batch(self, rank: int, ids: list[str], dirty: bool,
                      leases: dict[Shard, Lease], torn: bool = False) -> None: ...

    def drop_batch(self, rank: int, ids: list[str]) -> Awaitable[None] | None: ...


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
            _extend(placed, result)
            await asyncio.sleep(0)
    except BaseException:
        # The undo runs to its end even if this request is cancelled (its session closed).
        await asyncio.shield(asyncio.ensure_future(_undo(job, granted, leases, [])))
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


async def alloc_sliced(job: Job, rank: int, ids: list[str], nbytes: list[int],
                       dtypes: list[str], leases: dict[Shard, Lease] | None,
                       mode: str | None) -> Placed:
    """``Job.alloc`` (and put, which leases what it creates) of a large batch, all or nothing.

    The whole batch is validated first, one slice at a time, and its total is checked
    against the arena, so a bad batch fails before anything exists. The shards are
    then created and placed (or leased) a slice at a time; if a later slice fails
    (no arena room, an id another session created meanwhile, a lease conflict) every
    lease taken is given back and every shard created is removed, freeing its range.
    """
    fresh: dict[str, tuple[int, str]] = {}
    seen: set[str] = set()
    need_nbytes = new_nbytes = 0
    for start in range(0, len(ids), SLICE_IDS):
        part = slice(start, start + SLICE_IDS)
        check_shard_ids(ids[part])
        job.validate_batch(rank, ids[part], nbytes[part], dtypes[part], fresh)
        for shard_id, size in zip(ids[part], nbytes[part]):
            if shard_id not in seen:
                seen.add(shard_id)
                need_nbytes += align_up(max(size, 1))
                if shard_id in fresh:
                    new_nbytes += align_up(max(size, 1))
        await asyncio.sleep(0)
    job.check_batch_fits(need_nbytes, new_nbytes, mode)
    created: dict[str, Shard] = {}
    granted: list[Shard] = []
    placed = Placed(0, [], [], [], [])
    try:
        for start in range(0, len(ids), SLICE_IDS):
            part = slice(start, start + SLICE_IDS)
            shards = _make_slice(job, rank, ids[part], nbytes[part], dtypes[part], fresh,
                                 created)
            if leases is None or mode is None:
                result: Placed | Awaitable[Placed] = job.place_what_fits(shards, [])
            else:
                result = job.serve_batch(shards, leases, mode)
            if not isinstance(result, Placed):
                result = await result
            if leases is not None and mode is not None:
                granted += shards
            _extend(placed, result)
            await asyncio.sleep(0)
    except BaseException:
        # The undo runs to its end even if this request is cancelled (its session closed).
        await asyncio.shield(asyncio.ensure_future(
            _undo(job, granted, leases, list(created.values()))))
        raise
    return placed


async def _undo(job: Job, granted: list[Shard], leases: dict[Shard, Lease] | None,
                created: list[Shard]) -> None:
    """Give back a failed batch's leases and remove the shards it created, a slice at a
    time: undoing 200k shards at once holds the loop for over a second."""
    for start in range(0, len(granted), SLICE_IDS):
        for shard in granted[start : start + SLICE_IDS]:
            if leases is not None and shard in leases:  # gone with a closed session
                job.table.give_back(leases, shard, dirty=False)
        await asyncio.sleep(0)
    for start in range(0, len(created), SLICE_IDS):
        job.forget_unwritten(created[start : start + SLICE_IDS])
        await asyncio.sleep(0)


def _make_slice(job: Job, rank: int, ids: list[str], nbytes: list[int], dtypes: list[str],
                fresh: dict[str, tuple[int, str]], created: dict[str, Shard]) -> list[Shard]:
    """The shards of one slice: created if validated as new, else looked up and matched.

    ``table.create`` raises ShardExistsError for an id another session created since
    the validation: the batch then fails as a whole rather than adopt its shard.
    """
    table = job.table
    shards = []
    for shard_id, size, dtype in zip(ids, nbytes, dtypes):
        shard = created.get(shard_id)
        if shard is None:
            if shard_id in fresh:
                shard = created[shard_id] = table.create(rank, shard_id, size, dtype)
            else:
                shard = table.get(rank, shard_id)  # dropped since the validation: unknown
                table.matches(shard, size, dtype)
        shards.append(shard)
    return shards


def _extend(placed: Placed, part: Placed) -> None:
    placed.offsets += part.offsets
    placed.nbytes += part.nbytes
    placed.versions += part.versions
    placed.dtypes += part.dtypes
