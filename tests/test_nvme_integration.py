"""NVMe tier end to end: 1 GiB through a 64 MiB arena, two rank processes, two swap dirs.

A real ``offloadd serve`` with ``--swap-dir`` twice (on /var/tmp, where O_DIRECT
works) and two client processes, ranks 0 and 1 of one job. Each rank writes
512 MiB of random shards (4 MiB, plus sizes that are not a multiple of 4 KiB) in
random order, reads them all back in random order (single and batched acquires),
overwrites some and reads everything again. Every read is compared by digest
with what was written. The data is 16x the arena, so nearly every read is a swap
read and nearly every write is evicted through a write-back.

The rank workers are this file run as a script (``python THIS worker ...``), so
they are real processes with their own mappings of the arena.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.ops.embedded import PrivateDaemon

MIB = 1 << 20
ARENA_NBYTES = 64 * MIB
RANK_NBYTES = 512 * MIB
JOB = "integration"
SWAP_PARENT = "/var/tmp"


def shard_sizes(total_nbytes: int, seed: int) -> list[int]:
    """4 MiB shards with every fifth one an odd size (not a multiple of 4 KiB, some > 4 MiB)."""
    rng = random.Random(seed)
    sizes, total = [], 0
    while total < total_nbytes:
        odd = len(sizes) % 5 == 4
        nbytes = rng.randrange(1, 6 * MIB) | 1 if odd else 4 * MIB
        nbytes = min(nbytes, total_nbytes - total)
        sizes.append(nbytes)
        total += nbytes
    return sizes


def run_worker(socket_path: str, rank: int) -> dict[str, int]:
    """One rank's write / read / overwrite / read cycle; raises on any mismatch."""
    from trainer.client import OffloadClient

    rng = random.Random(1000 + rank)
    sizes = shard_sizes(RANK_NBYTES, seed=rank)
    digests: dict[str, bytes] = {}
    with OffloadClient.connect(socket_path, job=JOB, rank=rank, world_size=2,
                               arena_nbytes=ARENA_NBYTES, timeout_s=60) as client:

        def write(shard_id: str, nbytes: int) -> None:
            data = os.urandom(nbytes)
            digests[shard_id] = hashlib.sha256(data).digest()
            client.put(shard_id, data)

        def check_all() -> int:
            ids = list(digests)
            rng.shuffle(ids)
            checked = 0
            while ids:
                take = rng.choice((1, 1, 3))  # mostly single acquires, some batches
                batch, ids = ids[:take], ids[take:]
                with client.acquire_many(batch, "r") as group:
                    for lease in group:
                        got = hashlib.sha256(lease.view).digest()
                        assert got == digests[lease.shard_id], (
                            f"rank {rank} shard {lease.shard_id}: bytes differ from the write")
                        checked += 1
            return checked

        order = list(enumerate(sizes))
        rng.shuffle(order)
        for index, nbytes in order:
            write(f"r{rank}.s{index}", nbytes)
        first = check_all()
        for shard_id in rng.sample(sorted(digests), len(digests) // 8):
            write(shard_id, len(client.get(shard_id)))  # a new version of the same size
        second = check_all()
    # leased_nbytes is job-wide: the other rank may still hold leases here, so it is
    # checked by the parent once both ranks are done.
    return {"shards": len(sizes), "nbytes": sum(sizes), "checked": first + second}


@pytest.fixture
def swap_root() -> Iterator[Path]:
    if not os.path.isdir(SWAP_PARENT):
        pytest.skip(f"{SWAP_PARENT} does not exist")
    with tempfile.TemporaryDirectory(prefix="offloadd-test-", dir=SWAP_PARENT) as root:
        yield Path(root)


def test_one_gib_through_a_64mib_arena_two_ranks_two_swap_dirs(swap_root: Path) -> None:
    swap_dirs = [swap_root / "nvme0", swap_root / "nvme1"]
    daemon = PrivateDaemon.start(swap_root / "run", arena_size=ARENA_NBYTES,
                                 swap_dirs=[str(d) for d in swap_dirs])
    try:
        workers = [subprocess.Popen([sys.executable, __file__, "worker", daemon.socket_path,
                                     str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for rank in (0, 1)]
        results = []
        for rank, worker in enumerate(workers):
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
        assert sum(r["nbytes"] for r in results) == 2 * RANK_NBYTES
        for r in results:
            assert r["checked"] == r["shards"] * 2

        from trainer.client import OffloadClient

        with OffloadClient.connect(daemon.socket_path, job=JOB, rank=0, world_size=2,
                                   timeout_s=30) as observer:
            stats = observer.stats()
        swap = stats["swap"]
        assert [Path(d["path"]) for d in swap["dirs"]] == [d.resolve() for d in swap_dirs]
        for entry in swap["dirs"]:  # striping: both dirs carried a real share of the bytes
            assert entry["direct"] is True
            assert entry["written_nbytes"] > RANK_NBYTES // 4, entry
            assert entry["read_nbytes"] > RANK_NBYTES // 4, entry
        assert swap["checksum_failures"] == 0
        assert swap["demand_reads"] > 0 and swap["evictions"].get("writeback", 0) > 0
        assert stats["leased_nbytes"] == 0
        assert stats["num_shards"] == sum(r["shards"] for r in results)
        assert stats["residency"]["reading"] == stats["residency"]["writing"] == 0
    finally:
        assert daemon.process.poll() is None, f"the daemon died; log: {daemon.log_path}"
        assert daemon.stop() == 0


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "worker":
    print(json.dumps(run_worker(sys.argv[2], int(sys.argv[3]))))
