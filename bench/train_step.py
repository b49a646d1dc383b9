"""Training step time: our ZeRO-3 with params + optimizer offloaded through offloadd vs peers.

Measured in one run, 2 gloo ranks each, same model (offloadd.demo_train.TinyGPT)
and same data:

- ``torch``: plain data parallel, every rank holds everything, torch.optim.AdamW
  (fused CPU implementation when available), gradients all-reduced per step;
- ``ours``: trainer.initialize with ZeRO-3, offload_param + offload_optimizer on
  nvme (cpu when the daemon has no NVMe tier) via a private daemon;
- ``deepspeed``: DeepSpeed ZeRO-3 with the same offload config, when
  ``import deepspeed`` works (DS_ACCELERATOR=cpu), else reported as missing.

    python bench/train_step.py [--steps 12] [--warmup 2]

The last line is JSON with ``ratio_vs_torch_step`` = torch median / ours
median (> 1: ours faster) and ``ratio_vs_deepspeed`` (or null with a note).
"""

from __future__ import annotations

import argparse
import importlib.util
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

from offloadd.demo_train import TinyGPT, demo_config, synthetic_batch

WORLD = 2


def _init(rank: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)


def _timed_steps(step_fn: Any, rank: int, steps: int, warmup: int) -> list[float]:
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        started = time.perf_counter()
        step_fn(synthetic_batch(step, rank))
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return times


def torch_rank(rank: int, port: int, steps: int, warmup: int, workdir: str) -> dict[str, Any]:
    """Plain DDP + torch AdamW, nothing offloaded."""
    _init(rank, port)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

    def step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return {"times": _timed_steps(step, rank, steps, warmup)}


def ours_rank(rank: int, port: int, steps: int, warmup: int, workdir: str) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer state in the daemon."""
    import trainer

    _init(rank, port)
    torch.manual_seed(0)
    device = "nvme" if importlib.util.find_spec("offloadd.nvme") else "cpu"
    config = demo_config(os.path.join(workdir, "swap"), device)
    config["offloadd"] = {"workdir": os.path.join(workdir, "daemon")}
    engine, _, _, _ = trainer.initialize(model=TinyGPT(), config=config)

    def step(ids: torch.Tensor) -> None:
        engine.backward(engine(ids))
        engine.step()

    try:
        times = _timed_steps(step, rank, steps, warmup)
        return {"times": times, "stats": engine.offload_stats(), "device": device}
    finally:
        engine.close()


def deepspeed_rank(rank: int, port: int, steps: int, warmup: int,
                   workdir: str) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with the same offload config."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    _init(rank, port)
    torch.manual_seed(0)
    device = "nvme" if importlib.util.find_spec("offloadd.nvme") else "cpu"
    config = demo_config(os.path.join(workdir, f"ds-swap{rank}"), device)
    config.pop("units")
    engine, _, _, _ = deepspeed.initialize(model=TinyGPT(), config=config,
                                           model_parameters=None)

    def step(ids: torch.Tensor) -> None:
        engine.backward(engine(ids))
        engine.step()

    return {"times": _timed_steps(step, rank, steps, warmup)}


def _rank_main(rank: int, fn_name: str, port: int, steps: int, warmup: int, workdir: str,
               results: Any) -> None:
    try:
        outcome = globals()[fn_name](rank, port, steps, warmup, workdir)
        results.put((rank, outcome))
    except BaseException as error:
        results.put((rank, {"error": f"{type(error).__name__}: {error}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(fn_name: str, steps: int, warmup: int) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as workdir:
        port = _free_port()
        procs = [context.Process(target=_rank_main, args=(rank, fn_name, port, steps, warmup,
                                                          workdir, results))
                 for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        outcomes = dict(results.get(timeout=900) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    errors = [outcome["error"] for outcome in outcomes.values() if "error" in outcome]
    if errors:
        raise RuntimeError(f"{fn_name}: {errors[0]}")
    outcome = outcomes[0]
    # a step is as slow as its slowest rank
    outcome["median_s"] = statistics.median(
        max(pair) for pair in zip(outcomes[0]["times"], outcomes[1]["times"], strict=True))
    return outcome


def io_hidden_fraction(stats: dict[str, Any], measured_s: float) -> tuple[float | None, str]:
    """1 - (rank time blocked on the daemon) / (daemon IO time), if the daemon reports IO time."""
    io_s = sum(float(value) for key, value in stats.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)
               and any(word in key for word in ("io", "swap", "read", "write"))
               and (key.endswith("_s") or key.endswith("seconds")) and key != "rank_wait_s")
    wait_s = float(stats.get("rank_wait_s", 0.0))
    if io_s <= 0:
        return None, (f"not derivable: daemon stats report no IO time; rank 0 was blocked on "
                      f"the daemon {wait_s:.3f} s over {measured_s:.3f} s of steps")
    return max(0.0, 1.0 - wait_s / io_s), f"daemon IO {io_s:.3f} s, rank blocked {wait_s:.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch_result = run("torch_rank", args.steps, args.warmup)
    ours = run("ours_rank", args.steps, args.warmup)
    print(f"model: TinyGPT {sum(p.numel() for p in TinyGPT().parameters())} params, "
          f"{WORLD} ranks, gloo, {args.steps} timed steps after {args.warmup} warmup")
    print(f"torch DDP + AdamW (no offload): median step {torch_result['median_s'] * 1e3:.1f} ms")
    print(f"ours ZeRO-3 offload {ours['device']}: median step {ours['median_s'] * 1e3:.1f} ms")
    hidden, note = io_hidden_fraction(ours["stats"], sum(ours["times"]))
    print(f"IO hidden: {note}")
    ratio_ds, ds_note = None, "deepspeed not importable here"
    if importlib.util.find_spec("deepspeed") is not None:
        try:
            deepspeed_result = run("deepspeed_rank", args.steps, args.warmup)
            ratio_ds = deepspeed_result["median_s"] / ours["median_s"]
            ds_note = f"deepspeed median step {deepspeed_result['median_s'] * 1e3:.1f} ms"
        except RuntimeError as error:
            ds_note = f"deepspeed failed: {error}"
    print(ds_note)
    print(json.dumps({
        "ours_median_step_s": ours["median_s"], "torch_median_step_s": torch_result["median_s"],
        "ratio_vs_torch_step": torch_result["median_s"] / ours["median_s"],
        "ratio_vs_deepspeed": ratio_ds, "deepspeed_note": ds_note,
        "offload_device": ours["device"], "io_hidden_fraction": hidden,
    }))


if __name__ == "__main__":
    main()
