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
and D2H copy engines were busy, and the daemon's Adam seconds per step, each separately;
the bytes the rank's copy engine moved each way in that step (``h2d_bytes_per_step``,
``d2h_bytes_per_step``: over PCIe on a GPU with rank copies); peak device and host memory.
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
import contextlib
import importlib.util
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer
from trainer.config import STATE_DTYPE_FORMATS, ZeroConfig
from trainer.demo.train import TinyGPT
from trainer.device import twin, twin_memory
from trainer.device.compute import resolve_device
from trainer.offload.daemon_connect import trainable_nbytes
from trainer.zero.estimate import ModelCounts, estimate


def _offload(device: str, swap_dir: str) -> dict:
    return {"device": device, "nvme_path": swap_dir} if device == "nvme" else {"device": device}


GRAD_ITEMSIZES = {"fp32": 4, "bf16": 2}
"""Bytes of one gradient element by ``data_types.grad_accum_dtype``."""


def host_bytes_per_param(state_dtype: str, grad_accum_dtype: str) -> float:
    """Daemon bytes a parameter needs with params and optimizer offloaded in bf16 training
    and gradient accumulation, as the engine sizes the arena (``trainable_nbytes``): the
    fp32 master (4), the gradient (4, or 2 accumulated in bf16), the bf16 param (2) and
    both moments (8 / 4 / 2.03): 18, 14, 12.03, or with bf16 sums 16, 12, 10.03."""
    return trainable_nbytes(10**9, STATE_DTYPE_FORMATS[state_dtype], 2,
                            grad_itemsize=GRAD_ITEMSIZES[grad_accum_dtype]) / 10**9


STATE_DTYPES = ("fp32", "bf16", "8bit")
"""``offload_optimizer.state_dtype`` choices, largest moments first."""
DEVICE_BYTES_PER_PARAM = 16
"""What no-offload mixed-precision training keeps on the GPU per parameter: fp32 param,
fp32 grad and two fp32 moments (activations and the bf16 copies come on top)."""


