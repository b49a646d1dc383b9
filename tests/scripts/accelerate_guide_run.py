"""Accelerate's DeepSpeed guide with the keyword plugin, run by torchrun, with or without
offloadd.

    torchrun --nproc-per-node 2 tests/scripts/accelerate_guide_run.py --out DIR --base DIR \
        --mode offloadd

``--mode offloadd`` adds ``import trainer.hf`` and ``DeepSpeedPlugin(zero_stage=3,
offload_optimizer_device="nvme", offload_param_device="nvme", ...)`` (keywords, no
config dict: accelerate writes the config, ``steps_per_print`` and
``stage3_gather_16bit_weights_on_model_save`` included); ``--mode ddp`` is the same loop
without it (the reference). The model comes from ``from_pretrained``, which returns it in
eval mode, and the loop never calls ``model.train()``: it trains in eval mode (dropout
off), as torch does. A torch AdamW and a torch LambdaLR stepped after ``optimizer.step()``.
Rank 0 writes ``DIR/result.json``: the loss of every micro-batch (the global mean) and
every warning the run raised.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--base", required=True, help="save_pretrained folder of the model")
parser.add_argument("--mode", choices=["offloadd", "ddp"], required=True)
parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
args = parser.parse_args()

if args.mode == "offloadd":
    import trainer.hf  # noqa: F401  - the line an Accelerate script adds

import torch  # noqa: E402
from _leave import leave_group  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

out = Path(args.out)
ACCUMULATION = 2
SEQ = 16
caught = warnings.catch_warnings(record=True)
raised = caught.__enter__()
warnings.simplefilter("always")

plugin = None
if args.mode == "offloadd":
    plugin = DeepSpeedPlugin(
        zero_stage=3, gradient_accumulation_steps=ACCUMULATION, gradient_clipping=0.5,
        offload_optimizer_device="nvme", offload_param_device="nvme",
        offload_optimizer_nvme_path=str(out / "swap"), offload_param_nvme_path=str(out / "swap"))
if not torch.cuda.is_available():
    PartialState(cpu=True)  # see accelerate_run.py: gloo before the plugin is read
accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUMULATION)
model = AutoModelForCausalLM.from_pretrained(args.base)
assert not model.training  # from_pretrained returns it in eval mode
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
tokens = torch.randint(0, 97, (2 * 2 * ACCUMULATION * args.steps, SEQ),
                       generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(tokens, batch_size=2)
model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)

losses: list[float] = []
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

caught.__exit__(None, None, None)
if int(os.environ.get("RANK", "0")) == 0:
    (out / "result.json").write_text(json.dumps({
        "losses": losses,
        "warnings": [f"{item.category.__name__}: {item.message}" for item in raised]}))
accelerator.end_training()
leave_group()
