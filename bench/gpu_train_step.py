"""GPT training step on the compute device: ZeRO-3, params + optimizer offloaded through offloadd.

One process per GPU (``torchrun --nproc-per-node N bench/gpu_train_step.py``) or a
single process. The model is ``trainer.demo.train.TinyGPT`` sized by
``--gpt WIDTH,DEPTH,HEADS`` (2048,20,16 is ~1.0B parameters), bf16, trained by
``trainer.initialize`` with ``offload_param`` + ``offload_optimizer`` on ``nvme``
(swap files under ``--swap-dir``) through a private daemon, copies through the
copy engine of ``--device`` (``cuda``: streams + events; ``cpu``: the inline or twin
engine, for a smoke run without a GPU).

Reported: tokens/s (median step); on CUDA, from one profiled step, the SM busy fraction
(union of kernel intervals / wall; memcpy and memset are not compute), the seconds the H2D
and D2H copy engines were busy, and the daemon's Adam seconds per step, each separately.
``--grad-accum``, ``--micro-batch`` and ``--offload-param none`` give the large-batch
configuration (optimizer offloaded, >= 64k tokens per step) next to the 2k-token stress case.
When ``import deepspeed``
works, DeepSpeed ZeRO-3 with the same model, batches and offload config (params +
optimizer on NVMe under its own swap dir) runs in the same invocation, each
contender in a child process of its own (one distributed init per process), and
``ratio_vs_deepspeed`` = DeepSpeed's median step / ours (> 1: ours faster);
``--no-deepspeed`` skips it. On ``--device cpu`` DeepSpeed runs with
``DS_ACCELERATOR=cpu`` and gloo (a smoke run of the comparison without a GPU).

    python bench/gpu_train_step.py --device cuda --gpt 2048,20,16 --steps 6
    python bench/gpu_train_step.py --device cuda --offload-param none --offload-optimizer cpu \
        --micro-batch 16 --grad-accum 8 --steps 3        # 64k tokens per step
    python bench/gpu_train_step.py --device cpu --gpt 64,2,4 --steps 3   # smoke, no GPU
    python bench/gpu_train_step.py --device-copies daemon ...   # the daemon copies (cupy)

``bench/train_step.py --device cuda ...`` runs this script with the same arguments.

Last line: JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer
from trainer.demo.train import TinyGPT


def _offload(device: str, swap_dir: str) -> dict:
    return {"device": device, "nvme_path": swap_dir} if device == "nvme" else {"device": device}


def _config(swap_dir: str, args: argparse.Namespace) -> dict:
    return {
        "offloadd": {"device_copies": args.device_copies},
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "device": args.device,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": _offload(args.offload_optimizer, swap_dir),
            "offload_param": _offload(args.offload_param, swap_dir),
        },
        "units": {"module_classes": ["GPTBlock"]},
    }


def _batch(step: int, vocab: int, micro_batch: int, seq_len: int,
           device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=generator).to(device)


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start_us, end_us)`` intervals."""
    covered_us, reach_us = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach_us:
            covered_us += end - max(start, reach_us)
            reach_us = end
    return covered_us * 1e-6


def _profile(step_fn: Callable[[], None]) -> dict[str, Any]:
    """One profiled step on CUDA: SM busy = union of kernel intervals / wall (memcpy and
    memset are not compute), and the seconds the H2D and D2H copy engines were busy."""
    if not torch.cuda.is_available():
        step_fn()  # the step still runs: its Adam seconds are counted
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    spans: dict[str, list[tuple[float, float]]] = {"kernel": [], "h2d": [], "d2h": []}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = ("h2d" if "htod" in name else "d2h" if "dtoh" in name else None) \
            if name.startswith("memcpy") else None if name.startswith("memset") else "kernel"
        if kind is not None:
            spans[kind].append((event.time_range.start, event.time_range.end))
    return {"profiled_step_s": wall_s,
            "sm_busy_fraction": _union_s(spans["kernel"]) / wall_s if spans["kernel"] else None,
            "h2d_busy_s": _union_s(spans["h2d"]), "d2h_busy_s": _union_s(spans["d2h"]),
            "num_kernels": len(spans["kernel"])}


def _stepper(engine: Any, args: argparse.Namespace,
             device: torch.device) -> Callable[[int], None]:
    """One optimizer step: ``--grad-accum`` micro-batches (DeepSpeed's API: step() after
    every backward applies the update at the accumulation boundary)."""
    def one_step(step: int) -> None:
        for micro in range(args.grad_accum):
            batch = _batch(step * args.grad_accum + micro, args.vocab, args.micro_batch,
                           args.seq_len, device)
            loss = engine(batch)
            engine.backward(loss)
            engine.step()

    return one_step


