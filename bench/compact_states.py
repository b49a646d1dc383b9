"""Compact Adam moments (``zero_optimization.offload_optimizer.state_dtype``) vs fp32 ones.

Two parts, one run:

1. **IO-bound steps.** 2 gloo ranks train ``trainer.demo.train.TinyGPT`` (fp32, ZeRO-3,
   parameters and optimizer on nvme) through a private daemon whose arena is capped at the
   same size for every case: half of the fp32-state working set, so state swaps every
   step. Micro-batch 1 x 16 tokens by default (issue 21's setting): little compute per
   byte of state, so the step is bound by the disk. One run per state dtype (``fp32``,
   ``bf16``, ``8bit``), order rotated per round; a step's time is its slowest rank's, each
   figure the median over all rounds' timed steps. Also reported: NVMe bytes read +
   written per step (the daemon's swap counters) and the optimizer state's bytes per
   parameter (fp32 master + both moments: 12, 8, 6.03).
2. **Accuracy.** ``loss_curve``: a small GPT (TinyGPT, 2 x 64, vocab 128) trained from
   scratch on a fixed Markov-chain corpus with ``offloadd.compute.adam.adam_step`` (the daemon's
   kernel) for ``--accuracy-steps`` steps, once per state dtype from the same init and data.
   Reported: the largest relative gap of the 20-step moving-average loss to fp32's, and
   each final loss (mean of the last 20 steps).

    python bench/compact_states.py [--steps 6] [--warmup 2] [--rounds 2]
                                   [--micro-batch 1] [--seq 16] [--width 320] [--depth 6]
                                   [--accuracy-steps 400] [--no-io]

The last line is JSON. ``ratio_vs_fp32_states_<case>_step`` = fp32 median step / the
case's; ``_bytes_per_param`` = 12 / the case's state bytes per parameter;
``_disk_bytes`` = fp32's NVMe bytes per step / the case's (> 1: compact is better).
``loss_rel_gap_<case>`` is the accuracy figure (lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offloadd import moment_codec
from offloadd.compute import adam
from offloadd.formats import moment_nbytes
from trainer.config import STATE_DTYPE_FORMATS
from trainer.demo.train import TinyGPT, demo_config, half_working_set_nbytes, synthetic_batch

WORLD = 2
CASES = ("fp32", "bf16", "8bit")


def state_bytes_per_param(state_dtype: str) -> float:
    """fp32 master + exp_avg + exp_avg_sq, per parameter (large partitions)."""
    numel = 1 << 20
    return (4 * numel + 2 * moment_nbytes(STATE_DTYPE_FORMATS[state_dtype], numel)) / numel


# ---------------------------------------------------------------- accuracy

VOCAB, SEQ, BATCH = 128, 32, 16


def markov_batch(step: int, successors: torch.Tensor) -> torch.Tensor:
    """BATCH sequences of a fixed chain: each token is followed by one of 4 successors."""
    generator = torch.Generator().manual_seed(step)
    ids = [torch.randint(0, VOCAB, (BATCH,), generator=generator)]
    for _ in range(SEQ - 1):
        pick = torch.randint(0, successors.shape[1], (BATCH,), generator=generator)
        ids.append(successors[ids[-1], pick])
    return torch.stack(ids, dim=1)


def loss_curve(state_dtype: str, steps: int, lr: float = 3e-3) -> list[float]:
    """Per-step losses of TinyGPT trained with ``offloadd.compute.adam`` over moments stored in
    ``state_dtype``: the parameters are views of one flat fp32 master, as a unit's are.
    One torch thread: this small model runs ~20x slower on two (oversubscribed) cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _loss_curve(state_dtype, steps, lr)
    finally:
        torch.set_num_threads(threads)


def _loss_curve(state_dtype: str, steps: int, lr: float) -> list[float]:
    torch.manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(1))
    model = TinyGPT(vocab=VOCAB, width=64, depth=2, heads=4, max_len=SEQ)
    params = list(model.parameters())
    master = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for param in params:
        param.data = master[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    fmt = STATE_DTYPE_FORMATS[state_dtype]
    exp_avg, exp_avg_sq = (moment_codec.empty(fmt, master.numel()).zero_() for _ in range(2))
    grad = torch.empty_like(master)
    losses = []
    for step in range(1, steps + 1):
        model.zero_grad(set_to_none=False)
        loss = model(markov_batch(step, successors))
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=grad)  # type: ignore[union-attr]
        adam.adam_step(master, exp_avg, exp_avg_sq, grad, step=step, lr=lr, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=0.01, rounding_seed=0)
        losses.append(loss.item())
    return losses


def moving_average(values: list[float], window: int = 20) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def loss_rel_gap(ours: list[float], fp32: list[float]) -> float:
    """Largest |ours - fp32| / fp32 of the 20-step moving averages."""
    return max(abs(a - b) / b for a, b in zip(moving_average(ours), moving_average(fp32),
                                              strict=True))


# ---------------------------------------------------------------- IO-bound steps


def _swap_nbytes(stats: dict[str, Any]) -> int:
    dirs = (stats.get("swap") or {}).get("dirs", [])
    return sum(int(d.get("read_nbytes", 0)) + int(d.get("written_nbytes", 0)) for d in dirs)


