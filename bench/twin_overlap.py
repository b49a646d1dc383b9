"""Overlap of copies with compute on the timed twin: a stage-3 step of TinyGPT on CPU.

The twin copy engine (trainer.device.copy_engine.TwinCopyEngine) runs every H2D/D2H on its
worker (the copy stream) for nbytes / ``--gbps`` (``OFFLOADD_TWIN_GBPS``), while the
host plays the GPU's compute stream. ``overlap_fraction`` = hidden copy time / total
copy time, where the exposed part is the time the host blocked waiting on a copy event.

The peer, measured in the same run: the same training with every copy waited for at
issue (``serial_copies``: the host blocks on each H2D/D2H right after issuing it, as
the twin did before it modelled streams). ``ratio_vs_serial_copies`` = the peer's
median step time / ours (> 1: ours is faster).

The default bandwidth (0.5 GB/s) puts this CPU's compute and the copies of TinyGPT's
stage-3 step in the same range (``overlap_bound`` = min(1, compute s / copy s) is the
most any copy order could hide). PCIe's ~25 GB/s scaled by this CPU's fp32 matmul
FLOP/s over an H100's ~989 TFLOP/s bf16 dense (``pcie_scaled_gbps``) is about 0.0003
GB/s here: at the same tokens per step, an H100 would be copy-bound on this model.

    PYTHONPATH=. python bench/twin_overlap.py [--gbps 0.5] [--steps 3] [--repeats 3]
                                              [--micro-batch 4] [--strict]

Last line: JSON with overlap_fraction, ratio_vs_serial_copies, step and copy seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H100_BF16_FLOPS = 989e12
PCIE_GBPS = 25.0
DEFAULT_GBPS = 0.5


def cpu_matmul_flops(size: int = 512, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def serial_copy_engine(device: Any, kind: str | None = None) -> Any:
    """The peer: a twin whose every copy is waited for by the host right after issue."""
    from trainer.device.copy_engine import TwinCopyEngine

    class SerialTwin(TwinCopyEngine):
        def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Any = None) -> Any:
            event = super().h2d(dst, src, guard=guard)
            event.synchronize()
            return event

        def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Any = None) -> Any:
            event = super().d2h(dst, src, guard=guard)
            event.synchronize()
            return event

    return SerialTwin(device=torch.device(device))


def run(steps: int, micro_batch: int, *, serial: bool) -> dict[str, float]:
    import trainer
    import trainer.device.copy_engine
    from trainer.demo import train as demo_train

    select = trainer.device.copy_engine.select_copy_engine
    if serial:
        trainer.device.copy_engine.select_copy_engine = serial_copy_engine  # type: ignore[assignment]
    torch.manual_seed(0)
    model = demo_train.TinyGPT()
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}},
              "units": {"module_classes": ["GPTBlock"]}}
    try:
        engine, _, _, _ = trainer.initialize(model=model, config=config)
    finally:
        trainer.device.copy_engine.select_copy_engine = select
    copies = engine.backend.copies
    device = engine.collectives.device
    try:
        for step in range(steps + 1):  # step 0 records the gather order (no prefetch yet)
            if step == 1:
                engine.backend.wait_steps()
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
    return {"overlap_fraction": timing.overlap_fraction, "copy_s": copy_s,
            "exposed_s": exposed_s, "step_s": step_s,
            "overlap_bound": min(1.0, max(step_s - exposed_s, 0.0) / copy_s) if copy_s else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbps", type=float, default=DEFAULT_GBPS,
                        help="twin copy bandwidth in GB/s")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each side, alternating (medians are reported)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--strict", action="store_true",
                        help="device tensors of the strict twin (trainer.device.twin)")
    args = parser.parse_args()
    os.environ["OFFLOADD_COPY_ENGINE"] = "twin"
    os.environ["OFFLOADD_TWIN_MAX_DELAY_US"] = "0"
    os.environ["OFFLOADD_TWIN_GBPS"] = str(args.gbps)
    os.environ["OFFLOADD_TWIN_DEVICE"] = "strict" if args.strict else "host"
    flops = cpu_matmul_flops()
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "serial": []}
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(run(args.steps, args.micro_batch, serial=side == "serial"))

    def median(side: str, key: str) -> float:
        return round(statistics.median(result[key] for result in runs[side]), 4)

    ours_step, serial_step = median("ours", "step_s"), median("serial", "step_s")
    print(json.dumps({
        "bench": "twin_overlap", "device": "cpu twin", "gbps": args.gbps,
        "pcie_scaled_gbps": round(PCIE_GBPS * flops / H100_BF16_FLOPS, 6),
        "cpu_matmul_gflops": round(flops / 1e9, 1), "strict": args.strict,
        "micro_batch": args.micro_batch, "steps": args.steps, "repeats": args.repeats,
        "overlap_fraction": median("ours", "overlap_fraction"),
        "overlap_fraction_runs": [round(r["overlap_fraction"], 3) for r in runs["ours"]],
        "overlap_fraction_serial_copies": median("serial", "overlap_fraction"),
        "overlap_bound": median("ours", "overlap_bound"),
        "copy_s_per_step": median("ours", "copy_s"),
        "exposed_s_per_step": median("ours", "exposed_s"),
        "step_s": ours_step, "step_s_runs": [round(r["step_s"], 3) for r in runs["ours"]],
        "step_s_serial_copies": serial_step,
        "step_s_serial_copies_runs": [round(r["step_s"], 3) for r in runs["serial"]],
        "ratio_vs_serial_copies": round(serial_step / ours_step, 3)}))


if __name__ == "__main__":
    main()
