"""An in-process job with a real swap tier (swap files, the python IO engine), no daemon
process: for tests that drive ``Job`` and ``JobTier`` calls directly."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from offloadd.config import DaemonConfig
from offloadd.metrics import DaemonMetrics
from offloadd.protocol import Placed
from offloadd.service.jobs import Job
from offloadd.service.registry import JobRegistry
from offloadd.swap.nvme import SwapSpace
from offloadd.swap.tier import open_tier


async def settle(result: Placed | Awaitable[Any] | None) -> Any:
    """A job call's outcome: at once when it is ready, else awaited."""
    return result if isinstance(result, Placed) or result is None else await result


@contextlib.asynccontextmanager
async def tier_job(root: Path, name: str, arena_nbytes: int,
                   chunk_nbytes: int) -> AsyncIterator[Job]:
    """Job ``name`` with an arena of ``arena_nbytes``, swapping to ``root / "nvme0"``."""
    config = DaemonConfig(swap_dirs=[str(root / "nvme0")], io_engine="python",
                          chunk_size=chunk_nbytes, mlock=False, arena_hugepages="off")
    space = SwapSpace(config, DaemonMetrics())
    await space.open()
    registry = JobRegistry(4 * arena_nbytes, 1.0, lock=False)
    try:
        job, _ = registry.open(name, arena_nbytes, make_tier=lambda: open_tier(space, name))
        yield job
    finally:
        await space.close()
        registry.close()
