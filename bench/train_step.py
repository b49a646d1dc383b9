"""Training step time: our ZeRO-3 with params + optimizer offloaded through offloadd vs peers.

Measured in one run, 2 gloo ranks each, same model (trainer.demo.train.TinyGPT,
fp32), same data, same config (trainer.demo.train.demo_config: clip 1.0, AdamW,
WarmupLR):

- ``torch``: plain DistributedDataParallel, every rank holds everything,
  torch.optim.AdamW (default CPU implementation), nothing offloaded;
- ``ours``: trainer.initialize with ZeRO-3, offload_param + offload_optimizer on
  nvme (cpu when the daemon has no NVMe tier) via a private daemon;
- ``deepspeed``: DeepSpeed ZeRO-3 with the same offload config (its nvme_path in
  the same temporary directory), DS_ACCELERATOR=cpu,
  ``deepspeed.init_distributed(dist_backend="gloo")`` with torchrun's
  environment variables; skipped with a note when ``import deepspeed`` fails.

    python bench/train_step.py [--steps 12] [--warmup 2] [--rounds 2]
    OFFLOADD_BENCH_DEVICE=cpu python bench/train_step.py   # force the offload device
    python bench/train_step.py --device cuda [bench/gpu_train_step.py args]   # on a GPU

Contenders run once per round, in rotated order (other load on the host moves
all of them alike); a step's time is that of its slowest rank, and each figure
is the median over all rounds' timed steps.

The last line is JSON with ``ratio_vs_torch_step`` = torch median / ours median
and ``ratio_vs_deepspeed`` = DeepSpeed median / ours median (> 1: ours faster),
tokens/s of each, and ``io_hidden_fraction`` = 1 - (seconds rank 0 was blocked on
the daemon) / (daemon optimizer + NVMe IO seconds) over the timed steps, from
the daemon's stats (null with a note when the daemon reports no such time).
NVMe IO seconds are summed per request, so with several requests in flight they
exceed wall time; ``rank0_blocked_on_daemon_s_per_step`` is the plain figure.
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

from trainer.demo.train import (
    MICRO_BATCH,
    SEQ_LEN,
    TinyGPT,
    demo_config,
    half_working_set_nbytes,
    synthetic_batch,
)

WORLD = 2


def offload_device() -> str:
    """``OFFLOADD_BENCH_DEVICE`` (cpu|nvme), else nvme when the daemon has its NVMe tier."""
    wanted = os.environ.get("OFFLOADD_BENCH_DEVICE", "auto")
    if wanted != "auto":
        return wanted
    return "nvme" if importlib.util.find_spec("offloadd.swap.nvme") else "cpu"


def _init(rank: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)


def _timed_steps(step_fn: Any, rank: int, steps: int, warmup: int,
                 on_timed_start: Any = None) -> list[float]:
    times = []
    for step in range(warmup + steps):
        if step == warmup and on_timed_start is not None:
            on_timed_start()
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

    times = _timed_steps(step, rank, steps, warmup)
    return {"times": times, "pss_nbytes": proportional_rss_nbytes()}


def ours_rank(rank: int, port: int, steps: int, warmup: int, workdir: str) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer state in the daemon (engine's default arena)."""
    return _ours(rank, port, steps, warmup, workdir, arena_nbytes=None)


def ours_half_rank(rank: int, port: int, steps: int, warmup: int,
                   workdir: str) -> dict[str, Any]:
    """The same with the arena capped at half the working set: half the state swaps."""
    numel = sum(p.numel() for p in TinyGPT().parameters())
    return _ours(rank, port, steps, warmup, workdir,
                 arena_nbytes=half_working_set_nbytes(numel))


