"""Batched alloc beyond the arena: shards are created now and placed on first use."""

from __future__ import annotations

import os

import pytest

from offloadd.errors import OverBudgetError, ShardExistsError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

ARENA_NBYTES = 8 << 20
SHARD_NBYTES = 1 << 20


@pytest.fixture
def client(tmp_path):
    swap = tmp_path / "swap"
    with PrivateDaemon.start(tmp_path / "d", arena_size=2 * ARENA_NBYTES,
                             swap_dirs=[str(swap)]) as daemon:
        conn = OffloadClient.connect(daemon.socket_path, job="alloc", arena_nbytes=ARENA_NBYTES)
        yield conn
        conn.close()


def test_a_batch_four_times_the_arena_allocates_and_round_trips(client) -> None:
    ids = [f"s{i}" for i in range(4 * ARENA_NBYTES // SHARD_NBYTES)]
    client.alloc(ids, SHARD_NBYTES, "uint8")
    assert client.stats()["num_shards"] == len(ids)
    payloads = {shard_id: os.urandom(SHARD_NBYTES) for shard_id in ids}
    for shard_id, payload in payloads.items():
        with client.acquire(shard_id, "w") as lease:
            lease.view[:] = payload
    for shard_id in reversed(ids):
        assert client.get(shard_id) == payloads[shard_id]


def test_a_bad_entry_fails_the_whole_batch_and_creates_nothing(client) -> None:
    client.alloc("kept", SHARD_NBYTES)
    with pytest.raises(OverBudgetError):
        client.alloc(["a", "b", "huge"], [SHARD_NBYTES, SHARD_NBYTES, ARENA_NBYTES + 1])
    with pytest.raises(ShardExistsError):
        client.alloc(["c", "kept"], [SHARD_NBYTES, 2 * SHARD_NBYTES])
    assert client.stats()["num_shards"] == 1
