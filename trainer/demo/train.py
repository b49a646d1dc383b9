"""Training demo: a small GPT trained by 2 ranks with ZeRO-3, parameters and optimizer
state offloaded to NVMe through a private offloadd daemon.

    python -m trainer.demo.train            # or: run_training_demo(steps=20)

Rank 0 draws a progress bar (loss, step time, bytes moved) and prints a
summary table; the summary dict is also returned.
"""

from __future__ import annotations

import importlib.util
import math
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

VOCAB = 2048
SEQ_LEN = 64
WIDTH = 320
DEPTH = 6
HEADS = 5
MICRO_BATCH = 4


class GPTBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        qkv = self.qkv(self.norm1(hidden)).view(batch, length, 3, self.heads, -1)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        hidden = hidden + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return hidden + self.down(F.gelu(self.up(self.norm2(hidden))))


class TinyGPT(nn.Module):
    """Token + position embeddings, GPT blocks, tied LM head; forward returns the LM loss."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = DEPTH,
                 heads: int = HEADS, max_len: int = SEQ_LEN) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inputs, targets = ids[:, :-1], ids[:, 1:]
        hidden = self.tokens(inputs) + self.positions.weight[: inputs.shape[1]]
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(self.norm(hidden))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def synthetic_batch(step: int, rank: int) -> torch.Tensor:
    """Sequences following t[i+1] = (5 t[i] + 3) mod V from a random start: learnable fast."""
    generator = torch.Generator().manual_seed(step * 1009 + rank)
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=generator)
    ids = [start]
    for _ in range(SEQ_LEN):
        ids.append((ids[-1] * 5 + 3) % VOCAB)
    return torch.cat(ids, dim=1)


def half_working_set_nbytes(num_params: int) -> int:
    """Half of 20 bytes per parameter (fp32 param, grad, master and both moments)."""
    return max(64 << 20, (num_params * 10) // (2 << 20) * (2 << 20))


def demo_config(swap_dir: str, device: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3,
                                                     "warmup_num_steps": 5,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": device, "nvme_path": swap_dir},
            "offload_param": {"device": device, "nvme_path": swap_dir},
        },
        "units": {"module_classes": ["GPTBlock"]},
    }


def _moved_nbytes(stats: dict[str, Any]) -> int:
    """Rank<->arena bytes plus the NVMe tier's read and written bytes (node-wide)."""
    total = int(stats.get("rank_moved_nbytes", 0))
    swap = stats.get("swap") or {}
    for swap_dir in swap.get("dirs", []):
        total += int(swap_dir.get("read_nbytes", 0)) + int(swap_dir.get("written_nbytes", 0))
    return total


def _progress(step: int, steps: int, loss: float, step_s: float, moved: int) -> None:
    done = int(30 * step / steps)
    bar = "#" * done + "." * (30 - done)
    sys.stdout.write(f"\r[{bar}] {step:>3}/{steps} loss {loss:7.4f} "
                     f"step {step_s * 1000:7.1f} ms moved {moved / 2**20:9.1f} MiB")
    sys.stdout.flush()


def _train(engine: Any, rank: int, steps: int) -> dict[str, Any]:
    losses, step_times = [], []
    for step in range(steps):
        started = time.perf_counter()
        loss = engine(synthetic_batch(step, rank))
        engine.backward(loss)
        engine.step()
        step_times.append(time.perf_counter() - started)
        losses.append(loss.item())
        if rank == 0:
            _progress(step + 1, steps, losses[-1], step_times[-1],
                      _moved_nbytes(engine.offload_stats()))
    if rank == 0:
        sys.stdout.write("\n")
    return {"losses": losses, "step_times": step_times, "stats": engine.offload_stats()}


def _demo_rank(rank: int, world_size: int, port: int, steps: int, workdir: str,
               results: Any) -> None:
    import torch.distributed as dist

    from trainer.api import initialize

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        torch.manual_seed(0)
        model = TinyGPT()
        num_params = sum(p.numel() for p in model.parameters())
        device = "nvme" if importlib.util.find_spec("offloadd.swap.nvme") else "cpu"
        config = demo_config(os.path.join(workdir, "swap"), device)
        # Half of the working set (fp32 param, grad, master, exp_avg, exp_avg_sq) on
        # purpose: the engine's default would hold it all in DRAM here, and the demo
        # is meant to show the NVMe tier at work.
        config["offloadd"] = {"workdir": os.path.join(workdir, "daemon"),
                              "arena_size": half_working_set_nbytes(num_params)}
        engine, _, _, _ = initialize(model=model, config=config)
        try:
            outcome = _train(engine, rank, steps)
        finally:
            engine.close()
        if rank == 0:
            results.put({**outcome, "num_params": num_params, "device": device})
    except BaseException as error:
        results.put({"error": f"rank {rank}: {type(error).__name__}: {error}"})
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _summarise(outcome: dict[str, Any], steps: int, world_size: int, wall_s: float) -> dict:
    times = outcome["step_times"][1:] or outcome["step_times"]
    median_s = statistics.median(times)
    tokens = MICRO_BATCH * SEQ_LEN * world_size
    return {
        "steps": steps, "world_size": world_size, "num_params": outcome["num_params"],
        "zero_stage": 3, "offload_device": outcome["device"],
        "first_loss": outcome["losses"][0], "last_loss": outcome["losses"][-1],
        "median_step_s": median_s, "tokens_per_s": tokens / median_s,
        "moved_nbytes": _moved_nbytes(outcome["stats"]),
        "rank0_offload_wait_s": outcome["stats"].get("rank_wait_s", math.nan),
        "wall_s": wall_s,
    }


def _print_table(summary: dict[str, Any]) -> None:
    width = max(len(key) for key in summary)
    print("-" * (width + 24))
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown:>20}")
    print("-" * (width + 24))


def run_training_demo(*, steps: int = 20, world_size: int = 2,
                      workdir: str | None = None) -> dict[str, Any]:
    """Train the demo GPT on ``world_size`` spawned gloo ranks; returns the summary."""
    owned = tempfile.TemporaryDirectory(prefix="offloadd-demo-") if workdir is None else None
    root = owned.name if owned is not None else str(workdir)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    started = time.perf_counter()
    procs = [context.Process(target=_demo_rank, args=(rank, world_size, port, steps, root,
                                                      results)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        outcome = results.get(timeout=600)
    except queue.Empty:
        outcome = {"error": "no result from rank 0 within 600 s"}
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    if owned is not None:
        owned.cleanup()
    if "error" in outcome:
        raise RuntimeError(f"training demo failed: {outcome['error']}")
    summary = _summarise(outcome, steps, world_size, time.perf_counter() - started)
    _print_table(summary)
    return summary


if __name__ == "__main__":
    run_training_demo()
