"""Overlap of copies with compute on the timed twin: a stage-3 step of TinyGPT on CPU.

The twin copy engine (trainer.copy_engine.TwinCopyEngine) runs every H2D/D2H on its
worker for nbytes / ``--gbps`` (``OFFLOADD_TWIN_GBPS``), while the host plays the
GPU's compute stream. ``overlap_fraction`` = hidden copy time / total copy time, where
the exposed part is the time the host blocked waiting on a copy event.

The default bandwidth is PCIe's ~25 GB/s scaled to this machine: 25 GB/s x (this CPU's
fp32 matmul FLOP/s / an H100's ~989 TFLOP/s bf16 dense), so copies stand to compute as
they would on an H100 at the same tokens per step. ``overlap_bound`` = min(1, compute
seconds / copy seconds) is the most any copy order could hide at that ratio.

    PYTHONPATH=. python bench/twin_overlap.py [--gbps 0.05] [--steps 3] [--micro-batch 4]
                                              [--strict]

Last line: JSON with overlap_fraction, copy_s, exposed_s, step_s, gbps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H100_BF16_FLOPS = 989e12
PCIE_GBPS = 25.0


def cpu_matmul_flops(size: int = 512, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def run(gbps: float, steps: int, micro_batch: int, strict: bool) -> dict[str, float]:
    os.environ["OFFLOADD_COPY_ENGINE"] = "twin"
    os.environ["OFFLOADD_TWIN_MAX_DELAY_US"] = "0"
    os.environ["OFFLOADD_TWIN_GBPS"] = str(gbps)
    os.environ["OFFLOADD_TWIN_DEVICE"] = "strict" if strict else "host"
    import trainer
    from offloadd import demo_train

    torch.manual_seed(0)
    model = demo_train.TinyGPT()
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}},
              "units": {"module_classes": ["GPTBlock"]}}
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    copies = engine.backend.copies
    device = engine.collectives.device
    try:
        for step in range(steps + 1):  # step 0 records the gather order (no prefetch yet)
            if step == 1:
                copies.synchronize()
                copies.timing.reset()
                started = time.perf_counter()
            ids = demo_train.synthetic_batch(step, 0)[:micro_batch].to(device)
            engine.backward(engine(ids))
            engine.step()
        engine.backend.wait_steps()
        copies.synchronize()
        step_s = (time.perf_counter() - started) / steps
        timing = copies.timing
        copy_s, exposed_s = timing.copy_s / steps, timing.exposed_s / steps
    finally:
        engine.close()
    compute_s = max(step_s - exposed_s, 0.0)
    return {"overlap_fraction": round(timing.overlap_fraction, 4),
            "overlap_bound": round(min(1.0, compute_s / copy_s) if copy_s else 1.0, 4),
            "copy_s_per_step": round(copy_s, 4), "exposed_s_per_step": round(exposed_s, 4),
            "step_s": round(step_s, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbps", type=float, default=None,
                        help="twin copy bandwidth in GB/s (default: PCIe scaled to this CPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--strict", action="store_true",
                        help="device tensors of the strict twin (trainer.device_twin)")
    args = parser.parse_args()
    flops = cpu_matmul_flops()
    gbps = args.gbps if args.gbps is not None else PCIE_GBPS * flops / H100_BF16_FLOPS
    result = run(gbps, args.steps, args.micro_batch, args.strict)
    print(json.dumps({"bench": "twin_overlap", "device": "cpu twin", "gbps": round(gbps, 5),
                      "cpu_matmul_gflops": round(flops / 1e9, 1), "strict": args.strict,
                      "micro_batch": args.micro_batch, "steps": args.steps, **result}))


if __name__ == "__main__":
    main()
