"""The fine-tuning journey of README.md ("Fine-tuning a pretrained model") as one script,
launched by torchrun: a pretrained HF causal LM loaded with ``from_pretrained`` inside
``trainer.zero.Init``, ZeRO-3 with parameters and optimizer state on NVMe, bf16, gradient
clipping, WarmupDecayLR, activation checkpointing (``activation_checkpointing_enable()``,
formerly ``gradient_checkpointing_enable()``), the README's no-decay parameter groups,
stage 3's default prefetch.

    torchrun --nproc-per-node 2 tests/scripts/journey_finetune.py --model DIR --nvme DIR \\
        --ckpt DIR --out DIR [--steps 12] [--save-at 6 ...] [--resume] [--export DIR]

Every optimizer step trains on the same global batch of ``GLOBAL_MICRO_BATCHES``
micro-batches whatever the world size (a rank runs ``GLOBAL_MICRO_BATCHES / world``
of them, accumulated), so a run at another world size takes the same steps.
``--resume`` loads the latest checkpoint of ``--ckpt`` first (resharded when it was saved
at another world size). ``--export`` writes ``engine.save_16bit_model`` there and the
engine's logits on ``PROBE_IDS`` to ``<out>/logits.pt``.

What the test reads: ``<out>/losses.rank<r>.txt`` (``step micro loss calls`` lines,
written as each micro-batch ends; ``calls``: forward calls of the first layer's MLP),
``<out>/rank<r>.json`` (the rank's pid, the private daemon's pid and scratch dirs) after
``initialize``, ``<out>/rank<r>.done`` (swap bytes read and written) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers

import trainer

VOCAB = 97
SEQ = 16
MICRO_BATCH = 2
GLOBAL_MICRO_BATCHES = 2
PROBE_IDS = (torch.arange(SEQ).reshape(1, SEQ) * 5 + 3) % VOCAB
"""The tokens whose logits the engine and the exported model are compared on."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a save_pretrained directory")
    parser.add_argument("--nvme", required=True, help="nvme_path")
    parser.add_argument("--ckpt", required=True, help="save_checkpoint directory")
    parser.add_argument("--out", required=True, help="what the test reads")
    parser.add_argument("--steps", type=int, default=12, help="last optimizer step")
    parser.add_argument("--save-at", type=int, action="append", default=[],
                        help="save a checkpoint after this optimizer step (repeatable)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--export", help="engine.save_16bit_model directory")
    return parser.parse_args()


def ds_config(nvme_path: str, world_size: int) -> dict[str, Any]:
    offload = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GLOBAL_MICRO_BATCHES // world_size,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                 "total_num_steps": 12}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": offload,
                              "offload_optimizer": offload},
        # The arena (the node's DRAM cache) is smaller than the state (~2.2 MiB on the
        # node), so the state really swaps; the private daemon of a killed run exits 2 s
        # after its last rank died.
        "offloadd": {"arena_size": 2 << 20, "private_exit_grace_s": 2.0},
    }


def micro_batch(step: int, index: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``index`` of optimizer step ``step`` (0-based), the same on every run:
    arithmetic sequences mod ``VOCAB``, which a model can learn (the test pretrains on
    them, so a fine-tune from the pretrained weights starts at a loss far below chance)."""
    generator = torch.Generator().manual_seed(1000 * step + index)
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=generator)
    stride = torch.randint(1, 4, (MICRO_BATCH, 1), generator=generator)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return {"input_ids": ids, "labels": ids}


class CallCounter:
    """Counts the calls of a module: 2 per micro-batch for a module inside a decoder layer
    when activation checkpointing recomputes the layer in backward, 1 without (the layer's
    own hooks run once either way: transformers checkpoints its ``forward``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.calls += 1

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def report(engine: Any, out: Path, rank: int) -> None:
    daemon = engine.backend.private_daemon
    info = {"pid": os.getpid(), "daemon_pid": engine.backend.client.daemon_pid,
            "scratch_dirs": daemon.scratch_dirs if daemon is not None else []}
    path = out / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(info))
    path.with_suffix(".tmp").rename(path)  # the test never reads half a file


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    trainer.init_distributed(dist_backend="gloo")
    rank, world = trainer.comm.get_rank(), trainer.comm.get_world_size()
    out = Path(args.out)
    config = ds_config(args.nvme, world)

    with trainer.zero.Init(config_dict_or_path=config):
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
    model.activation_checkpointing_enable()  # formerly gradient_checkpointing_enable()
    mlp_calls = CallCounter(model.model.layers[0].mlp)  # for the test
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, *_ = trainer.initialize(model=model, config=config, model_parameters=groups)
    report(engine, out, rank)
    if args.resume:
        engine.load_checkpoint(args.ckpt)

    engine.train()
    losses = open(out / f"losses.rank{rank}.txt", "a")  # noqa: SIM115 - lines as they come
    for step in range(engine.global_steps, args.steps):
        for micro in range(engine.gradient_accumulation_steps()):
            loss = engine(**micro_batch(step, rank * engine.gradient_accumulation_steps()
                                        + micro)).loss
            engine.backward(loss)
            engine.step()
            losses.write(f"{step + 1} {micro} {loss.item()!r} {mlp_calls.take()}\n")
            losses.flush()
        if step + 1 in args.save_at:
            engine.save_checkpoint(args.ckpt)
    losses.close()

    if args.export:
        engine.save_16bit_model(args.export)
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=PROBE_IDS).logits
        if rank == 0:
            torch.save(logits.float(), out / "logits.pt")
    swap = engine.offload_stats()["swap"]["dirs"]
    engine.close()
    (out / f"rank{rank}.done").write_text(json.dumps({
        "swap_read_nbytes": sum(d["read_nbytes"] for d in swap),
        "swap_written_nbytes": sum(d["written_nbytes"] for d in swap)}))
    # Both ranks leave the group together: a rank exiting while gloo's threads still run
    # aborts ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
