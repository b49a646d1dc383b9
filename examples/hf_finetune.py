"""An HF Trainer fine-tune on offloadd: the only added line is ``import trainer.hf``.

    torchrun --nproc-per-node 2 examples/hf_finetune.py --deepspeed examples/ds_config.json

``TrainingArguments(deepspeed=...)`` takes the DeepSpeed config as usual ("auto" values
are filled from the arguments); ZeRO-3 keeps parameters and optimizer state on NVMe.
"""

from __future__ import annotations

import argparse

import trainer.hf  # noqa: F401  - the one added line, before transformers' Trainer

# isort: split
import torch
from common import RandomTokens, tiny_causal_lm
from transformers import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", default="examples/ds_config.json")
parser.add_argument("--output-dir", default="hf_out")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

training_args = TrainingArguments(
    output_dir=args.output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
    gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=3e-4,
    weight_decay=0.01, warmup_steps=1, max_grad_norm=1.0, bf16=True, logging_steps=1,
    use_cpu=not torch.cuda.is_available(),  # CPU-only (CI): gloo; drop it on GPU nodes
    save_steps=2, eval_strategy="steps", eval_steps=2, report_to=[], seed=0,
    deepspeed=args.deepspeed,
)
model = tiny_causal_lm()  # a real fine-tune: AutoModelForCausalLM.from_pretrained("gpt2")
hf_trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(64),
                     eval_dataset=RandomTokens(16, seed=1))
hf_trainer.train()
print(hf_trainer.evaluate())
hf_trainer.save_model(f"{args.output_dir}/final")  # loads with from_pretrained
