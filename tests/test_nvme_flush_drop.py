"""A flush racing a drop from another rank of the job (found by four ZeRO-3 ranks with
NVMe offload saving a checkpoint: one rank's flush writes the whole job back while
another rank drops its consumed gradient shards). A shard dropped after the flush listed
it dirty but before its write-back started must be skipped, not written from a freed
arena range (it failed ``assert shard.offset is not None`` and the flush errored).

The daemon's job, arena and swap tier run in-process here so the interleaving is exact.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

from offloadd.config import DaemonConfig
from offloadd.memory.shards import Lease
from offloadd.metrics import DaemonMetrics
from offloadd.service.registry import JobRegistry
from offloadd.swap.nvme import SwapSpace
from offloadd.swap.tier import open_tier

SHARD_NBYTES = 1 << 20


async def flush_while_a_peer_drops(tmp_path: Path) -> tuple[int, bool]:
    config = DaemonConfig(socket=str(tmp_path / "s"), arena_size=64 << 20,
                          swap_dirs=[str(tmp_path / "swap")], mlock=False,
                          arena_hugepages="off")
    space = SwapSpace(config, DaemonMetrics())
    await space.open()
    registry = JobRegistry(config.arena_size, 0.5, lock=False, hugepages="off")
    job, _ = registry.open("job", 16 << 20, lambda: open_tier(space, "job"))
    try:
        leases: dict[object, Lease] = {}
        for rank in (0, 1):
            ids = [f"u{index}.grad" for index in range(3)]
            placed = job.alloc(rank, ids, [SHARD_NBYTES] * 3, ["float32"] * 3, leases, "w")
            if inspect.isawaitable(placed):
                await placed
            job.release(rank, ids, True, leases)  # type: ignore[arg-type]
        flush = asyncio.ensure_future(job.flush("ckpt"))
        await asyncio.sleep(0)  # the flush has listed every dirty shard, written none
        dropped = job.drop(1, ["u0.grad", "u1.grad", "u2.grad"])
        if dropped is not None:
            await dropped
        written = await flush
        return written, all(job.table.shards.get((1, f"u{i}.grad")) is None for i in range(3))
    finally:
        await space.close()
        registry.close()


def test_a_flush_skips_shards_a_peer_dropped_before_their_write_back(tmp_path: Path) -> None:
    written, gone = asyncio.run(asyncio.wait_for(flush_while_a_peer_drops(tmp_path), 30))
    assert gone
    assert written == 3  # rank 0's shards; rank 1's were dropped, nothing to persist
