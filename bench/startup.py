"""Start-up against arena size: how long a job's ranks wait for their hello.

For each arena size, a fresh daemon per contender, then two ranks of one job say
hello one after the other (rank 1 as soon as rank 0's hello returned: with ours,
while the arena is still being backed):

- ``background`` (the default): the arena's pages are backed on a thread after the
  hello is answered (offloadd.memory.arena);
- ``now`` (the peer: how every arena was made before issue 21): backed before the
  hello is answered.

Per size it reports the median (over ``--runs``) of each rank's connect time and of
the time until the daemon reports the arena backed. ``ratio_vs_prefault_now_<size>``
is the peer's slowest hello over ours (> 1: ours answers sooner). Both contenders
back the whole arena, so each size needs that much free memory.

Then, per ``--backing-gib`` size, the backing itself (``offloadd.memory.arena.Arena``
with ``prefault="now"`` and ``lock=True``, in this process), alternated over ``--runs``:

- ``parallel_populate`` (ours): ``--threads`` threads (0: the daemon's default) fault
  64 MiB chunks in with MADV_POPULATE_WRITE under one mlock2(MLOCK_ONFAULT);
- ``serial_mlock`` (the peer: how every arena was backed before): one thread, each chunk
  fallocate'd then mlock'ed (the arena's own path for kernels without mlock2, taken by
  making ``offloadd.memory.pages.lock_on_fault`` report none).

It reports seconds and GB/s of each, whether the arena was locked (RLIMIT_MEMLOCK, or
root) and ``ratio_vs_serial_mlock_<size>`` = the peer's median seconds / ours (> 1: ours
backs sooner). Unlocked, both ways are one thread's fallocate, and the ratio is ~1.

    python bench/startup.py --sizes-gib 1,4 --backing-gib 4 --runs 3

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offloadd.memory import pages
from offloadd.memory.arena import Arena
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

BACKING_WAYS = ("parallel_populate", "serial_mlock")


def one_start(arena_nbytes: int, prefault: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="offloadd-startup-") as workdir:
        daemon = PrivateDaemon.start(workdir, arena_size=arena_nbytes + (64 << 20),
                                     extra_args=["--arena-prefault", prefault])
        clients: list[OffloadClient] = []
        try:
            began = time.perf_counter()
            hello_s = []
            for rank in range(2):
                started = time.perf_counter()
                clients.append(OffloadClient.connect(
                    daemon.socket_path, job="startup", rank=rank, world_size=2,
                    local_rank=rank, arena_nbytes=arena_nbytes, timeout_s=600))
                hello_s.append(time.perf_counter() - started)
            while clients[0].stats()["arena_backing"] == "backing":
                time.sleep(0.01)
            backed_s = time.perf_counter() - began
        finally:
            for client in clients:
                client.close()
            daemon.stop()
    return {"hello_rank0_s": hello_s[0], "hello_rank1_s": hello_s[1], "backed_s": backed_s}


def one_backing(nbytes: int, way: str, threads: int) -> dict[str, Any]:
    """Back and lock an arena of ``nbytes`` in this process, ``way`` in BACKING_WAYS."""
    lock_on_fault = pages.lock_on_fault
    if way == "serial_mlock":
        pages.lock_on_fault = lambda address, nbytes: None
    try:
        started = time.perf_counter()
        arena = Arena(f"bench-{way}", nbytes, lock=True, hugepages="off", prefault="now",
                      prefault_threads=1 if way == "serial_mlock" else threads)
        seconds = time.perf_counter() - started
    finally:
        pages.lock_on_fault = lock_on_fault
    try:
        return {"s": seconds, "gb_per_s": nbytes / seconds / 1e9, "locked": arena.locked,
                "threads": arena.backing_threads}
    finally:
        arena.close()


def backing(size_gib: float, runs: int, threads: int) -> dict[str, Any]:
    """Medians of each backing way at one size, alternated run by run."""
    nbytes = int(size_gib * (1 << 30)) // (2 << 20) * (2 << 20)
    samples: dict[str, list[dict[str, Any]]] = {way: [] for way in BACKING_WAYS}
    for _ in range(runs):
        for way in BACKING_WAYS:
            samples[way].append(one_backing(nbytes, way, threads))
    return {way: {"s": statistics.median(run["s"] for run in rows),
                  "gb_per_s": statistics.median(run["gb_per_s"] for run in rows),
                  "s_runs": [round(run["s"], 3) for run in rows],
                  "locked": all(run["locked"] for run in rows),
                  "threads": rows[0]["threads"]} for way, rows in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", default="1,4",
                        help="arena sizes of the hello figures, comma separated ('': none)")
    parser.add_argument("--backing-gib", default="4",
                        help="arena sizes of the backing figures, comma separated ('': none)")
    parser.add_argument("--threads", type=int, default=0,
                        help="backing threads of ours (0: the daemon's default)")
    parser.add_argument("--runs", type=int, default=3)
    ns = parser.parse_args()
    result: dict[str, Any] = {"runs": ns.runs, "sizes": {}, "backing": {}}
    for size_gib in (float(x) for x in ns.backing_gib.split(",") if x):
        label = f"{size_gib:g}gib"
        medians = result["backing"][label] = backing(size_gib, ns.runs, ns.threads)
        result[f"ratio_vs_serial_mlock_{label}"] = (medians["serial_mlock"]["s"]
                                                    / medians["parallel_populate"]["s"])
        print(json.dumps({f"backing_{label}": medians}), flush=True)
    for size_gib in (float(x) for x in ns.sizes_gib.split(",") if x):
        nbytes = int(size_gib * (1 << 30)) // (2 << 20) * (2 << 20)
        samples: dict[str, list[dict[str, float]]] = {"background": [], "now": []}
        for _ in range(ns.runs):  # alternate the contenders: the host's noise hits both
            for prefault in samples:
                samples[prefault].append(one_start(nbytes, prefault))
        medians = {prefault: {key: statistics.median(run[key] for run in runs)
                              for key in runs[0]} for prefault, runs in samples.items()}
        label = f"{size_gib:g}gib"
        result["sizes"][label] = medians
        ours = max(medians["background"]["hello_rank0_s"], medians["background"]["hello_rank1_s"])
        peer = max(medians["now"]["hello_rank0_s"], medians["now"]["hello_rank1_s"])
        result[f"ratio_vs_prefault_now_{label}"] = peer / ours
        print(json.dumps({label: medians}), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
