"""Debug leases (OFFLOADD_DEBUG_LEASES=1, on in the whole suite): a view of a shard used
after its lease was given back raises StaleLeaseError at the next checked access."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import lease_debug
from trainer.client import AsyncOffloadClient, OffloadClient
from trainer.lease_debug import StaleLeaseError, check_view


def test_the_suite_runs_with_debug_leases() -> None:
    assert lease_debug.enabled()


def test_a_tensor_used_after_release_is_caught(connect) -> None:  # type: ignore[no-untyped-def]
    client: OffloadClient = connect()
    client.put("weights", torch.arange(64, dtype=torch.float32))
    client.put("other", torch.zeros(64, dtype=torch.float32))
    lease = client.acquire("weights", "r")
    kept = lease.tensor()
    array = lease.numpy(np.float32)
    check_view(kept)
    check_view(kept[10:20])
    check_view(array)
    lease.release()
    with pytest.raises(StaleLeaseError, match="'weights'"):
        check_view(kept)
    with pytest.raises(StaleLeaseError):
        check_view(kept[10:20])  # a view derived from the stale tensor, too
    with pytest.raises(StaleLeaseError):
        check_view(array)
    check_view(kept.clone())  # a copy is private memory: always fine
    with client.acquire("weights", "r") as again:
        check_view(kept)  # leased again: the same bytes are valid once more
        assert torch.equal(again.tensor(), torch.arange(64, dtype=torch.float32))


def test_nested_read_leases_keep_the_view_valid_until_the_last_release(connect) -> None:  # type: ignore[no-untyped-def]
    client: OffloadClient = connect()
    client.put("s", b"x" * 4096)
    outer = client.acquire("s", "r")
    inner = client.acquire("s", "r")
    view = inner.numpy()
    inner.release()
    check_view(view)
    outer.release()
    with pytest.raises(StaleLeaseError):
        check_view(view)


def test_the_async_client_tracks_its_leases_too(daemon, job, run_async) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        client = await AsyncOffloadClient.connect(daemon.socket_path, job=job,
                                                  arena_nbytes=4 << 20)
        try:
            await client.put("a", torch.ones(16))
            async with await client.acquire_many(["a"], "w") as group:
                kept = group[0].tensor()
                kept.add_(1)
                check_view(kept)
            with pytest.raises(StaleLeaseError):
                check_view(kept)
        finally:
            await client.close()

    run_async(scenario())
