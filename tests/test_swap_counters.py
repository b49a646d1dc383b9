"""The swap tier's byte counters by shard kind (param, grad, master, exp_avg, exp_avg_sq):
in stats and in Prometheus, equal to the bytes the IO engine moved for each kind.

Each test runs its own daemon, so the daemon-wide swap counters are this test's.
"""

from __future__ import annotations

import os
from pathlib import Path

from test_daemon_metrics import scrape, value

from offloadd.memory.shards import shard_kind
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

MIB = 1 << 20
ARENA_NBYTES = 32 * MIB
SHARD_NBYTES = 4 * MIB
JOB = "counters"
KINDS = ("param", "exp_avg", "grad")
SHARDS_PER_KIND = 4
"""Three kinds of four 4 MiB shards: 48 MiB, half again the 32 MiB arena."""


def test_shard_kind_is_the_id_suffix_or_other() -> None:
    assert [shard_kind(i) for i in ("u3.param", "u3.exp_avg_sq", "u3.grad", "u3.master")] == [
        "param", "exp_avg_sq", "grad", "master"]
    assert [shard_kind(i) for i in ("blob", "u3.params", "exp_avg")] == ["other"] * 3


def dir_totals(swap: dict) -> tuple[int, int]:
    return (sum(d["read_nbytes"] for d in swap["dirs"]),
            sum(d["written_nbytes"] for d in swap["dirs"]))


def test_counters_by_kind_equal_the_bytes_moved_through_the_swap_files(
        tmp_path: Path) -> None:
    ids = [f"u{unit}.{kind}" for kind in KINDS for unit in range(SHARDS_PER_KIND)]
    kind_nbytes = SHARDS_PER_KIND * SHARD_NBYTES
    with PrivateDaemon.start(tmp_path / "d", arena_size=2 * ARENA_NBYTES,
                             swap_dirs=[str(tmp_path / "swap")],
                             extra_args=["--metrics-addr", "127.0.0.1:0"]) as daemon, \
            OffloadClient.connect(daemon.socket_path, job=JOB,
                                  arena_nbytes=ARENA_NBYTES) as client:
        payloads = {shard_id: os.urandom(SHARD_NBYTES) for shard_id in ids}
        for shard_id, payload in payloads.items():
            client.put(shard_id, payload)
        # Every shard was written once: a flush persists what eviction did not, so each
        # kind's written bytes are exactly its shards', each version written once.
        client.flush("all")
        swap = client.stats()["swap"]
        assert {kind: moved["written_nbytes"] for kind, moved in swap["by_kind"].items()} == {
            kind: kind_nbytes for kind in KINDS}
        assert swap["clean_writeback_nbytes"] == 0
        # Read everything back: a kind's reads are its shards that were not resident.
        for shard_id, payload in payloads.items():
            assert client.get(shard_id) == payload
        swap = client.stats()["swap"]
        read, written = dir_totals(swap)
        by_kind = swap["by_kind"]
        assert sum(m["read_nbytes"] for m in by_kind.values()) == read > 0
        assert sum(m["written_nbytes"] for m in by_kind.values()) == written == 3 * kind_nbytes
        # Resident after the puts: the last 32 MiB written (exp_avg, grad). The params'
        # gets evict the exp_avgs (least recently used), theirs the grads, theirs the
        # params: every shard is read once, none twice.
        assert by_kind["param"]["read_nbytes"] == kind_nbytes
        assert read == len(ids) * SHARD_NBYTES
        assert swap["reread_nbytes"] == 0  # each version read at most once
        samples = scrape(daemon)
        for kind in KINDS:
            assert value(samples, "offloadd_swap_shard_bytes_total", op="write",
                         kind=kind) == kind_nbytes
            assert value(samples, "offloadd_swap_shard_bytes_total", op="read",
                         kind=kind) == by_kind[kind]["read_nbytes"]
        assert value(samples, "offloadd_swap_reread_bytes_total") == 0
        assert value(samples, "offloadd_clean_writeback_bytes_total") == 0
