"""``offloadd demo``: a private daemon and two client processes, end to end.

``--mode data`` writes a few hundred MiB of shards from two processes,
reads them back through zero-copy leases and verifies every byte;
``--mode train`` (the default once the ZeRO engine is installed) trains a
small GPT on two ranks with ZeRO-3 and NVMe offload through the daemon.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time

import numpy as np

from offloadd.ops.embedded import PrivateDaemon

SHARD_NBYTES = 4 << 20


def progress(label: str, done: int, total: int, started: float, extra: str = "") -> None:
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.perf_counter() - started, 1e-9) / (1 << 20)
    sys.stdout.write(f"\r{label:<12} [{'#' * filled}{'.' * (width - filled)}] "
                     f"{done >> 20:>5}/{total >> 20} MiB {rate:8.1f} MiB/s {extra}")
    if done >= total:
        sys.stdout.write("\n")
    sys.stdout.flush()


def _client(socket_path: str, rank: int, nbytes: int, arena_nbytes: int,
            results: mp.Queue) -> None:
    from trainer.client import OffloadClient

    rng = np.random.default_rng(rank)
    num_shards = max(1, nbytes // SHARD_NBYTES)
    digests = {}
    with OffloadClient.connect(socket_path, job="demo", rank=rank, world_size=2,
                               arena_nbytes=arena_nbytes) as client:
        started = time.perf_counter()
        for index in range(num_shards):
            data = np.frombuffer(rng.bytes(SHARD_NBYTES), dtype=np.uint8)
            client.alloc(f"s{index}", SHARD_NBYTES)
            with client.acquire(f"s{index}", "w") as lease:
                lease.numpy()[:] = data
            digests[index] = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
            if rank == 0:
                progress("write", (index + 1) * SHARD_NBYTES * 2, num_shards * SHARD_NBYTES * 2,
                         started)
        write_s = time.perf_counter() - started
        started = time.perf_counter()
        bad = 0
        for index in rng.permutation(num_shards):
            with client.acquire(f"s{index}", "r") as lease:
                if hashlib.blake2b(lease.view, digest_size=16).digest() != digests[index]:
                    bad += 1
            if rank == 0:
                del digests[index]
                done = num_shards - len(digests)
                progress("verify", done * SHARD_NBYTES * 2, num_shards * SHARD_NBYTES * 2,
                         started)
        read_s = time.perf_counter() - started
        stats = client.stats()
    results.put({"rank": rank, "nbytes": num_shards * SHARD_NBYTES, "write_s": write_s,
                 "read_s": read_s, "bad_shards": bad, "stats": stats})


def run_data_demo(nbytes: int = 256 << 20) -> dict:
    """Two processes each write and verify ``nbytes`` through one private daemon."""
    arena_nbytes = 2 * (max(1, nbytes // SHARD_NBYTES) * SHARD_NBYTES) + (16 << 20)
    with tempfile.TemporaryDirectory(prefix="offloadd-demo-") as workdir, \
            PrivateDaemon.start(workdir, arena_size=arena_nbytes) as daemon:
        context = mp.get_context("spawn")
        results: mp.Queue = context.Queue()
        procs = [context.Process(target=_client,
                                 args=(daemon.socket_path, rank, nbytes, arena_nbytes,
                                                   results))
                 for rank in range(2)]
        for proc in procs:
            proc.start()
        reports = sorted(collect(results, procs), key=lambda r: r["rank"])
    return summarize(reports)


def collect(results: mp.Queue, procs: list) -> list[dict]:
    """One report per client; a client that died without reporting fails the demo."""
    reports: list[dict] = []
    while len(reports) < len(procs):
        try:
            reports.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"demo client exited with code {dead[0].exitcode}") from None
    for proc in procs:
        proc.join()
    return reports


def summarize(reports: list[dict]) -> dict:
    total = sum(r["nbytes"] for r in reports)
    write_s = max(r["write_s"] for r in reports)
    read_s = max(r["read_s"] for r in reports)
    stats = reports[0]["stats"]
    summary = {
        "clients": len(reports),
        "bytes_total": total,
        "write_GiBps": total / write_s / (1 << 30),
        "verify_GiBps": total / read_s / (1 << 30),
        "bad_shards": sum(r["bad_shards"] for r in reports),
        "arena_used_MiB": stats["arena_used_nbytes"] >> 20,
        "arena_MiB": stats["arena_nbytes"] >> 20,
        "adam_kernel": stats["adam_kernel"],
    }
    print("\nsummary")
    for key, value in summary.items():
        print(f"  {key:<16} {value:.3f}" if isinstance(value, float) else f"  {key:<16} {value}")
    return summary


def main(*, mode: str = "train", steps: int = 20, nbytes: int = 256 << 20) -> int:
    if mode == "train":
        from trainer.demo.train import run_training_demo

        summary = run_training_demo(steps=steps)
        return 0 if summary.get("ok", True) else 1
    summary = run_data_demo(nbytes)
    return 0 if summary["bad_shards"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main(mode=os.environ.get("OFFLOADD_DEMO_MODE", "data")))
