"""PEFT's LoRA guide under the HF Trainer, run by torchrun, with or without offloadd.

    torchrun --nproc-per-node 2 tests/scripts/peft_lora_run.py --out DIR --base DIR \
        --mode offloadd [--full]

The usual order: ``TrainingArguments(deepspeed=<ZeRO-3 config>)`` first, then
``AutoModelForCausalLM.from_pretrained(base)`` (under ZeRO-3 transformers builds it
inside ``deepspeed.zero.Init``: every parameter on ``meta``), then
``get_peft_model(model, LoraConfig(...))``, which re-parents the base model's modules
(``base_model.model.`` prefix, ``.base_layer.`` infix), then ``Trainer(...).train()``,
``evaluate()`` and ``save_model`` (the adapter). ``--mode ddp`` is the same script with
no DeepSpeed config (the reference). ``--full`` trains every weight (no LoRA): the full
fine-tune the LoRA run's swap traffic is compared with.

Rank 0 writes ``DIR/result.json``: the logged losses, the eval loss, the step count and,
under offloadd, the engine's swap counters (``offload_stats``) and how many parameter
elements are trainable / frozen.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--base", required=True, help="save_pretrained folder of the base model")
parser.add_argument("--mode", choices=["offloadd", "ddp"], required=True)
parser.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
parser.add_argument("--max-steps", type=int, default=4)
parser.add_argument("--offload", choices=["none", "nvme"], default="nvme")
parser.add_argument("--arena-bytes", type=int, default=4 << 20)
parser.add_argument("--save-steps", type=int, default=0,
                    help="save a Trainer checkpoint every N steps (0: none)")
parser.add_argument("--resume-from", default=None, help="a Trainer checkpoint to resume from")
args = parser.parse_args()

if args.mode == "offloadd":
    import trainer.hf  # noqa: F401  - the line an HF script adds

import torch  # noqa: E402
from _leave import leave_group  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Trainer,
    TrainingArguments,
    set_seed,
)

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
SEQ = 16
VOCAB = 97


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


zero: dict[str, Any] = {"stage": 3}
ds_config: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": zero}
if args.offload == "nvme":
    offload = {"device": "nvme", "nvme_path": str(out / "swap")}
    zero.update(offload_param=offload, offload_optimizer=offload)
    ds_config["offloadd"] = {"arena_size": args.arena_bytes}
training_args = TrainingArguments(
    output_dir=str(out / "run"), per_device_train_batch_size=2, per_device_eval_batch_size=2,
    gradient_accumulation_steps=1, max_steps=args.max_steps, learning_rate=1e-2,
    weight_decay=0.0, warmup_steps=1, max_grad_norm=1.0, logging_steps=1,
    save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
    eval_strategy="no", use_cpu=True, report_to=[], seed=0, data_seed=0,
    dataloader_drop_last=True,
    deepspeed=ds_config if args.mode == "offloadd" else None,
)
set_seed(0)  # LoRA's A matrices are drawn from torch's RNG in get_peft_model
model = AutoModelForCausalLM.from_pretrained(args.base)
if not args.full:
    model = get_peft_model(model, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM"))
hf_trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(32, 1),
                     eval_dataset=Tokens(8, 2))
hf_trainer.train(resume_from_checkpoint=args.resume_from)
metrics = hf_trainer.evaluate()
hf_trainer.save_model(str(out / "final"))

result: dict[str, Any] = {"eval_loss": metrics["eval_loss"],
                          "global_step": hf_trainer.state.global_step,
                          "losses": {entry["step"]: entry["loss"]
                                     for entry in hf_trainer.state.log_history
                                     if "loss" in entry}}
if not args.full:  # PEFT's count (print_trainable_parameters), parameters partitioned
    result["peft_counts"] = list(model.get_nb_trainable_parameters())
engine = getattr(hf_trainer.model_wrapped, "engine", None)
if engine is not None:
    result["offload_stats"] = engine.offload_stats()
    result["trainable_numel"] = sum(unit.numel for unit in engine.units if unit.trainable)
    result["frozen_numel"] = sum(unit.numel for unit in engine.units if not unit.trainable)
if int(os.environ.get("RANK", "0")) == 0:
    (out / "result.json").write_text(json.dumps(result, default=str))
leave_group()
