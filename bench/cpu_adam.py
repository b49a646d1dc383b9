"""CPU Adam throughput: offloadd's fused kernel vs torch (fused, foreach) and DeepSpeedCPUAdam.

    python bench/cpu_adam.py [--numel 100000000] [--rounds 3] [--repeats 5] [--threads N]

Two paths, each with AdamW (weight decay 0.01):

- fp32: fp32 master/exp_avg/exp_avg_sq and fp32 grad, updated in place.
- mixed: bf16 grad in, bf16 param out.  torch needs casts around its fp32
  optimizer: grad32.copy_(grad_bf16), step, param_bf16.copy_(master) (into
  preallocated buffers, the cheapest way to do it with torch).

Effective GB/s counts the bytes the update must touch, the same for every
contender: master, exp_avg, exp_avg_sq read + written, grad read, param_out
written (28 B/param on both paths).

The memory's own speed is measured in the same run: a STREAM triad
(``a = b + s * c`` over three fp32 arrays of ``numel`` elements, 12 B/element
counted as STREAM counts it) on the same number of threads, and
``ratio_vs_stream_triad_<path>`` is our Adam's GB/s over the triad's (1.0: Adam
at the memory's speed; issue 31's goal is >= 0.8).

Each contender runs in blocks of `repeats` timed steps after a warm-up step;
the block order rotates every round and the figure is the median of all
timed steps.  A short sleep separates blocks: torch's OpenMP workers
busy-wait for a while after each parallel region and would otherwise steal
cores from whichever contender runs next.

``speculative_step_time_factor`` is the mixed step run out of place (a speculative
optimizer step's: it reads the state from one copy and writes the next into another,
which its commit adopts) over the plain in-place mixed step;
``speculative_step_time_factor_bf16_moments`` the same with bf16 moments (the
``mixed_bf16`` path: 24 B/param touched), ``_8bit_moments`` with blockwise8 moments.

The last line printed is one JSON object; ratios are peer time / our time
(>1 means offloadd is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from offloadd import moment_codec
from offloadd.compute import adam

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = {"fp32": 4 * 6 + 4, "mixed": 4 * 6 + 2 + 2, "mixed_bf16": 4 * 2 + 2 * 4 + 2 + 2,
                   "mixed_8bit": 4 * 2 + 2 * 2 * (1 + 4 / 256) + 2 + 2, "triad": 3 * 4}
BLOCK_PAUSE_S = 0.2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000, help="parameters (elements)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all contenders")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per block")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: all CPUs)")
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="leave DeepSpeedCPUAdam out (its JIT op build takes ~80 s on a "
                             "fresh machine: bench/gpu_check.sh's short window)")
    return parser.parse_args()


class Problem:
    """Shared inputs; each contender owns its optimizer state."""

    def __init__(self, numel: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.grad32 = torch.randn(numel, generator=gen) * 1e-2
        self.grad_bf16 = self.grad32.to(torch.bfloat16)
        self.param_bf16 = torch.empty(numel, dtype=torch.bfloat16)
        self.master = torch.randn(numel, generator=gen)
        self.torch_param = torch.nn.Parameter(self.master.clone())
        self.torch_param.grad = torch.empty_like(self.grad32)


def ours(problem: Problem, mixed: bool, threads: int | None,
         speculative: bool = False, moments: torch.dtype = torch.float32
         ) -> Callable[[], None]:
    """``speculative``: each step reads the state from one copy and writes it into the
    other, as the daemon's speculative steps do (a commit adopts the written copy).
    ``moments``: fp32, bf16 (stochastically rounded) or uint8 (blockwise8) moments."""
    master = problem.master.clone()
    fmt = moment_codec.format_of(moments)
    exp_avg = moment_codec.encode(torch.zeros(master.numel()), fmt, signed=True)
    exp_avg_sq = moment_codec.encode(torch.zeros(master.numel()), fmt, signed=False)
    grad = problem.grad_bf16 if mixed else problem.grad32
    param_out = problem.param_bf16 if mixed else None
    copies = [(master, exp_avg, exp_avg_sq)]
    if speculative:
        copies.append((torch.empty_like(master), torch.empty_like(exp_avg),
                       torch.empty_like(exp_avg_sq)))
    step = 0

    def run() -> None:
        nonlocal step
        step += 1
        written, source = copies[step % len(copies)], copies[(step - 1) % len(copies)]
        adam.adam_step(
            *written,
            grad,
            step=step,
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            param_out=param_out,
            num_threads=threads,
            source=source if speculative else None,
        )

    return run


def torch_optimizer(problem: Problem, mixed: bool, **flavour: bool) -> Callable[[], None]:
    param = problem.torch_param
    assert param.grad is not None
    grad = param.grad
    grad.copy_(problem.grad32)  # the fp32 path reuses this grad every step
    optimizer = torch.optim.AdamW(
        [param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **flavour
    )

    def run() -> None:
        if mixed:
            grad.copy_(problem.grad_bf16)
        optimizer.step()
        if mixed:
            problem.param_bf16.copy_(param.detach())

    return run


def stream_triad(numel: int, threads: int | None) -> Callable[[], None]:
    """STREAM's triad on torch's intra-op pool sized like ours: the DRAM ceiling."""
    if threads is not None:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    b, c = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    a = torch.empty_like(b)

    def run() -> None:
        torch.add(b, c, alpha=3.0, out=a)

    return run


def deepspeed_cpuadam(problem: Problem) -> Callable[[], None]:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU probing; its op JIT-builds here
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = problem.torch_param
    assert param.grad is not None
    param.grad.copy_(problem.grad32)
    optimizer = DeepSpeedCPUAdam(
        [param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True
    )
    return optimizer.step


def build_contenders(
    problem: Problem, threads: int | None, notes: list[str], *, deepspeed: bool = True
) -> dict[str, tuple[str, Callable[[], None]]]:
    """name -> (path, one-step callable); peers that cannot run here get a note."""
    contenders: dict[str, tuple[str, Callable[[], None]]] = {
        "ours_fp32": ("fp32", ours(problem, False, threads)),
        "ours_mixed": ("mixed", ours(problem, True, threads)),
        "ours_mixed_speculative": ("mixed", ours(problem, True, threads, speculative=True)),
        "ours_mixed_bf16": ("mixed_bf16", ours(problem, True, threads, moments=torch.bfloat16)),
        "ours_mixed_bf16_speculative": ("mixed_bf16", ours(
            problem, True, threads, speculative=True, moments=torch.bfloat16)),
        "ours_mixed_8bit": ("mixed_8bit", ours(problem, True, threads, moments=torch.uint8)),
        "ours_mixed_8bit_speculative": ("mixed_8bit", ours(
            problem, True, threads, speculative=True, moments=torch.uint8)),
        "torch_foreach_fp32": ("fp32", torch_optimizer(problem, False, foreach=True)),
        "stream_triad": ("triad", stream_triad(problem.master.numel(), threads)),
    }
    try:
        fused = torch_optimizer(problem, False, fused=True)
        fused()  # CPU fused AdamW exists since torch 2.4; older builds raise here
        contenders["torch_fused_fp32"] = ("fp32", fused)
        contenders["torch_fused_mixed"] = ("mixed", torch_optimizer(problem, True, fused=True))
    except (RuntimeError, ValueError) as exc:
        notes.append(f"torch fused AdamW unavailable on CPU: {exc}")
    if not deepspeed:
        notes.append("DeepSpeedCPUAdam skipped (--no-deepspeed)")
        return contenders
    try:
        contenders["deepspeed_cpuadam_fp32"] = ("fp32", deepspeed_cpuadam(problem))
    except Exception as exc:  # ImportError, or its JIT op build failing
        notes.append(f"DeepSpeedCPUAdam skipped: {type(exc).__name__}: {exc}".splitlines()[0])
    return contenders


def time_block(step: Callable[[], None], repeats: int) -> list[float]:
    step()  # warm-up: page faults, lazy state, thread start-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    time.sleep(BLOCK_PAUSE_S)
    return times


def measure(
    contenders: dict[str, tuple[str, Callable[[], None]]], rounds: int, repeats: int
) -> dict[str, float]:
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name] += time_block(contenders[name][1], repeats)
    return {name: statistics.median(times) for name, times in samples.items()}


def report(
    args: argparse.Namespace,
    contenders: dict[str, tuple[str, Callable[[], None]]],
    seconds: dict[str, float],
    notes: list[str],
) -> dict[str, Any]:
    gbps = {
        name: BYTES_PER_PARAM[path] * args.numel / seconds[name] / 1e9
        for name, (path, _) in contenders.items()
    }
    print(f"{'contender':<26}{'path':<8}{'s/step':>10}{'GB/s':>9}")
    for name, (path, _) in contenders.items():
        print(f"{name:<26}{path:<8}{seconds[name]:>10.4f}{gbps[name]:>9.1f}")
    for note in notes:
        print(f"note: {note}")
    result: dict[str, Any] = {
        "bench": "cpu_adam",
        "numel": args.numel,
        "threads": args.threads or "all",
        "torch_threads": torch.get_num_threads(),
        "kernel": adam.active_kernel(),
        "seconds_per_step": {k: round(v, 5) for k, v in seconds.items()},
        "gb_per_s": {k: round(v, 2) for k, v in gbps.items()},
    }
    peers = [
        ("torch_fused_fp32", "ours_fp32"),
        ("torch_foreach_fp32", "ours_fp32"),
        ("torch_fused_mixed", "ours_mixed"),
        ("deepspeed_cpuadam_fp32", "ours_fp32"),
    ]
    for peer, mine in peers:
        if peer in seconds:
            result[f"ratio_vs_{peer}"] = round(seconds[peer] / seconds[mine], 3)
    result["speculative_step_time_factor"] = round(
        seconds["ours_mixed_speculative"] / seconds["ours_mixed"], 3)
    result["speculative_step_time_factor_bf16_moments"] = round(
        seconds["ours_mixed_bf16_speculative"] / seconds["ours_mixed_bf16"], 3)
    result["speculative_step_time_factor_8bit_moments"] = round(
        seconds["ours_mixed_8bit_speculative"] / seconds["ours_mixed_8bit"], 3)
    result["stream_triad_gb_per_s"] = round(gbps["stream_triad"], 2)
    for path in ("fp32", "mixed"):
        result[f"ratio_vs_stream_triad_{path}"] = round(
            gbps[f"ours_{path}"] / gbps["stream_triad"], 3)
    if notes:
        result["notes"] = notes
    return result


def main() -> None:
    args = parse_args()
    notes: list[str] = []
    problem = Problem(args.numel)
    contenders = build_contenders(problem, args.threads, notes,
                                  deepspeed=not args.no_deepspeed)
    seconds = measure(contenders, args.rounds, args.repeats)
    print(json.dumps(report(args, contenders, seconds, notes)))


if __name__ == "__main__":
    main()
