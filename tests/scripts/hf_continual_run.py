"""Continual training with the HF Trainer: one model, a new Trainer per dataset (the
pattern of DeepSpeed issue 5602, where ZeRO-3 fails on the second Trainer).

    python tests/scripts/hf_continual_run.py --out DIR

Every Trainer trains on the same data and then evaluates on it: a Trainer that starts from
where the previous one left the model ends lower. Prints one JSON line: each Trainer's
train and eval loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import trainer.hf  # noqa: F401  - before transformers' Trainer

# isort: split
from common import RandomTokens, tiny_causal_lm
from transformers import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stage", type=int, default=3)
args = parser.parse_args()

config = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": args.stage, "offload_optimizer": {"device": "cpu"},
                          **({"offload_param": {"device": "cpu"}} if args.stage == 3 else {})},
}
model = tiny_causal_lm()
runs = []
for index in range(3):
    hf = Trainer(model=model, train_dataset=RandomTokens(16), eval_dataset=RandomTokens(16),
                 args=TrainingArguments(
                     output_dir=f"{args.out}/run{index}", per_device_train_batch_size=4,
                     max_steps=3, learning_rate=1e-3, bf16=True, use_cpu=True, report_to=[],
                     seed=0, save_strategy="no", deepspeed=config))
    train_loss = hf.train().training_loss
    runs.append({"train": train_loss, "eval": hf.evaluate()["eval_loss"]})
print(json.dumps(runs))
