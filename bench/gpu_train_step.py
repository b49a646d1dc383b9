"""GPT training step on the compute device: ZeRO-3, params + optimizer offloaded through offloadd.

One process per GPU (``torchrun --nproc-per-node N bench/gpu_train_step.py``) or a
single process. The model is ``offloadd.demo_train.TinyGPT`` sized by
``--gpt WIDTH,DEPTH,HEADS`` (2048,20,16 is ~1.0B parameters), bf16, trained by
``trainer.initialize`` with ``offload_param`` + ``offload_optimizer`` on ``nvme``
(swap files under ``--swap-dir``) through a private daemon, copies through the
copy engine of ``--device`` (``cuda``: streams + events; ``cpu``: the inline or twin
engine, for a smoke run without a GPU).

Reported: tokens/s (median step), and on CUDA the GPU busy fraction = CUDA kernel
time / wall time of one profiled step (torch.profiler). DeepSpeed ZeRO-3 with the
same offload config is not run by this script yet: ``ratio_vs_deepspeed`` is null
with a note (bench/train_step.py runs DeepSpeed on CPU/gloo).

    python bench/gpu_train_step.py --device cuda --gpt 2048,20,16 --steps 6
    python bench/gpu_train_step.py --device cpu --gpt 64,2,4 --steps 3   # smoke, no GPU
    python bench/gpu_train_step.py --device-copies daemon ...   # the daemon copies (cupy)

``bench/train_step.py --device cuda ...`` runs this script with the same arguments.

Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer
from offloadd.demo_train import TinyGPT


def _config(swap_dir: str, device: str, micro_batch: int, device_copies: str) -> dict:
    return {
        "offloadd": {"device_copies": device_copies},
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "device": device,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir},
            "offload_param": {"device": "nvme", "nvme_path": swap_dir},
        },
        "units": {"module_classes": ["GPTBlock"]},
    }


def _batch(step: int, vocab: int, micro_batch: int, seq_len: int,
           device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=generator).to(device)


def _busy_fraction(step_fn) -> float | None:
    """CUDA kernel time / wall time of one step (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - started
    kernel_us = sum(event.self_device_time_total for event in prof.key_averages()
                    if event.device_type is not None and "cuda" in str(event.device_type).lower())
    return min(1.0, kernel_us * 1e-6 / wall_s) if wall_s > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpt", default="2048,20,16", help="WIDTH,DEPTH,HEADS")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--swap-dir", default=None)
    parser.add_argument("--device-copies", choices=["rank", "daemon"], default="rank",
                        help="who copies arena <-> GPU: the rank's streams or the daemon's")
    args = parser.parse_args()
    width, depth, heads = (int(part) for part in args.gpt.split(","))
    model = TinyGPT(vocab=args.vocab, width=width, depth=depth, heads=heads,
                    max_len=args.seq_len)
    num_params = sum(param.numel() for param in model.parameters())
    swap_dir = args.swap_dir or tempfile.mkdtemp(prefix="offloadd-gpu-swap-")
    engine, _, _, _ = trainer.initialize(
        model=model, config=_config(swap_dir, args.device, args.micro_batch,
                                    args.device_copies))
    device = engine.collectives.device
    step_s: list[float] = []

    def one_step(step: int) -> None:
        loss = engine(_batch(step, args.vocab, args.micro_batch, args.seq_len, device))
        engine.backward(loss)
        engine.step()

    try:
        for step in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            one_step(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                step_s.append(time.perf_counter() - started)
        busy = _busy_fraction(lambda: one_step(args.warmup + args.steps))
        stats = engine.offload_stats()
    finally:
        engine.close()
    tokens = args.micro_batch * args.seq_len * engine.collectives.world_size
    median_s = statistics.median(step_s)
    print(json.dumps({
        "bench": "gpu_train_step", "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "num_params": num_params, "gpt": args.gpt, "world_size": engine.collectives.world_size,
        "step_s_median": median_s, "tokens_per_s": tokens / median_s,
        "gpu_busy_fraction": busy, "copy_engine": stats.get("rank_copy_engine"),
        "arena_pinned": stats.get("rank_arena_pinned"),
        "device_copies": stats.get("rank_device_copies"),
        "device_copies_fallback": stats.get("rank_device_copies_reason") or None,
        "ratio_vs_deepspeed": None,
        "note": "DeepSpeed ZeRO-3 GPU comparison not wired into this script yet",
    }))


if __name__ == "__main__":
    main()
