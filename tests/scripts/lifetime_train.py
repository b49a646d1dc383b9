"""A DeepSpeed-style script for the private daemon's lifetime, launched by torchrun: ZeRO-3,
parameters and optimizer state offloaded to NVMe through the private daemon that local
rank 0 starts. Like most DeepSpeed scripts it never calls ``engine.close()``.

    torchrun --nproc-per-node 2 tests/scripts/lifetime_train.py --nvme DIR --out DIR \\
        [--rank0-first | --until-killed] [--grace SECONDS] [--socket PATH --job NAME]

Every rank writes ``<out>/rank<r>.json`` after its first step: its pid, the daemon's pid
and, on local rank 0, the daemon's scratch dirs.

``--rank0-first``: after training rank 0 exits at once, as a script whose rank 0 prints
and leaves does; rank 1 waits until rank 0's process is gone, reads its optimizer state
through the daemon again, checks it against what it read before, and writes
``<out>/rank1.done``.
``--until-killed``: trains until the test kills a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from ds_train_gpt import global_batch, make_model

import trainer

MICRO_BATCH = 2
RANK0_EXIT_WAIT_S = 120.0
"""Longest rank 1 waits for rank 0 to exit (a hang bound, not a speed claim)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grace", type=float, default=15.0,
                        help="offloadd.private_exit_grace_s")
    parser.add_argument("--socket", help="offloadd.socket: a running daemon, not a private one")
    parser.add_argument("--job", help="offloadd.job")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--rank0-first", action="store_true")
    mode.add_argument("--until-killed", action="store_true")
    return parser.parse_args()


def ds_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    offload = {"device": "nvme", "nvme_path": args.nvme}
    return {"train_batch_size": MICRO_BATCH * world,
            "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "zero_optimization": {"stage": 3, "offload_optimizer": offload,
                                  "offload_param": offload},
            "offloadd": {"private_exit_grace_s": args.grace, "socket": args.socket,
                         "job": args.job}}


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def report(engine: Any, out: Path, rank: int) -> None:
    daemon = engine.backend.private_daemon
    info = {"pid": os.getpid(), "daemon_pid": engine.backend.client.daemon_pid,
            "scratch_dirs": daemon.scratch_dirs if daemon is not None else []}
    path = out / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(info))
    path.with_suffix(".tmp").rename(path)  # the test never reads half a file


def optimizer_state(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's partition of every unit's master and moments, read from the daemon."""
    return {f"u{unit.index}.{kind}": value for unit in engine.units
            for kind, value in engine.backend.get_state(unit.index).items()}


def outlive_rank0(engine: Any, rank0_pid: int, out: Path) -> None:
    engine.backend.wait_steps()
    before = optimizer_state(engine)
    trainer.comm.barrier()  # rank 0 leaves after this
    deadline = time.monotonic() + RANK0_EXIT_WAIT_S
    while not process_gone(rank0_pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 (pid {rank0_pid}) did not exit")
        time.sleep(0.05)
    after = optimizer_state(engine)  # the daemon local rank 0 started still serves us
    assert before.keys() == after.keys() and before, sorted(before)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    (out / "rank1.done").write_text(json.dumps(sorted(after)))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    trainer.init_distributed(dist_backend="gloo")
    rank, world = trainer.comm.get_rank(), trainer.comm.get_world_size()
    model = make_model()
    engine, *_ = trainer.initialize(model=model, config=ds_config(args, world),
                                    model_parameters=model.parameters())
    pids = [0] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    out = Path(args.out)
    step = 0
    while step < args.steps or args.until_killed:
        ids = global_batch(step, MICRO_BATCH * world)[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        step += 1
        if step == 1:
            report(engine, out, rank)
    if args.rank0_first:
        if rank == 0:
            trainer.comm.barrier()
            print(f"rank 0 done after {step} steps", flush=True)
            return  # no engine.close(), no barrier: rank 1 is still at work
        outlive_rank0(engine, pids[0], out)


if __name__ == "__main__":
    main()
