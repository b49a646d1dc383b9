"""A DeepSpeed-style training script: a small GPT, launched by torchrun, written for
DeepSpeed and run unchanged by offloadd's engine through ``import trainer as deepspeed``.

    torchrun --nproc-per-node 2 tests/scripts/ds_train_gpt.py \
        --deepspeed --deepspeed_config ds_config.json --out result.pt

``--engine deepspeed`` imports the real DeepSpeed instead (same code path below).
Rank 0 writes ``{"losses": [...], "state": {...}, "batch": ...}`` to ``--out``: the
global mean loss per step and the final full fp32 parameters.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from typing import Any

import torch
from torch import nn

VOCAB = 61
SEQ = 12
WIDTH = 32
HEADS = 2
LAYERS = 2


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No projection biases: a key bias has an exactly-zero gradient (softmax is shift
        # invariant), and Adam would turn its float noise into lr-sized steps.
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        q, k, v = self.qkv(hidden).split(WIDTH, dim=-1)
        shape = (batch, seq, HEADS, WIDTH // HEADS)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS)
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        attended = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(attended.transpose(1, 2).reshape(batch, seq, WIDTH))


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln1(hidden))
        return hidden + self.mlp(self.ln2(hidden))


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, an untied LM head; returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(ids[:, :-1]) + self.positions.weight[: ids.shape[1] - 1]
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(self.ln_f(hidden)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def global_batch(step: int, num_samples: int) -> torch.Tensor:
    """The step's tokens for all ranks; rank r trains on its own contiguous slice."""
    generator = torch.Generator().manual_seed(1000 + step % 3)  # repeats: the loss falls
    return torch.randint(0, VOCAB, (num_samples, SEQ), generator=generator)


def parse_args(deepspeed: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    parser.add_argument("--engine", choices=("trainer", "deepspeed"), default="trainer")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3,
                        help="save a checkpoint after this step and load it back (0: never)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def engine_module() -> Any:
    name = "deepspeed" if "--engine=deepspeed" in sys.argv or (
        "--engine" in sys.argv and sys.argv[sys.argv.index("--engine") + 1] == "deepspeed"
    ) else "trainer"
    return importlib.import_module(name)


def full_state(deepspeed: Any, engine: Any) -> dict[str, torch.Tensor] | None:
    """The whole fp32 model on rank 0 (each engine's own way to consolidate ZeRO-3)."""
    if deepspeed.__name__ == "trainer":
        from trainer.state.checkpoint import consolidate_fp32_state_dict

        return consolidate_fp32_state_dict(engine)
    state = engine._zero3_consolidated_16bit_state_dict()
    return {name: value.float().clone() for name, value in state.items()} if state else None


def main() -> None:
    deepspeed = engine_module()
    args = parse_args(deepspeed)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()
    engine, _optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                                    model_parameters=model.parameters())
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(args.steps):
        ids = global_batch(step, engine.train_batch_size())[rank * micro:(rank + 1) * micro]
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / world)
        if args.save_at and step + 1 == args.save_at and args.checkpoint_dir:
            engine.save_checkpoint(args.checkpoint_dir, client_state={"step": step + 1})
            deepspeed.comm.barrier()
            _, client_state = engine.load_checkpoint(args.checkpoint_dir)
            assert client_state["step"] == step + 1, client_state
    state = full_state(deepspeed, engine)
    # The scratch dirs of the private daemons (one per node, started by local rank 0).
    daemon = getattr(getattr(engine, "backend", None), "private_daemon", None)
    scratch: list[list[str]] = [[] for _ in range(world)]
    torch.distributed.all_gather_object(scratch, daemon.scratch_dirs if daemon else [])
    if rank == 0:
        torch.save({"losses": losses, "state": state, "batch": engine.train_batch_size(),
                    "scratch_dirs": sorted(path for dirs in scratch for path in dirs)},
                   args.out)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
