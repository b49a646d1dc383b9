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

    python bench/startup.py --sizes-gib 1,4 --runs 3

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

from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", default="1,4", help="arena sizes, comma separated")
    parser.add_argument("--runs", type=int, default=3)
    ns = parser.parse_args()
    result: dict[str, Any] = {"runs": ns.runs, "sizes": {}}
    for size_gib in (float(x) for x in ns.sizes_gib.split(",")):
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
