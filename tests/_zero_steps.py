"""A ZeRO-3 step's shard traffic, replayed against a real daemon without a model.

Each rank (a thread with its own connection) does what ``trainer.offload.daemon_backend`` does
for a stage-3 model of ``num_units`` units with params and optimizer on NVMe: the
forward reads every ``u{N}.param``, the backward reads them again in reverse order,
writes each unit's gradient into a fresh ``u{N}.grad`` and queues the unit's optimizer
step (which drops the gradient), with at most two steps in flight, as the engine
does; it sends the engine's prefetch hints too (every upcoming unit's param).

``run_steps`` returns the daemon's swap byte counters for each step, so a test can hold
what crosses the disk against what the arena size forces (``least_swap_nbytes``).
Run as a script for the figures of one arena size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "grad")
PERSISTENT_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")
IN_FLIGHT_STEPS = 2
"""Optimizer steps a rank keeps queued (``trainer.offload.daemon_steps.MIN_INFLIGHT_STEPS``)."""


@dataclass(frozen=True, kw_only=True)
class Model:
    num_units: int = 8
    unit_numel: int = 1 << 18
    """Elements of one unit's partition on one rank (fp32 state: 4 B each per kind)."""
    num_ranks: int = 2
    bf16: bool = False
    """Params and gradients in bf16 (half the bytes of the fp32 state), as bf16 training:
    shards of two sizes share the arena."""

    @property
    def shard_nbytes(self) -> int:
        """Bytes of one fp32 state shard (master, a moment)."""
        return self.unit_numel * 4

    def kind_nbytes(self, kind: str) -> int:
        return self.unit_numel * (2 if self.bf16 and kind in ("param", "grad") else 4)

    @property
    def persistent_nbytes(self) -> int:
        """Param + master + two moments of every unit of every rank: what must survive."""
        return self.num_ranks * self.num_units * sum(map(self.kind_nbytes, PERSISTENT_KINDS))

    @property
    def working_set_nbytes(self) -> int:
        return self.num_ranks * self.num_units * sum(map(self.kind_nbytes, KINDS))


def least_swap_nbytes(model: Model, arena_nbytes: int) -> int:
    """The fewest bytes a step must read (and as many write): every step updates the whole
    persistent state, and at most the arena's worth of it stays resident between steps."""
    return max(0, model.persistent_nbytes - arena_nbytes)


def transient_nbytes(model: Model) -> int:
    """Arena room a step needs beyond persistent state at its busiest: the gradients of
    the queued steps and the five shards one step leases, on every rank."""
    return model.num_ranks * (IN_FLIGHT_STEPS * model.kind_nbytes("grad")
                              + sum(map(model.kind_nbytes, KINDS)))


def swap_counters(client: OffloadClient) -> dict[str, int]:
    swap = client.stats()["swap"]
    out = {"read": sum(d["read_nbytes"] for d in swap["dirs"]),
           "written": sum(d["written_nbytes"] for d in swap["dirs"]),
           "reread": swap["reread_nbytes"], "unneeded": swap["writeback_unneeded_nbytes"],
           "clean_written": swap["clean_writeback_nbytes"]}
    for kind, moved in swap["by_kind"].items():
        out[f"{kind}_read"], out[f"{kind}_written"] = moved["read_nbytes"], moved["written_nbytes"]
    return out


class Rank:
    """One rank's connection and its stage-3 step."""

    def __init__(self, socket_path: str, job: str, rank: int, model: Model,
                 arena_nbytes: int) -> None:
        self.model = model
        self.client = OffloadClient.connect(socket_path, job=job, rank=rank,
                                            world_size=model.num_ranks, arena_nbytes=arena_nbytes)
        dtype = torch.bfloat16 if model.bf16 else torch.float32
        self.grad = torch.full((model.unit_numel,), 1e-3, dtype=dtype)
        self.param = torch.zeros(model.unit_numel, dtype=dtype)

    def register(self) -> None:
        numel = self.model.unit_numel
        master = torch.zeros(numel)
        for unit in range(self.model.num_units):
            # As the engine on NVMe: no gradient shard before the first backward.
            self.client.put_many({f"u{unit}.param": self.param, f"u{unit}.master": master,
                                  f"u{unit}.exp_avg": master, f"u{unit}.exp_avg_sq": master})

    def read_param(self, unit: int) -> None:
        with self.client.acquire(f"u{unit}.param", "r") as lease:
            lease.view[0]  # touched, as a gather reads it

    def step(self, count: int) -> None:
        units = list(range(self.model.num_units))
        self.client.step_begin()
        for index, unit in enumerate(units):
            self.client.prefetch([f"u{u}.param" for u in units[index + 1:]])
            self.read_param(unit)
        in_flight: deque[Any] = deque()
        for index, unit in enumerate(reversed(units)):
            self.client.prefetch([f"u{u}.param" for u in reversed(units[:-index - 1])])
            self.read_param(unit)
            self.client.put(f"u{unit}.grad", self.grad)
            if len(in_flight) >= IN_FLIGHT_STEPS:
                in_flight.popleft().wait()
            in_flight.append(self.client.optimizer_step_async(
                f"u{unit}", step=count, lr=1e-3, drop_grad=True))
        for handle in in_flight:
            handle.wait()

    def close(self) -> None:
        self.client.close_job()


def run_steps(socket_path: str, job: str, model: Model, arena_nbytes: int,
              steps: int) -> list[dict[str, int]]:
    """Register the model, run ``steps`` steps on every rank at once (a barrier between
    steps, as the ranks' collectives make), return the swap counters' change per step."""
    ranks = [Rank(socket_path, job, r, model, arena_nbytes) for r in range(model.num_ranks)]
    try:
        for rank in ranks:
            rank.register()
        per_step = []
        for count in range(1, steps + 1):
            before = swap_counters(ranks[0].client)
            errors: list[BaseException] = []

            def run(rank: Rank, count: int = count,
                    errors: list[BaseException] = errors) -> None:
                try:
                    rank.step(count)
                except BaseException as error:  # re-raised by the caller
                    errors.append(error)

            threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
            after = swap_counters(ranks[0].client)
            per_step.append({key: value - before.get(key, 0) for key, value in after.items()})
        return per_step
    finally:
        for rank in ranks:
            rank.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=float, default=0.25,
                        help="arena / working set (all five kinds)")
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--unit-numel", type=int, default=1 << 18)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--bf16", action="store_true", help="bf16 params and gradients")
    ns = parser.parse_args()
    model = Model(num_units=ns.units, unit_numel=ns.unit_numel, bf16=ns.bf16)
    arena = int(model.working_set_nbytes * ns.fraction) // 4096 * 4096
    with tempfile.TemporaryDirectory(dir=ns.dir) as workdir, \
            PrivateDaemon.start(Path(workdir) / "d", arena_size=2 * arena,
                                swap_dirs=[str(Path(workdir) / "swap")]) as daemon:
        per_step = run_steps(daemon.socket_path, "zero", model, arena, ns.steps)
    least = least_swap_nbytes(model, arena)
    for counters in per_step:
        print(json.dumps({"least": least, "transient": transient_nbytes(model),
                          **{k: round(v / least, 2) if least else v
                             for k, v in counters.items()}}))


if __name__ == "__main__":
    main()