def size_big(device_bytes: int, host_bytes: int, target_params: float, vocab: int,
             width: int, *, grad_accum_dtype: str) -> tuple[str, str, int]:
    """The big case's ``--gpt`` and ``state_dtype``: at least ``target_params`` and twice
    what fits the device without offload, in the smallest moment format the host holds
    (3/4 of its memory: the arena's slack, the ranks and the page cache take the rest) with
    gradients accumulated in ``grad_accum_dtype``; if none holds the target, the largest
    model the host holds in 8-bit moments. The depth is the least that reaches the target,
    or the most the host holds where that is less. Returns ``(gpt, state_dtype,
    num_params_estimate)``."""
    wanted = max(target_params, 2 * device_bytes / DEVICE_BYTES_PER_PARAM)
    budget = 0.75 * host_bytes
    per_param = {name: host_bytes_per_param(name, grad_accum_dtype) for name in STATE_DTYPES}
    fitting = [name for name in STATE_DTYPES if wanted * per_param[name] <= budget]
    state_dtype = fitting[0] if fitting else "8bit"
    layer_numel, embedding_numel = 12 * width * width, vocab * width
    reaching = math.ceil((wanted - embedding_numel) / layer_numel)
    held = math.floor((budget / per_param[state_dtype] - embedding_numel) / layer_numel)
    depth = max(1, min(reaching, held))
    heads = max(1, width // 128)
    return f"{width},{depth},{heads}", state_dtype, embedding_numel + layer_numel * depth


def max_live_params(device_bytes: int) -> int:
    """``--max-live-params auto``: the parameters whose bf16 copies fill 3/10 of the
    device (the running gradient sums may take half of what is free, activations the
    rest); the engine's default (DeepSpeed's, 1e9) where the device's size is not known.
    Units gathered within it stay on the device from one micro-batch to the next
    (``FullParams.hold``): on the 8.35B case an H100 holds all 16.7 GB of them and gathers
    each unit once per step instead of ~1.85 times per micro-batch."""
    return device_bytes * 3 // 20 if device_bytes else ZeroConfig().stage3_max_live_parameters


def model_flops_per_token(num_params: int, depth: int, width: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 x params (forward 2, backward 4) plus attention's scores
    and values (2 x 2 x seq x width per layer forward, x3 with backward), causal masking
    not discounted, activation recomputation not counted (model FLOPs, as MFU counts)."""
    return 6 * num_params + 12 * depth * width * seq_len


def _config(swap_dir: str, args: argparse.Namespace) -> dict:
    return {
        "offloadd": {"device_copies": args.device_copies},
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        **({"data_types": {"grad_accum_dtype": args.grad_accum_dtype}}
           if args.grad_accum_dtype else {}),
        "device": args.device,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {**_offload(args.offload_optimizer, swap_dir),
                                  "state_dtype": args.state_dtype},
            "offload_param": _offload(args.offload_param, swap_dir),
            "stage3_max_live_parameters": args.max_live_params,
            "stage3_max_reuse_distance": args.max_reuse_distance,
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


_STARTED = time.perf_counter()
_WHO: list[str] = []
"""The contender this process runs (set in a child), named on its progress lines."""


def _progress(what: str) -> None:
    """One line on stderr, seconds since the process started: a contender killed at a
    limit still shows in the log how far it got (``_child`` passes its stderr through)."""
    who = f"{_WHO[0]}: " if _WHO else ""
    print(f"[{time.perf_counter() - _STARTED:8.1f} s] {who}{what}", file=sys.stderr, flush=True)


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
        took = time.perf_counter() - started
        _progress(f"step {step} ({'warm-up' if step < warmup else 'timed'}): {took:.3f} s")
        if step >= warmup:
            step_s.append(took)
    return step_s


class Recomputed(nn.Module):
    """A block whose activations are recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, hidden, use_reentrant=False)


def _model(args: argparse.Namespace,
           partitioned: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
           ) -> TinyGPT:
    """The GPT; ``partitioned``: the engine's ``zero.Init`` context to build it in, under
    ``--zero-init`` (no whole copy of the model ever exists: the big case's way)."""
    width, depth, heads = (int(part) for part in args.gpt.split(","))
    torch.manual_seed(0)
    building = partitioned() if args.zero_init and partitioned else contextlib.nullcontext()
    with building:
        model = TinyGPT(vocab=args.vocab, width=width, depth=depth, heads=heads,
                        max_len=args.seq_len)
    if args.activation_checkpointing:
        model.blocks = nn.ModuleList(Recomputed(block) for block in model.blocks)
    return model


def _plain_device(args: argparse.Namespace) -> torch.device:
    """Where the no-offload ceiling computes: the GPU, or on ``--device cpu`` what the
    engine would pick (the strict twin's ``twin:0`` when ``OFFLOADD_COPY_ENGINE=twin`` and
    ``OFFLOADD_TWIN_DEVICE=strict``, so its device memory is counted and capped alike)."""
    return torch.device("cuda") if args.device == "cuda" else resolve_device("cpu").device


def _peaks(device: torch.device) -> dict[str, int | None]:
    """Peak device memory allocated (the strict twin counts its own) and this process's
    plus its children's (the private daemon, once it has exited) peak resident bytes."""
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
           + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else twin_memory.max_memory_allocated() if device.type == "twin" else None)
    return {"peak_device_bytes": peak, "peak_host_rss_bytes": rss}


def _ratio(text: str) -> float | str:
    return text if text == "auto" else float(text)


def _device_bytes(args: argparse.Namespace) -> int:
    """The device memory the big case is sized against (0: none known)."""
    if args.device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() \
            else 0
    if _plain_device(args).type == "twin":
        return twin_memory.capacity_from_env() or 0
    return 0