def _rank(rank: int, port: int, state_dtype: str, steps: int, warmup: int, workdir: str,
          micro_batch: int, seq: int, width: int, depth: int) -> dict[str, Any]:
    import trainer

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    torch.manual_seed(0)
    shape = {"width": width, "depth": depth, "heads": max(1, width // 64)}
    numel = sum(p.numel() for p in TinyGPT(**shape).parameters())
    config = demo_config(os.path.join(workdir, "swap"), "nvme")
    config["zero_optimization"]["offload_optimizer"]["state_dtype"] = state_dtype
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["offloadd"] = {"workdir": os.path.join(workdir, "daemon"),
                          "arena_size": half_working_set_nbytes(numel)}
    engine, _, _, _ = trainer.initialize(model=TinyGPT(**shape), config=config)
    times, before = [], 0
    try:
        for step in range(warmup + steps):
            if step == warmup:
                engine.backend.wait_steps()
                before = _swap_nbytes(engine.offload_stats())
            dist.barrier()
            started = time.perf_counter()
            engine.backward(engine(synthetic_batch(step, rank)[:micro_batch, :seq + 1]))
            engine.step()
            if step >= warmup:
                times.append(time.perf_counter() - started)
        engine.backend.wait_steps()
        moved = _swap_nbytes(engine.offload_stats()) - before
        return {"times": times, "disk_nbytes_per_step": moved / steps}
    finally:
        engine.close()
        dist.destroy_process_group()


def _rank_main(rank: int, port: int, args: tuple[Any, ...], results: Any) -> None:
    try:
        results.put((rank, _rank(rank, port, *args)))
    except BaseException as error:
        results.put((rank, {"error": f"{type(error).__name__}: {error}"}))


def run_case(state_dtype: str, steps: int, warmup: int, micro_batch: int, seq: int,
             width: int, depth: int) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-compact-", dir="/var/tmp") as workdir:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        procs = [context.Process(target=_rank_main, args=(
            rank, port, (state_dtype, steps, warmup, workdir, micro_batch, seq, width, depth),
            results))
            for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        outcomes = dict(results.get(timeout=900) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    errors = [o["error"] for o in outcomes.values() if "error" in o]
    if errors:
        raise RuntimeError(f"{state_dtype}: {errors[0]}")
    return {"step_times": [max(pair) for pair in zip(outcomes[0]["times"], outcomes[1]["times"],
                                                     strict=True)],
            "disk_nbytes_per_step": outcomes[0]["disk_nbytes_per_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="sequences per rank and step (small: IO-bound)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=320, help="TinyGPT width (heads: /64)")
    parser.add_argument("--depth", type=int, default=6, help="TinyGPT blocks")
    parser.add_argument("--accuracy-steps", type=int, default=400,
                        help="steps of the accuracy part (0: skip it)")
    parser.add_argument("--no-io", action="store_true", help="the accuracy part only")
    args = parser.parse_args()
    summary: dict[str, Any] = {}
    curves = {case: loss_curve(case, args.accuracy_steps) for case in CASES} \
        if args.accuracy_steps else {}
    for case, curve in curves.items():
        tail = curve[-20:]
        summary[f"final_loss_{case}"] = round(statistics.fmean(tail), 4)
        print(f"accuracy {case}: loss {curve[0]:.3f} -> {statistics.fmean(tail):.4f}",
              flush=True)
    for case in CASES[1:] if curves else ():
        summary[f"loss_rel_gap_{case}"] = round(loss_rel_gap(curves[case], curves["fp32"]), 4)
        summary[f"ratio_vs_fp32_states_{case}_bytes_per_param"] = round(
            state_bytes_per_param("fp32") / state_bytes_per_param(case), 3)
    summary["accuracy_steps"] = args.accuracy_steps
    if not args.no_io:
        steps: dict[str, list[float]] = {case: [] for case in CASES}
        disk: dict[str, list[float]] = {case: [] for case in CASES}
        for round_index in range(args.rounds):
            order = CASES[round_index % 3:] + CASES[:round_index % 3]
            for case in order:
                outcome = run_case(case, args.steps, args.warmup, args.micro_batch, args.seq,
                                   args.width, args.depth)
                steps[case] += outcome["step_times"]
                disk[case].append(outcome["disk_nbytes_per_step"])
                print(f"{case}: step {statistics.median(outcome['step_times']):.3f} s, disk "
                      f"{outcome['disk_nbytes_per_step'] / 1e6:.1f} MB/step", flush=True)
        for case in CASES:
            summary[f"step_s_{case}"] = round(statistics.median(steps[case]), 4)
            summary[f"disk_mb_per_step_{case}"] = round(statistics.median(disk[case]) / 1e6, 2)
        for case in CASES[1:]:
            summary[f"ratio_vs_fp32_states_{case}_step"] = round(
                summary["step_s_fp32"] / summary[f"step_s_{case}"], 3)
            disk_mb = summary[f"disk_mb_per_step_{case}"]  # 0 when the state fits the arena
            summary[f"ratio_vs_fp32_states_{case}_disk_bytes"] = (
                round(summary["disk_mb_per_step_fp32"] / disk_mb, 3) if disk_mb else None)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