def proportional_rss_nbytes(pid: int | None = None, *, hugetlb: bool = False) -> int:
    """Pss of a process: shared arena pages are split between the processes mapping them,
    so summing it over the ranks and the daemon gives the node's real DRAM footprint.

    Pss leaves hugetlb pages out; ``hugetlb`` adds the ones the process maps (asked of
    the daemon only, which maps every arena: counted once per node)."""
    path = f"/proc/{pid or 'self'}/smaps_rollup"
    fields = ("Pss:", "Shared_Hugetlb:", "Private_Hugetlb:") if hugetlb else ("Pss:",)
    total = 0
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(fields):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def _ours(rank: int, port: int, steps: int, warmup: int, workdir: str,
          arena_nbytes: int | None) -> dict[str, Any]:
    import trainer

    _init(rank, port)
    torch.manual_seed(0)
    device = offload_device()
    config = demo_config(os.path.join(workdir, "swap"), device)
    config["offloadd"] = {"workdir": os.path.join(workdir, "daemon")}
    if arena_nbytes is not None:
        config["offloadd"]["arena_size"] = arena_nbytes
    engine, _, _, _ = trainer.initialize(model=TinyGPT(), config=config)
    before: dict[str, Any] = {}

    def step(ids: torch.Tensor) -> None:
        engine.backward(engine(ids))
        engine.step()

    try:
        times = _timed_steps(step, rank, steps, warmup,
                             on_timed_start=lambda: before.update(engine.offload_stats()))
        engine.backend.wait_steps()  # the last step's Adam belongs to the timed window
        after = engine.offload_stats()
        pss = proportional_rss_nbytes()
        daemon_pid = after.get("daemon_pid")
        if rank == 0 and daemon_pid:  # one daemon serves the node's ranks: count it once
            pss += proportional_rss_nbytes(int(daemon_pid), hugetlb=True)
        return {"times": times, "stats": after, "stats_delta": stats_delta(before, after),
                "device": device, "pss_nbytes": pss}
    finally:
        engine.close()


def deepspeed_rank(rank: int, port: int, steps: int, warmup: int,
                   workdir: str) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with the same offload config, launched like torchrun would."""
    import warnings

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    warnings.simplefilter("ignore", FutureWarning)  # DeepSpeed calls deprecated c10d names
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", distributed_port=port, verbose=False)
    torch.manual_seed(0)
    device = offload_device()
    config = demo_config(os.path.join(workdir, "ds-swap"), device)
    config.pop("units")
    config["steps_per_print"] = 10**9
    engine, _, _, _ = deepspeed.initialize(model=TinyGPT(), config=config,
                                           model_parameters=None)

    def step(ids: torch.Tensor) -> None:
        engine.backward(engine(ids))
        engine.step()

    times = _timed_steps(step, rank, steps, warmup)
    return {"times": times, "device": device, "pss_nbytes": proportional_rss_nbytes()}


def _numbers(stats: Any, prefix: str = "") -> dict[str, float]:
    """Flattened numeric leaves of a stats dict (``swap.io_seconds.read`` ...)."""
    out: dict[str, float] = {}
    if isinstance(stats, dict):
        for key, value in stats.items():
            out.update(_numbers(value, f"{prefix}{key}."))
    elif isinstance(stats, (int, float)) and not isinstance(stats, bool):
        out[prefix[:-1]] = float(stats)
    return out


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What the counters moved by over the timed steps."""
    old = _numbers(before)
    return {key: value - old.get(key, 0.0) for key, value in _numbers(after).items()}


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
    with tempfile.TemporaryDirectory(prefix="bench-train-", dir="/var/tmp") as workdir:
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
    outcome["node_pss_nbytes"] = sum(o.get("pss_nbytes", 0) for o in outcomes.values())
    # a step is as slow as its slowest rank
    outcome["step_times"] = [max(pair) for pair in zip(outcomes[0]["times"], outcomes[1]["times"],
                                                       strict=True)]
    return outcome


# Daemon-side work the rank could have waited for: the optimizer service's step time and
# the NVMe tier's read/write time (flattened stats keys, whichever the daemon reports).
DAEMON_WORK_KEYS = ("optimizer.step_s", "optimizer.seconds", "optimizer_step_s",
                    "swap.io_seconds.read", "swap.io_seconds.write")


def io_hidden_fraction(delta: dict[str, float]) -> tuple[float | None, str]:
    """1 - (rank time blocked on the daemon) / (daemon IO + optimizer time), timed steps only."""
    work = {key: delta[key] for key in DAEMON_WORK_KEYS if key in delta}
    work_s = sum(work.values())
    wait_s = delta.get("rank_wait_s", 0.0)
    if work_s <= 0:
        return None, (f"not derivable: the daemon's stats report no optimizer/IO time "
                      f"(looked for {', '.join(DAEMON_WORK_KEYS)}); rank 0 was blocked on the "
                      f"daemon {wait_s:.3f} s")
    parts = ", ".join(f"{key} {value:.3f} s" for key, value in work.items())
    return max(0.0, 1.0 - wait_s / work_s), f"daemon work {work_s:.3f} s ({parts}), " \
        f"rank 0 blocked {wait_s:.3f} s"


CONTENDERS = {"torch": "torch_rank", "ours": "ours_rank", "ours_half": "ours_half_rank",
              "deepspeed": "deepspeed_rank"}