def run_ours(args: argparse.Namespace, swap_dir: str, *,
             speculative: bool = True) -> dict[str, Any]:
    """Ours; ``speculative`` False: every optimizer step waits for the global norm."""
    config = _config(swap_dir, args)
    model = _model(args, lambda: trainer.zero.Init(config=config))
    num_params = sum(param.numel() for param in model.parameters())
    _progress(f"model built ({num_params / 1e9:.2f}B params)")
    # Ours only: DeepSpeed refuses a ratio below 1 with NVMe and keeps the full offload.
    config["zero_optimization"]["offload_optimizer"]["ratio"] = args.offload_ratio
    config["zero_optimization"]["offload_optimizer"]["speculative_step"] = speculative
    # What the engine's estimate says the device needs for the model states (before
    # initialize: stage 3 empties the parameters), beside the peak measured below; Twin-
    # Flow's device units are not in it.
    counts = ModelCounts.of(model)
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    _progress("initialized")
    device = engine.collectives.device
    one_step = _stepper(engine, args, device)
    estimated = estimate(counts, engine.config, gpus_per_node=engine.collectives.world_size)

    try:
        step_s = _timed(one_step, device, args.warmup, args.steps)
        # Optimizer steps still in flight (deferred or speculative) are waited for on both
        # sides of the profiled step, so its counters hold its own Adam, all of it.
        engine.backend.wait_steps()
        before = engine.offload_stats()
        full = getattr(engine.placement, "full", None)
        gathers = full.num_gathers if full is not None else 0
        profiled = _profile(lambda: one_step(args.warmup + args.steps))
        engine.backend.wait_steps()
        stats = engine.offload_stats()
        # Stage 3: how many times the profiled step gathered each unit on average (1 when
        # every unit is held from one micro-batch to the next: see FullParams.hold).
        gathers_per_unit = ((full.num_gathers - gathers) / len(engine.units)
                            if full is not None else None)
        adam = {key: stats.get("optimizer", {}).get(key, 0)
                - before.get("optimizer", {}).get(key, 0) for key in ("steps", "step_s")}
        # the rank's copy engine, one step (the daemon's own copies are not in it)
        pcie = {f"{way}_bytes_per_step": stats.get(f"rank_{way}_nbytes", 0)
                - before.get(f"rank_{way}_nbytes", 0) for way in ("h2d", "d2h")}
    finally:
        engine.close()
    return {"device": str(device), "num_params": num_params, "step_s": step_s, **_peaks(device),
            "world_size": engine.collectives.world_size, **profiled,
            "estimated_device_bytes": estimated.device_nbytes if args.offload_ratio == 1.0
            else None,
            "adam_s": adam["step_s"], "adam_unit_steps": adam["steps"], **pcie,
            "gathers_per_unit_per_step": gathers_per_unit,
            "speculated_units": stats.get("speculated_units"),
            "reverted_units": stats.get("reverted_units"),
            "copy_engine": stats.get("rank_copy_engine"),
            "grad_dtype": str(engine.grad_dtype).removeprefix("torch."),
            "arena_pinned": stats.get("rank_arena_pinned"),
            "device_copies": stats.get("rank_device_copies"),
            "device_copies_fallback": stats.get("rank_device_copies_reason") or None,
            # Twin-Flow: units whose optimizer state stays on the device (ratio < 1, auto)
            "device_units": stats.get("device_units", 0),
            "device_state_bytes": stats.get("device_state_nbytes", 0)}


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
    # DeepSpeed has no compact moments: its optimizer state stays fp32
    config["zero_optimization"]["offload_optimizer"].pop("state_dtype")
    config["steps_per_print"] = 10**9
    model = _model(args, lambda: deepspeed.zero.Init(config_dict_or_path=config))
    num_params = sum(param.numel() for param in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=None)
    device = engine.device if isinstance(engine.device, torch.device) \
        else torch.device(engine.device)
    one_step = _stepper(engine, args, device)
    step_s = _timed(one_step, device, args.warmup, args.steps)
    profiled = _profile(lambda: one_step(args.warmup + args.steps))
    return {"device": str(device), "num_params": num_params, "step_s": step_s,
            "world_size": engine.world_size, **profiled}


