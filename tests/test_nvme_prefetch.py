"""Learned and explicit prefetch against a real daemon: counts, never times.

The same shard order is read every step (with ``step_begin()``) over a dataset 4x
the arena. Step 1 only teaches the daemon the order; from then on the daemon
reads ahead by itself, so acquires are served by prefetches (``prefetch_hits``)
and the demand reads per step fall below step 1's. Without ``step_begin()`` the
daemon never learns an order and every miss is a demand read (LRU only).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

MIB = 1 << 20
ARENA_NBYTES = 16 * MIB
NUM_SHARDS = 64  # 1 MiB each: 4x the arena
STEPS = 4
COUNTERS = ("demand_reads", "prefetch_issued", "prefetch_hits", "prefetch_late")


@pytest.fixture
def client() -> Iterator[OffloadClient]:
    parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
    with tempfile.TemporaryDirectory(prefix="offloadd-test-", dir=parent) as root:
        daemon = PrivateDaemon.start(Path(root) / "run", arena_size=ARENA_NBYTES,
                                     swap_dirs=[str(Path(root) / "nvme0")])
        try:
            with OffloadClient.connect(daemon.socket_path, job="prefetch",
                                       arena_nbytes=ARENA_NBYTES, timeout_s=30) as opened:
                yield opened
        finally:
            assert daemon.process.poll() is None, "the daemon died"
            assert daemon.stop() == 0


def write_dataset(client: OffloadClient) -> dict[str, bytes]:
    digests = {}
    for index in range(NUM_SHARDS):
        data = os.urandom(MIB)
        client.put(f"s{index}", data)
        digests[f"s{index}"] = hashlib.sha256(data).digest()
    return digests


def run_steps(client: OffloadClient, digests: dict[str, bytes], learn: bool
              ) -> list[dict[str, int]]:
    """Read every shard in the same order each step; per-step deltas of the counters."""
    per_step = []
    before = client.stats()["swap"]
    for _step in range(STEPS):
        if learn:
            client.step_begin()
        for shard_id, digest in digests.items():
            with client.acquire(shard_id) as lease:
                assert hashlib.sha256(lease.view).digest() == digest, shard_id
                time.sleep(0.001)  # a little "compute" per shard, as a training step has
        after = client.stats()["swap"]
        per_step.append({name: after[name] - before[name] for name in COUNTERS})
        before = after
    return per_step


def test_learned_order_turns_demand_reads_into_prefetch_hits(client: OffloadClient) -> None:
    digests = write_dataset(client)
    steps = run_steps(client, digests, learn=True)
    first, later = steps[0], steps[2:]
    assert first["prefetch_issued"] == 0  # nothing is known during the first step
    assert first["demand_reads"] >= NUM_SHARDS - ARENA_NBYTES // MIB
    assert sum(s["prefetch_hits"] for s in steps[1:]) > 0
    for step in later:
        assert step["demand_reads"] < first["demand_reads"], steps
        assert step["prefetch_hits"] + step["prefetch_late"] > 0, steps
    assert client.stats()["leased_nbytes"] == 0


def test_without_step_markers_the_daemon_does_not_prefetch(client: OffloadClient) -> None:
    digests = write_dataset(client)
    steps = run_steps(client, digests, learn=False)
    for step in steps:
        assert step["prefetch_issued"] == 0 and step["prefetch_hits"] == 0
        assert step["demand_reads"] >= NUM_SHARDS - ARENA_NBYTES // MIB  # LRU on a cycle


def test_explicit_prefetch_replaces_demand_reads(client: OffloadClient) -> None:
    digests = write_dataset(client)
    cold = list(digests)[:8]  # the oldest shards: on swap
    # Clean arena: room comes from evictions alone. (Under write pressure a prefetch is
    # best effort: it waits a few write-backs for room, then leaves it to the demand read.)
    client.flush()
    before = client.stats()["swap"]
    client.prefetch(cold)
    for shard_id in cold:
        with client.acquire(shard_id) as lease:
            assert hashlib.sha256(lease.view).digest() == digests[shard_id]
    after = client.stats()["swap"]
    delta = {name: after[name] - before[name] for name in COUNTERS}
    assert delta["prefetch_issued"] == len(cold)
    assert delta["demand_reads"] == 0  # every acquire found its read done or in flight
    assert delta["prefetch_hits"] + delta["prefetch_late"] == len(cold)
