"""What the stage-3 gather-trace check (``trainer.zero.trace``) costs per training step.

    python bench/trace_check.py [--blocks 24] [--width 64] [--steps 30] [--rounds 3]

Two gloo ranks train the same stage-3 model (``--blocks`` residual MLP blocks,
one unit each, small enough that per-unit hook overhead is visible next to the
math) twice in one run: checked (the default engine) and unchecked (the same
engine with its trace detached). Each configuration runs ``--rounds`` times,
alternating, to spread the shared machine's noise.

- ``step_ms``: median step time over steps 2..N (the check is a local list
  comparison per unit use);
- ``first_step_ms``: step 1, when every gather is announced to the peers with
  a small all-gather (``announced``: how many);
- ``ratio_vs_unchecked`` = unchecked median / checked median (> 1: the checked
  engine is faster; ~1 means the check is free), ``ratio_vs_unchecked_first_step``
  likewise for step 1.

The last line is one JSON object with these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.fc2(torch.relu(self.fc1(self.norm(hidden))))


class Net(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.blocks(hidden).square().mean()


def train(args: argparse.Namespace, rank: int, checked: bool) -> dict[str, Any]:
    import trainer

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, _, _, _ = trainer.initialize(model=Net(args.blocks, args.width), config=config)
    if not checked:
        engine.trace = None
        engine.placement.full.before_gather = None  # type: ignore[attr-defined]
    batch = torch.randn(8, args.width, generator=torch.Generator().manual_seed(rank))
    times = []
    try:
        for _ in range(args.steps):
            dist.barrier()
            started = time.perf_counter()
            engine.backward(engine(batch))
            engine.step()
            times.append(time.perf_counter() - started)
        announced = engine.trace.num_announced if engine.trace is not None else 0
    finally:
        engine.close()
    return {"first_s": times[0], "steady_s": statistics.median(times[1:]),
            "announced": announced}


def rank_main(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    runs: dict[str, list[dict[str, Any]]] = {"checked": [], "unchecked": []}
    for _ in range(args.rounds):
        for name in ("checked", "unchecked"):
            runs[name].append(train(args, rank, name == "checked"))
    if rank == 0:
        results.put(runs)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=rank_main, args=(rank, args, port, results))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    runs = results.get(timeout=600)
    for proc in procs:
        proc.join()
    summary: dict[str, Any] = {"blocks": args.blocks, "width": args.width,
                               "steps": args.steps, "rounds": args.rounds}
    for name, measured in runs.items():
        summary[f"{name}_step_ms"] = 1e3 * statistics.median(r["steady_s"] for r in measured)
        summary[f"{name}_first_step_ms"] = 1e3 * statistics.median(
            r["first_s"] for r in measured)
    summary["announced"] = runs["checked"][0]["announced"]
    summary["ratio_vs_unchecked"] = summary["unchecked_step_ms"] / summary["checked_step_ms"]
    summary["ratio_vs_unchecked_first_step"] = (summary["unchecked_first_step_ms"]
                                                / summary["checked_first_step_ms"])
    print(json.dumps({key: round(value, 4) if isinstance(value, float) else value
                      for key, value in summary.items()}))


if __name__ == "__main__":
    main()
