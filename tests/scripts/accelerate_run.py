"""An ordinary Accelerate training loop, run by torchrun, with or without offloadd.

    torchrun --nproc-per-node 2 tests/scripts/accelerate_run.py --out DIR --mode offloadd \
        [--save-at 3] [--resume-from DIR/state]

``--mode offloadd`` adds ``import trainer.hf`` and a ``DeepSpeedPlugin(hf_ds_config=...)``
(ZeRO-3, parameters and optimizer on NVMe); ``--mode ddp`` is the same loop without it
(the reference). The loop uses a torch AdamW and a torch LR schedule, gradient
accumulation and clipping; ``save_state`` after ``--save-at`` optimizer steps,
``load_state`` with ``--resume-from``. Rank 0 writes ``DIR/result.json`` (the loss of
every micro-batch, as the global mean) and ``DIR/final.pt`` (the unwrapped weights).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=["offloadd", "ddp"], required=True)
parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
parser.add_argument("--save-at", type=int, default=0)
parser.add_argument("--resume-from", default=None)
args = parser.parse_args()

if args.mode == "offloadd":
    import trainer.hf  # noqa: F401  - the line an Accelerate script adds

import torch  # noqa: E402
from _leave import leave_group  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

out = Path(args.out)
ACCUMULATION = 2
SEQ = 16

plugin = None
if args.mode == "offloadd":
    offload = {"device": "nvme", "nvme_path": str(out / "swap")}
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 3, "offload_param": offload,
                              "offload_optimizer": offload},
        "offloadd": {"arena_size": 4 << 20},
    })
if not torch.cuda.is_available():
    # CPU-only (CI): accelerate sets up gloo only for cpu=True, and with cpu=True it ignores
    # the DeepSpeed plugin, so the process group comes first (as TrainingArguments does).
    PartialState(cpu=True)
accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUMULATION)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                   n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
tokens = torch.randint(0, 97, (2 * 2 * ACCUMULATION * args.steps, SEQ),
                       generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(tokens, batch_size=2)
model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
if args.resume_from:
    accelerator.load_state(args.resume_from)
    loader = accelerator.skip_first_batches(loader, args.save_at * ACCUMULATION)

losses: list[float] = []
step = args.save_at if args.resume_from else 0
model.train()
for batch in loader:
    with accelerator.accumulate(model):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    if accelerator.sync_gradients:
        step += 1
        if step == args.save_at and not args.resume_from:
            accelerator.save_state(str(out / "state"))

state: dict[str, Any] = accelerator.get_state_dict(model)
if int(os.environ.get("RANK", "0")) == 0:
    (out / "result.json").write_text(json.dumps({"losses": losses}))
    torch.save({name: value.float() for name, value in state.items()}, out / "final.pt")
accelerator.end_training()

leave_group()
