"""An Accelerate loop on offloadd: add ``import trainer.hf`` and a DeepSpeedPlugin.

    torchrun --nproc-per-node 2 examples/accelerate_train.py

The loop is the usual one: ``prepare``, ``accumulate``, ``backward``, ``save_state``.
ZeRO-3 keeps parameters and optimizer state on NVMe.
"""

from __future__ import annotations

import argparse

import trainer.hf  # noqa: F401  - the one added line, before accelerate

# isort: split
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin
from common import RandomTokens, tiny_causal_lm

parser = argparse.ArgumentParser()
parser.add_argument("--nvme-path", default="/tmp/offloadd-swap")
parser.add_argument("--output-dir", default="accelerate_out")
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()

offload = {"device": "nvme", "nvme_path": args.nvme_path}
plugin = DeepSpeedPlugin(hf_ds_config={
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
})
if not torch.cuda.is_available():
    # CPU only: accelerate joins gloo only for cpu=True (and then ignores DeepSpeed plugins),
    # so the process group comes first, as TrainingArguments does it.
    PartialState(cpu=True)
accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)

model = tiny_causal_lm()  # a real run: AutoModelForCausalLM.from_pretrained("gpt2")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
loader = torch.utils.data.DataLoader(RandomTokens(32), batch_size=4)
model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)

for _epoch in range(args.epochs):
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        accelerator.print(f"loss {loss.item():.4f}")
accelerator.save_state(f"{args.output_dir}/state")  # load_state() resumes exactly
accelerator.end_training()