def measure(names: list[str], rounds: int, steps: int, warmup: int,
            notes: list[str]) -> dict[str, dict[str, Any]]:
    """Every contender once per round, order rotated (neighbours on the host add noise)."""
    results: dict[str, dict[str, Any]] = {}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if name in results and "error" in results[name]:
                continue
            try:
                outcome = run(CONTENDERS[name], steps, warmup)
            except RuntimeError as error:
                results[name] = {"error": str(error)}
                notes.append(f"{name} failed: {str(error)[:2000]}")
                continue
            merged = results.setdefault(name, {"step_times": []})
            merged["step_times"] += outcome.pop("step_times")
            merged.update(outcome)
    for result in results.values():
        if "step_times" in result:
            result["median_s"] = statistics.median(result["step_times"])
    return results


def _delegate_to_gpu_train_step() -> bool:
    """``--device cuda``: the GPU train step (bench/gpu_train_step.py) with the other args."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    known, rest = parser.parse_known_args()
    if known.device != "cuda":
        return False
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_train_step

    sys.argv = [gpu_train_step.__file__, "--device", "cuda", *rest]
    gpu_train_step.main()
    return True


def main() -> None:
    if _delegate_to_gpu_train_step():
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: run bench/gpu_train_step.py (a GPT on the GPU) instead")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    notes: list[str] = []
    names = ["torch", "ours"]
    if offload_device() == "nvme":
        names.append("ours_half")
    else:  # without the swap tier a half-size arena cannot hold the state: nothing to run
        notes.append("ours_half skipped: a half-size arena needs the nvme offload device")
    if importlib.util.find_spec("deepspeed") is not None:
        names.append("deepspeed")
    else:
        notes.append("deepspeed not importable here (pip install deepspeed; DS_ACCELERATOR=cpu)")
    results = measure(names, args.rounds, args.steps, args.warmup, notes)
    tokens_per_step = MICRO_BATCH * SEQ_LEN * WORLD
    print(f"model: TinyGPT {sum(p.numel() for p in TinyGPT().parameters())} params, "
          f"{WORLD} ranks, gloo, {args.rounds} rounds x {args.steps} timed steps "
          f"after {args.warmup} warmup, {tokens_per_step} tokens/step")
    summary: dict[str, Any] = {"bench": "train_step", "tokens_per_step": tokens_per_step}
    for name, result in results.items():
        if "median_s" in result:
            label = f"{name} ({result.get('device', 'no offload')})"
            print(f"{label:<22} median step {result['median_s'] * 1e3:8.1f} ms  "
                  f"{tokens_per_step / result['median_s']:9.0f} tokens/s")
            summary[f"{name}_median_step_s"] = round(result["median_s"], 5)
            summary[f"{name}_node_pss_MiB"] = round(result.get("node_pss_nbytes", 0) / 2**20, 1)
            summary[f"{name}_tokens_per_s"] = round(tokens_per_step / result["median_s"], 1)
    ours = results.get("ours", {})
    if "median_s" not in ours:
        print(json.dumps({**summary, "notes": notes}))
        raise SystemExit(1)
    for peer, key in (("torch", "ratio_vs_torch_step"), ("deepspeed", "ratio_vs_deepspeed")):
        peer_s = results.get(peer, {}).get("median_s")
        summary[key] = round(peer_s / ours["median_s"], 3) if peer_s else None
    half_s = results.get("ours_half", {}).get("median_s")
    deepspeed_s = results.get("deepspeed", {}).get("median_s")
    summary["ratio_vs_deepspeed_half_arena"] = (
        round(deepspeed_s / half_s, 3) if half_s and deepspeed_s else None)
    torch_s = results.get("torch", {}).get("median_s")
    summary["ratio_vs_torch_step_half_arena"] = (
        round(torch_s / half_s, 3) if half_s and torch_s else None)
    summary["offload_device"] = ours["device"]
    summary["deepspeed_offload_device"] = results.get("deepspeed", {}).get("device")
    # IO happens where the arena is smaller than the working set: measure it there.
    swapping = results.get("ours_half", {})
    hidden, note = io_hidden_fraction(swapping.get("stats_delta") or ours["stats_delta"])
    print(f"IO hidden: {note}")
    summary["io_hidden_fraction"] = None if hidden is None else round(hidden, 3)
    summary["io_hidden_note"] = note
    summary["rank0_blocked_on_daemon_s_per_step"] = round(
        ours["stats_delta"].get("rank_wait_s", 0.0) / args.steps, 5)
    if notes:
        summary["notes"] = notes
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
