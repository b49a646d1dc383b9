"""A DeepSpeed script, run by offloadd's engine: the only change is the import.

    torchrun --nproc-per-node 2 examples/ds_train.py --deepspeed_config examples/ds_zero3.json

ZeRO-3 with parameters and optimizer state on NVMe through the node's offloadd (a
private one, started by local rank 0, when the config names no socket).
"""

from __future__ import annotations

import argparse

import torch
from common import RandomTokens, tiny_causal_lm

import trainer as deepspeed  # was: import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--checkpoint-dir", default="checkpoints")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
model = tiny_causal_lm()
engine, optimizer, loader, scheduler = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(),
    training_data=RandomTokens(64))

step = 0
while step < args.steps:
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        step += 1
        if deepspeed.comm.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}")
        if step == args.steps:
            break
engine.save_checkpoint(args.checkpoint_dir, client_state={"step": step})
engine.close()