def _timed(one_step: Callable[[int], None], device: torch.device, warmup: int,
           steps: int) -> list[float]:
    step_s: list[float] = []
    for step in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        one_step(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= warmup:
            step_s.append(time.perf_counter() - started)
    return step_s


def _model(args: argparse.Namespace) -> TinyGPT:
    width, depth, heads = (int(part) for part in args.gpt.split(","))
    torch.manual_seed(0)
    return TinyGPT(vocab=args.vocab, width=width, depth=depth, heads=heads,
                   max_len=args.seq_len)


def run_ours(args: argparse.Namespace, swap_dir: str) -> dict[str, Any]:
    model = _model(args)
    num_params = sum(param.numel() for param in model.parameters())
    engine, _, _, _ = trainer.initialize(model=model, config=_config(swap_dir, args))
    device = engine.collectives.device
    one_step = _stepper(engine, args, device)

    try:
        step_s = _timed(one_step, device, args.warmup, args.steps)
        before = engine.offload_stats().get("optimizer", {})
        profiled = _profile(lambda: one_step(args.warmup + args.steps))
        stats = engine.offload_stats()
        adam = {key: stats.get("optimizer", {}).get(key, 0) - before.get(key, 0)
                for key in ("steps", "step_s")}
    finally:
        engine.close()
    return {"device": str(device), "num_params": num_params, "step_s": step_s,
            "world_size": engine.collectives.world_size, **profiled,
            "adam_s": adam["step_s"], "adam_unit_steps": adam["steps"],
            "copy_engine": stats.get("rank_copy_engine"),
            "arena_pinned": stats.get("rank_arena_pinned"),
            "device_copies": stats.get("rank_device_copies"),
            "device_copies_fallback": stats.get("rank_device_copies_reason") or None}


def run_deepspeed(args: argparse.Namespace, swap_dir: str) -> dict[str, Any]:
    """DeepSpeed ZeRO-3, same model, batches and offload (params + optimizer on NVMe)."""
    import warnings

    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(args.port))):
        os.environ.setdefault(key, value)
    warnings.simplefilter("ignore", FutureWarning)  # DeepSpeed calls deprecated c10d names
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo",
                               verbose=False)
    config = _config(swap_dir, args)
    for ours_only in ("offloadd", "device", "units"):
        config.pop(ours_only)
    config["steps_per_print"] = 10**9
    model = _model(args)
    num_params = sum(param.numel() for param in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=None)
    device = engine.device if isinstance(engine.device, torch.device) \
        else torch.device(engine.device)
    one_step = _stepper(engine, args, device)
    step_s = _timed(one_step, device, args.warmup, args.steps)
    profiled = _profile(lambda: one_step(args.warmup + args.steps))
    return {"device": str(device), "num_params": num_params, "step_s": step_s,
            "world_size": engine.world_size, **profiled}


def _child(args: argparse.Namespace, contender: str) -> tuple[dict[str, Any] | None, str]:
    """Run one contender in a child process; its last stdout line is its JSON."""
    argv = [sys.executable, __file__, "--contender", contender, *sys.argv[1:]]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return None, f"{contender} failed (rc {result.returncode}): {result.stderr[-600:]}"
    return json.loads(lines[-1]), ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpt", default="2048,20,16", help="WIDTH,DEPTH,HEADS")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step (gradient_accumulation_steps)")
    parser.add_argument("--offload-param", choices=["nvme", "cpu", "none"], default="nvme")
    parser.add_argument("--offload-optimizer", choices=["nvme", "cpu"], default="nvme",
                        help="the tier of both contenders (DeepSpeed runs the same config)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--swap-dir", default=None)
    parser.add_argument("--device-copies", choices=["rank", "daemon"], default="rank",
                        help="who copies arena <-> GPU: the rank's streams or the daemon's")
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="skip DeepSpeed ZeRO-3 even where it is installed")
    parser.add_argument("--port", type=int, default=29533, help="DeepSpeed's rendezvous port")
    parser.add_argument("--contender", choices=["ours", "deepspeed"], default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender is not None:  # a child: one contender, its JSON on the last line
        swap_dir = os.path.join(args.swap_dir or tempfile.mkdtemp(prefix="offloadd-gpu-swap-"),
                                args.contender)
        os.makedirs(swap_dir, exist_ok=True)
        run = run_ours if args.contender == "ours" else run_deepspeed
        print(json.dumps(run(args, swap_dir)))
        return
    notes: list[str] = []
    ours, failure = _child(args, "ours")
    if ours is None:
        raise SystemExit(failure)
    peer = None
    if args.no_deepspeed:
        notes.append("DeepSpeed skipped (--no-deepspeed)")
    elif importlib.util.find_spec("deepspeed") is None:
        notes.append("deepspeed not importable here (pip install deepspeed): no ratio")
    else:
        peer, failure = _child(args, "deepspeed")
        if peer is None:
            notes.append(f"deepspeed: {failure}")
    tokens = args.micro_batch * args.seq_len * args.grad_accum * ours["world_size"]
    median_s = statistics.median(ours["step_s"])
    peer_s = statistics.median(peer["step_s"]) if peer else None
    print(json.dumps({
        "bench": "gpu_train_step", "device": ours["device"],
        "gpu": torch.cuda.get_device_name(0) if ours["device"].startswith("cuda") else None,
        "num_params": ours["num_params"], "gpt": args.gpt, "world_size": ours["world_size"],
        "tier": {"param": args.offload_param, "optimizer": args.offload_optimizer},
        "tokens_per_step": tokens, "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum, "seq_len": args.seq_len,
        "step_s_median": median_s, "tokens_per_s": tokens / median_s,
        "step_s": ours["step_s"], "deepspeed_step_s": peer["step_s"] if peer else None,
        "sm_busy_fraction": ours.get("sm_busy_fraction"),
        "h2d_busy_s": ours.get("h2d_busy_s"), "d2h_busy_s": ours.get("d2h_busy_s"),
        "adam_s_per_step": ours["adam_s"], "profiled_step_s": ours.get("profiled_step_s"),
        "deepspeed_sm_busy_fraction": peer.get("sm_busy_fraction") if peer else None,
        "copy_engine": ours["copy_engine"],
        "arena_pinned": ours["arena_pinned"], "device_copies": ours["device_copies"],
        "device_copies_fallback": ours["device_copies_fallback"],
        "deepspeed_step_s_median": peer_s,
        "deepspeed_tokens_per_s": tokens / peer_s if peer_s else None,
        "ratio_vs_deepspeed": round(peer_s / median_s, 3) if peer_s else None,
        "notes": notes,
    }))


if __name__ == "__main__":
    main()
