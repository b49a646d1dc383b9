"""How much swap-in IO the learned prefetch hides behind compute, vs plain LRU.

    python bench/prefetch.py [--dir /var/tmp] [--arena-mib 32] [--ratio 8] [--shard-mib 1]
                             [--compute-ms 2] [--steps 6] [--pattern fwd-bwd|cyclic]

A training-like loop on a daemon whose dataset is ``--ratio`` times its arena:
every step reads the same shards in the same order (``fwd-bwd``: forward over
the shards then back, as ZeRO-3 gathers parameters; ``cyclic``: forward only),
and "computes" ``--compute-ms`` per shard (a sleep) while holding the lease.
It runs on fresh daemons:

- learned: ``step_begin()`` each step, so the daemon learns the order and
  prefetches with furthest-next-use eviction;
- LRU: no ``step_begin()``, so the daemon knows no order: demand reads, LRU.

Definitions, for steps 2..N (step 1 only teaches the order):
- blocked_s: client-side time spent inside ``acquire`` (waiting for the daemon);
- read_io_s: the daemon's total swap read time (sum over reads of submit to
  completion, from stats()["swap"]["io_seconds"]["read"]);
- hidden_fraction = 1 - blocked_s / read_io_s: the share of swap read time the
  rank did not wait for (clamped to [0, 1]);
- ratio_vs_lru_stall = LRU blocked_s / learned blocked_s (> 1: less stall).
- A third run with an arena the dataset fits in measures blocked_s with no IO
  at all (the control-plane cost of acquire); ``hidden_fraction_net`` and
  ``ratio_vs_lru_io_stall`` subtract it, counting only time blocked on reads.

The last line is one JSON object with these figures and the per-run counts of
prefetch hits, late prefetches and demand reads.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

MIB = 1 << 20
COUNTERS = ("demand_reads", "prefetch_issued", "prefetch_hits", "prefetch_late",
            "prefetch_wasted")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/var/tmp", help="file system for the swap dir")
    parser.add_argument("--arena-mib", type=int, default=32)
    parser.add_argument("--ratio", type=int, default=8, help="dataset size / arena size")
    parser.add_argument("--shard-mib", type=float, default=1.0)
    parser.add_argument("--compute-ms", type=float, default=2.0, help="simulated compute/shard")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pattern", choices=["fwd-bwd", "cyclic"], default="fwd-bwd")
    return parser.parse_args()


def order(num_shards: int, pattern: str) -> list[str]:
    forward = [f"s{i}" for i in range(num_shards)]
    return forward + forward[::-1] if pattern == "fwd-bwd" else forward


def run(args: argparse.Namespace, learn: bool, fits: bool = False) -> dict[str, Any]:
    shard_nbytes = int(args.shard_mib * MIB)
    num_shards = args.arena_mib * MIB * args.ratio // shard_nbytes
    arena = args.arena_mib * MIB * (args.ratio + 1 if fits else 1)
    sequence = order(num_shards, args.pattern)
    with tempfile.TemporaryDirectory(prefix="offloadd-prefetch-bench-", dir=args.dir) as root:
        daemon = PrivateDaemon.start(Path(root) / "run", arena_size=arena,
                                     swap_dirs=[str(Path(root) / "swap")])
        try:
            with OffloadClient.connect(daemon.socket_path, job="bench",
                                       arena_nbytes=arena) as client:
                payload = os.urandom(shard_nbytes)
                for shard_id in sequence[:num_shards]:
                    client.put(shard_id, payload)
                client.flush("dataset")  # start from a clean arena: reads only
                return measure(client, sequence, args, learn)
        finally:
            daemon.stop()


def measure(client: OffloadClient, sequence: list[str], args: argparse.Namespace,
            learn: bool) -> dict[str, Any]:
    compute_s = args.compute_ms / 1000
    totals = {"blocked_s": 0.0, "read_io_s": 0.0, "step_s": 0.0, "compute_s": 0.0}
    counts = dict.fromkeys(COUNTERS, 0)
    first_step_demand = 0
    for step in range(args.steps):
        before = client.stats()["swap"]
        if learn:
            client.step_begin()
        blocked = 0.0
        started = time.perf_counter()
        for shard_id in sequence:
            asked = time.perf_counter()
            with client.acquire(shard_id):
                blocked += time.perf_counter() - asked
                time.sleep(compute_s)
        step_s = time.perf_counter() - started
        after = client.stats()["swap"]
        if step == 0:
            first_step_demand = after["demand_reads"] - before["demand_reads"]
            continue
        totals["blocked_s"] += blocked
        totals["read_io_s"] += after["io_seconds"]["read"] - before["io_seconds"]["read"]
        totals["step_s"] += step_s
        totals["compute_s"] += compute_s * len(sequence)
        for name in COUNTERS:
            counts[name] += after[name] - before[name]
    measured = args.steps - 1
    hidden = 1 - totals["blocked_s"] / totals["read_io_s"] if totals["read_io_s"] else 1.0
    return {**{k: round(v, 4) for k, v in totals.items()}, **counts,
            "demand_reads_step1": first_step_demand,
            "demand_reads_per_step": counts["demand_reads"] / measured,
            "hidden_fraction": round(min(1.0, max(0.0, hidden)), 4)}


def main() -> None:
    args = parse_args()
    baseline = run(args, learn=False, fits=True)
    learned = run(args, learn=True)
    lru = run(args, learn=False)
    # The control-plane cost of an acquire that needs no IO (the dataset fits the
    # arena) is not IO stall: subtract it to get the time blocked on swap reads.
    rpc_s = baseline["blocked_s"]
    for result in (learned, lru):
        io_stall = max(0.0, result["blocked_s"] - rpc_s)
        result["io_stall_s"] = round(io_stall, 4)
        net = 1 - io_stall / result["read_io_s"] if result["read_io_s"] else 1.0
        result["hidden_fraction_net"] = round(min(1.0, max(0.0, net)), 4)
    print(f"arena {args.arena_mib} MiB, dataset {args.ratio}x, shards {args.shard_mib} MiB, "
          f"pattern {args.pattern}, compute {args.compute_ms} ms/shard, steps 2..{args.steps}")
    print(f"{'policy':<10}{'blocked s':>11}{'read io s':>11}{'hidden':>8}{'step s':>9}"
          f"{'compute s':>11}{'hits':>7}{'late':>6}{'demand':>8}{'wasted':>8}")
    for name, r in (("learned", learned), ("lru", lru)):
        print(f"{name:<10}{r['blocked_s']:>11.3f}{r['read_io_s']:>11.3f}"
              f"{r['hidden_fraction']:>8.2f}{r['step_s']:>9.3f}{r['compute_s']:>11.3f}"
              f"{r['prefetch_hits']:>7}{r['prefetch_late']:>6}{r['demand_reads']:>8}"
              f"{r['prefetch_wasted']:>8}")
    print("hidden = 1 - (client time blocked in acquire) / (daemon swap read time), steps 2..N")
    print(f"no-IO baseline (dataset fits the arena): {rpc_s:.3f} s blocked in acquire "
          "(control plane); net of it: hidden "
          f"learned {learned['hidden_fraction_net']:.2f}, lru {lru['hidden_fraction_net']:.2f}")
    ratio = lru["blocked_s"] / learned["blocked_s"] if learned["blocked_s"] else float("inf")
    stall_ratio = (lru["io_stall_s"] / learned["io_stall_s"] if learned["io_stall_s"]
                   else float("inf"))
    print(json.dumps({
        "bench": "prefetch", "pattern": args.pattern, "arena_mib": args.arena_mib,
        "dataset_ratio": args.ratio, "shard_mib": args.shard_mib,
        "compute_ms": args.compute_ms, "steps": args.steps,
        "hidden_fraction": learned["hidden_fraction"],
        "lru_hidden_fraction": lru["hidden_fraction"],
        "hidden_fraction_net": learned["hidden_fraction_net"],
        "ratio_vs_lru_stall": round(ratio, 3),
        "ratio_vs_lru_io_stall": round(stall_ratio, 3) if stall_ratio != float("inf") else None,
        "baseline_blocked_s": rpc_s,
        "learned": learned, "lru": lru,
    }))


if __name__ == "__main__":
    main()