def run_plain(args: argparse.Namespace, _swap_dir: str) -> dict[str, Any]:
    """The ceiling: the same model, batches and loop in plain torch with everything on the
    device (fp32 params, bf16 autocast, fused AdamW where the device has it, the same
    clipping). An out-of-memory is a result: ``{"oom": ...}``."""
    device = _plain_device(args)
    # CPU autocast casts the twin's ops too: its device tensors are host tensors underneath
    autocast_type = "cpu" if device.type == "twin" else device.type
    num_params = None  # unknown when the build itself runs out of memory
    try:
        # Built on the device, as a user checking whether it fits would: no host copy of
        # a model that may be larger than the host's memory, and an early OOM if it is.
        with torch.device(device):
            model = _model(args)
        num_params = sum(param.numel() for param in model.parameters())
        if device.type == "twin":
            twin.adopt_module(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                      fused=device.type == "cuda")

        def one_step(step: int) -> None:
            for micro in range(args.grad_accum):
                batch = _batch(step * args.grad_accum + micro, args.vocab, args.micro_batch,
                               args.seq_len, device)
                with torch.autocast(autocast_type, dtype=torch.bfloat16):
                    loss = model(batch)
                (loss / args.grad_accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step_s = _timed(one_step, device, args.warmup, args.steps)
        profiled = _profile(lambda: one_step(args.warmup + args.steps))
    except torch.OutOfMemoryError as error:
        return {"device": str(device), "num_params": num_params,
                "oom": str(error).splitlines()[0][:300]}
    return {"device": str(device), "num_params": num_params, "step_s": step_s,
            "world_size": 1, **profiled, **_peaks(device)}


def _relay(source: Any, copy: Any) -> None:
    for line in source:
        sys.stderr.write(line)
        sys.stderr.flush()
        copy.write(line)


def _child(contender: str, overrides: list[str] | None = None, timeout_s: float | None = None
           ) -> tuple[dict[str, Any] | None, str]:
    """Run one contender in a child process (``overrides``: arguments that replace the
    command line's); its last stdout line is its JSON. Past ``timeout_s`` the child and
    everything it started (a JIT build, a private daemon) are killed: a time-out is a
    result, said as one."""
    argv = [sys.executable, __file__, *sys.argv[1:], *(overrides or []),
            "--contender", contender]
    with tempfile.TemporaryFile("w+") as stdout_file, \
            tempfile.TemporaryFile("w+") as stderr_file:
        child = subprocess.Popen(argv, stdout=stdout_file, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
        # The child's stderr goes on to ours as it comes (progress lines), and to a file
        # whose tail a failure note quotes.
        relay = threading.Thread(target=_relay, args=(child.stderr, stderr_file), daemon=True)
        relay.start()
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return None, f"{contender} timed out after {timeout_s:g} s (--peer-timeout)"
        finally:
            relay.join(timeout=10)  # a daemon outside the group may hold the pipe
        stdout_file.seek(0)
        stderr_file.seek(0)
        stdout, stderr = stdout_file.read(), stderr_file.read()
    lines = stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        oom = " (out of memory)" if "out of memory" in stderr.lower() else ""
        return None, f"{contender} failed{oom} (rc {child.returncode}): {stderr[-600:]}"
    return json.loads(lines[-1]), ""


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpt", default="2048,20,16",
                        help="WIDTH,DEPTH,HEADS, or 'auto': the big case sized from the device "
                             "and host memory (size_big)")
    parser.add_argument("--target-params", type=float, default=10e9,
                        help="the big case's least parameter count (--gpt auto)")
    parser.add_argument("--big-width", type=int, default=5120, help="the big case's width")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step (gradient_accumulation_steps)")
    parser.add_argument("--offload-param", choices=["nvme", "cpu", "none"], default="nvme")
    parser.add_argument("--offload-optimizer", choices=["nvme", "cpu"], default="nvme",
                        help="the tier of both contenders (DeepSpeed runs the same config)")
    parser.add_argument("--offload-ratio", type=_ratio, default=1.0,
                        help="offload_optimizer.ratio (ours): the fraction of the optimizer "
                             "state offloaded, the rest stepped on the device (Twin-Flow); "
                             "auto: what the device memory left after the first step holds")
    parser.add_argument("--state-dtype", choices=["fp32", "bf16", "8bit"], default=None,
                        help="offload_optimizer.state_dtype (ours; default fp32, or what "
                             "--gpt auto picks)")
    parser.add_argument("--grad-accum-dtype", choices=["fp32", "bf16"], default=None,
                        help="data_types.grad_accum_dtype of both contenders (DeepSpeed's key); "
                             "unset: each engine's default (ours fp32, DeepSpeed the model's "
                             "bf16), --gpt auto: bf16")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward")
    parser.add_argument("--zero-init", action="store_true",
                        help="build the model under zero.Init (ours: trainer.zero.Init, "
                             "DeepSpeed: deepspeed.zero.Init); --gpt auto implies it")
    parser.add_argument("--max-live-params", default="auto",
                        help="stage3_max_live_parameters of both contenders: a number, or "
                             "'auto': 3/10 of the device's memory in bf16 parameters "
                             "(max_live_params)")
    parser.add_argument("--max-reuse-distance", type=lambda text: int(float(text)),
                        default=1_000_000_000,
                        help="stage3_max_reuse_distance of both contenders (DeepSpeed's "
                             "default 1e9 elements: a model of billions of parameters "
                             "outruns it in all but its last units; 0 shows that on a "
                             "small model)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--swap-dir", default=None)
    parser.add_argument("--device-copies", choices=["rank", "daemon"], default="rank",
                        help="who copies arena <-> GPU: the rank's streams or the daemon's")
    parser.add_argument("--contenders", default="ours,deepspeed,none",
                        help="which of ours, ours-wait (ours with every optimizer step "
                             "waiting for the global norm: speculative_step off), deepspeed, "
                             "none (plain torch on the device, no offload: the ceiling) run "
                             "beside each other")
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="drop deepspeed from --contenders")
    parser.add_argument("--sweep", default=None,
                        help="TOKENS,TOKENS,...: tokens per step to sweep (grad-accum scales); "
                             "ours and none at each, the crossover reported")
    parser.add_argument("--peer-timeout", type=float, default=None,
                        help="seconds a peer (deepspeed, none) may take before it is killed; "
                             "the time-out is reported as its result (deepspeed_failure)")
    parser.add_argument("--port", type=int, default=29533, help="DeepSpeed's rendezvous port")
    parser.add_argument("--contender", choices=list(CONTENDERS), default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpt == "auto":
        args.zero_init = True
        device_bytes = _device_bytes(args)
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        args.grad_accum_dtype = args.grad_accum_dtype or "bf16"
        args.gpt, picked, _ = size_big(device_bytes, host_bytes, args.target_params,
                                       args.vocab, args.big_width,
                                       grad_accum_dtype=args.grad_accum_dtype)
        args.state_dtype = args.state_dtype or picked
    args.state_dtype = args.state_dtype or "fp32"
    args.max_live_params = (max_live_params(_device_bytes(args))
                            if args.max_live_params == "auto" else int(float(args.max_live_params)))
    return args


def _tokens(args: argparse.Namespace, world_size: int) -> int:
    return args.micro_batch * args.seq_len * args.grad_accum * world_size


def _tflops(args: argparse.Namespace, result: dict[str, Any], tokens: int) -> float | None:
    if "step_s" not in result:
        return None
    width, depth, _ = (int(part) for part in args.gpt.split(","))
    flops = model_flops_per_token(result["num_params"], depth, width, args.seq_len) * tokens
    return flops / statistics.median(result["step_s"]) / 1e12


def _run_contenders(args: argparse.Namespace, overrides: list[str], notes: list[str]
                    ) -> dict[str, dict[str, Any]]:
    """Each contender asked for, in a child process of its own; failures become notes
    (ours failing ends the run)."""
    wanted = [name.strip() for name in args.contenders.split(",") if name.strip()]
    results: dict[str, dict[str, Any]] = {}
    for name in wanted:
        if name == "deepspeed" and args.no_deepspeed:
            notes.append("DeepSpeed skipped (--no-deepspeed)")
            continue
        if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            notes.append("deepspeed not importable here (pip install deepspeed): no ratio")
            continue
        result, failure = _child(name, overrides,
                                 None if name.startswith("ours") else args.peer_timeout)
        if result is None and name == "ours":
            raise SystemExit(failure)
        if result is None:
            notes.append(f"{name}: {failure}")
            if name == "deepspeed":  # an OOM or a time-out is its result, as the ceiling's
                results[name] = {"failure": failure.splitlines()[0][:300]}
        else:
            results[name] = result
    return results


def _summary(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ours, peer, plain = results["ours"], results.get("deepspeed"), results.get("none")
    waiting = results.get("ours-wait")
    tokens = _tokens(args, ours["world_size"])
    median_s = statistics.median(ours["step_s"])
    waiting_s = statistics.median(waiting["step_s"]) if waiting else None
    peer_s = statistics.median(peer["step_s"]) if peer and "step_s" in peer else None
    plain_s = statistics.median(plain["step_s"]) if plain and "step_s" in plain else None
    kernel_s = (ours["sm_busy_fraction"] * ours["profiled_step_s"]
                if ours.get("sm_busy_fraction") and ours.get("profiled_step_s") else None)
    return {
        "tokens_per_step": tokens, "grad_accum": args.grad_accum,
        "step_s_median": median_s, "tokens_per_s": tokens / median_s,
        "model_tflops": _tflops(args, ours, tokens),
        "step_s": ours["step_s"], "adam_s_per_step": ours["adam_s"],
        "gpu_kernel_s": kernel_s,
        "step_over_max_gpu_adam": (median_s / max(kernel_s, ours["adam_s"])
                                   if kernel_s else None),
        "sm_busy_fraction": ours.get("sm_busy_fraction"),
        "h2d_busy_s": ours.get("h2d_busy_s"), "d2h_busy_s": ours.get("d2h_busy_s"),
        "h2d_bytes_per_step": ours.get("h2d_bytes_per_step"),
        "d2h_bytes_per_step": ours.get("d2h_bytes_per_step"),
        "gathers_per_unit_per_step": ours.get("gathers_per_unit_per_step"),
        "profiled_step_s": ours.get("profiled_step_s"),
        "peak_device_bytes": ours.get("peak_device_bytes"),
        "estimated_device_bytes": ours.get("estimated_device_bytes"),
        "peak_host_rss_bytes": ours.get("peak_host_rss_bytes"),
        "deepspeed_step_s": peer.get("step_s") if peer else None,
        "deepspeed_step_s_median": peer_s,
        "deepspeed_tokens_per_s": tokens / peer_s if peer_s else None,
        "deepspeed_sm_busy_fraction": peer.get("sm_busy_fraction") if peer else None,
        "ratio_vs_deepspeed": round(peer_s / median_s, 3) if peer_s else None,
        "deepspeed_failure": peer.get("failure") if peer else None,
        "no_offload_step_s_median": plain_s,
        "no_offload_oom": plain.get("oom") if plain else None,
        "no_offload_model_tflops": _tflops(args, plain, tokens) if plain else None,
        "no_offload_peak_device_bytes": plain.get("peak_device_bytes") if plain else None,
        "ratio_vs_no_offload": round(plain_s / median_s, 3) if plain_s else None,
        "speculated_units": ours.get("speculated_units"),
        "reverted_units": ours.get("reverted_units"),
        "waiting_for_norm_step_s_median": waiting_s,
        "ratio_vs_waiting_for_norm": round(waiting_s / median_s, 3) if waiting_s else None,
    }


def run_ours_waiting(args: argparse.Namespace, swap_dir: str) -> dict[str, Any]:
    return run_ours(args, swap_dir, speculative=False)


CONTENDERS: dict[str, Callable[[argparse.Namespace, str], dict[str, Any]]] = {
    "ours": run_ours, "ours-wait": run_ours_waiting, "deepspeed": run_deepspeed,
    "none": run_plain}


def main() -> None:
    args = _parse()
    if args.contender is not None:  # a child: one contender, its JSON on the last line
        _WHO.append(args.contender)
        with contextlib.ExitStack() as cleanup:  # a swap dir of its own is removed after
            root = args.swap_dir or cleanup.enter_context(
                tempfile.TemporaryDirectory(prefix="offloadd-gpu-swap-"))
            swap_dir = os.path.join(root, args.contender)
            os.makedirs(swap_dir, exist_ok=True)
            print(json.dumps(CONTENDERS[args.contender](args, swap_dir)))
        return
    notes: list[str] = []
    head = {"bench": "gpu_train_step", "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "gpt": args.gpt, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "tier": {"param": args.offload_param, "optimizer": args.offload_optimizer,
                     "state_dtype": args.state_dtype,
                     "grad_accum_dtype": args.grad_accum_dtype},
            "offload_ratio": args.offload_ratio,
            "activation_checkpointing": args.activation_checkpointing,
            "zero_init": args.zero_init, "max_live_params": args.max_live_params,
            "max_reuse_distance": args.max_reuse_distance,
            "device_capacity_bytes": _device_bytes(args) or None,
            "flops": "6 x params x tokens + 12 x depth x width x seq x tokens (model FLOPs)"}
    fixed = ["--gpt", args.gpt, "--state-dtype", args.state_dtype,
             *(["--zero-init"] if args.zero_init else []),
             *(["--grad-accum-dtype", args.grad_accum_dtype] if args.grad_accum_dtype else [])]
    if args.sweep is None:
        results = _run_contenders(args, fixed, notes)
        ours = results["ours"]
        print(json.dumps({**head, "num_params": ours["num_params"],
                          "world_size": ours["world_size"], **_summary(args, results),
                          "copy_engine": ours["copy_engine"],
                          "grad_dtype": ours["grad_dtype"],
                          "arena_pinned": ours["arena_pinned"],
                          "device_copies": ours["device_copies"],
                          "device_copies_fallback": ours["device_copies_fallback"],
                          "device_units": ours["device_units"],
                          "device_state_bytes": ours["device_state_bytes"],
                          "notes": notes}))
        return
    points = []
    for tokens in (int(value) for value in args.sweep.split(",")):
        args.grad_accum = max(1, tokens // (args.micro_batch * args.seq_len))
        results = _run_contenders(args, [*fixed, "--grad-accum", str(args.grad_accum)], notes)
        points.append(_summary(args, results))
    crossover = next((point["tokens_per_step"] for point in points
                      if point["gpu_kernel_s"] and point["gpu_kernel_s"]
                      >= point["adam_s_per_step"]), None)
    worst = [point["step_over_max_gpu_adam"] for point in points
             if point["step_over_max_gpu_adam"] is not None]
    ratios = [point["ratio_vs_no_offload"] for point in points
              if point["ratio_vs_no_offload"] is not None]
    print(json.dumps({**head, "sweep": points,
                      "crossover_tokens_per_step": crossover,
                      "worst_step_over_max_gpu_adam": max(worst) if worst else None,
                      "ratio_vs_no_offload_min": min(ratios) if ratios else None,
                      "notes": notes}))


if __name__ == "__main__":
    main()
