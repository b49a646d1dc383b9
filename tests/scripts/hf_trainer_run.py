"""An ordinary HF Trainer script, run by torchrun, with or without offloadd.

    torchrun --nproc-per-node 2 tests/scripts/hf_trainer_run.py --out DIR \
        --mode offloadd --variant config_optim --offload nvme [--max-steps 6] [--resume-from DIR]

``--mode ddp`` runs the same script with no DeepSpeed config (torch DDP on gloo,
torch AdamW, the Trainer's scheduler): the reference. ``--mode offloadd`` adds the
one line (``import trainer.hf``) and ``TrainingArguments(deepspeed=config)``.
``--variant`` picks the config: ``trainer_optim`` (no optimizer/scheduler
sections: the Trainer's AdamW and linear schedule), ``config_optim`` (the
config's AdamW with "auto" hyper-parameters and the Trainer's schedule, which the
engine then steps and checkpoints). No weight decay, so the Trainer's two AdamW groups
and the config's one are the same. (The config's own schedulers are DeepSpeed's, one
step behind HF's: examples/hf_finetune.py runs one.) ``--init PATH`` takes the start
weights from ``from_pretrained(PATH)``, and each rank writes ``DIR/built_rank<r>.json``: how
many parameter elements that built and how many of them hold storage (none under ZeRO-3).
Rank 0 writes ``DIR/result.json``: the logged training losses, eval loss and the step count.
``--evaluate-only`` runs ``evaluate()`` and ``predict()`` with no ``train()`` (DeepSpeed's
inference engine under HF) and writes ``DIR/evaluated.json``: the eval loss, the
predictions' loss, the engine's units (trainable or not), the elements they hold (padded)
and the bytes of the daemon's shards, and how many parameters still require grad.
``--zero-to-fp32`` ends with HF's guide's "online" recipe for the fp32 weights
(``load_state_dict_from_zero_checkpoint(trainer.model, get_last_checkpoint(...))``,
imported from ``deepspeed.utils.zero_to_fp32``); rank 0 saves the model's state dict
then as ``DIR/zero_to_fp32.pt``.
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
parser.add_argument("--variant", choices=["trainer_optim", "config_optim"],
                    default="trainer_optim")
parser.add_argument("--offload", choices=["none", "cpu", "nvme"], default="nvme")
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--max-steps", type=int, default=6)
parser.add_argument("--save-steps", type=int, default=3)
parser.add_argument("--resume-from", default=None, help="a checkpoint-N folder")
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--init", default=None, help="from_pretrained folder of the start weights")
parser.add_argument("--evaluate-only", action="store_true",
                    help="evaluate() and predict() without training")
parser.add_argument("--zero-to-fp32", action="store_true",
                    help="after training, HF's guide's online fp32 weights recipe")
args = parser.parse_args()

if args.mode == "offloadd":
    import trainer.hf  # noqa: F401  - the line an HF script adds

import torch  # noqa: E402
from _leave import leave_group  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
SEQ = 16


def ds_config() -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": args.stage}
    if args.offload != "none":
        nvme = {"nvme_path": str(out / "swap")} if args.offload == "nvme" else {}
        zero["offload_param" if args.stage == 3 else "offload_optimizer"] = {
            "device": args.offload, **nvme}
        if args.stage == 3:
            zero["offload_optimizer"] = {"device": args.offload, **nvme}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "offloadd": {"arena_size": 4 << 20},  # smaller than the state: it really swaps
    }
    if args.variant == "config_optim":
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    return config


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 97, (count, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


training_args = TrainingArguments(
    output_dir=str(out / "run"), per_device_train_batch_size=2, per_device_eval_batch_size=2,
    gradient_accumulation_steps=2, max_steps=args.max_steps, learning_rate=3e-3,
    weight_decay=0.0, warmup_steps=2, max_grad_norm=0.5, logging_steps=1,
    save_steps=args.save_steps, save_strategy="steps", eval_strategy="no",
    bf16=args.bf16, use_cpu=True, report_to=[], seed=0, data_seed=0,
    dataloader_drop_last=True,
    deepspeed=ds_config() if args.mode == "offloadd" else None,
)
torch.manual_seed(0)
if args.init:
    # Under ZeRO-3 (TrainingArguments made first) this builds the model inside
    # deepspeed.zero.Init: on meta, filled from the checkpoint when the Trainer initializes.
    model = GPT2LMHeadModel.from_pretrained(args.init)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"built_rank{rank}.json").write_text(json.dumps({
        "numel": sum(param.numel() for param in model.parameters()),
        "materialised_numel": sum(param.numel() for param in model.parameters()
                                  if not param.is_meta)}))
else:
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                       n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
hf_trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(64, 1),
                     eval_dataset=Tokens(8, 2))
if args.evaluate_only:
    metrics = hf_trainer.evaluate()
    predicted = hf_trainer.predict(Tokens(8, 2)).metrics["test_loss"]
    engine = hf_trainer.model_wrapped.engine
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "evaluated.json").write_text(json.dumps({
            "eval_loss": metrics["eval_loss"], "predict_loss": predicted,
            "trainable": [unit.trainable for unit in engine.units],
            "padded_numel": sum(unit.padded_numel for unit in engine.units),
            "shard_nbytes": engine.offload_stats()["shard_nbytes"],
            "requires_grad": sum(param.requires_grad for param in model.parameters())}))
    leave_group()
hf_trainer.train(resume_from_checkpoint=args.resume_from)
metrics = hf_trainer.evaluate()
hf_trainer.save_model(str(out / "final"))
if int(os.environ.get("RANK", "0")) == 0:
    losses = {entry["step"]: entry["loss"] for entry in hf_trainer.state.log_history
              if "loss" in entry}
    (out / "result.json").write_text(json.dumps({
        "losses": losses, "eval_loss": metrics["eval_loss"],
        "global_step": hf_trainer.state.global_step}))
if args.zero_to_fp32:  # as HF's DeepSpeed guide writes it
    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
    from transformers.trainer_utils import get_last_checkpoint

    checkpoint_dir = get_last_checkpoint(hf_trainer.args.output_dir)
    fp32_model = load_state_dict_from_zero_checkpoint(hf_trainer.model, checkpoint_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(fp32_model.state_dict(), out / "zero_to_fp32.pt")
leave_group()
