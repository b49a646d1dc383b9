"""Lightning's DeepSpeed guide with offloadd in DeepSpeedStrategy's place, run by torchrun.

    torchrun --nproc-per-node 2 tests/scripts/lightning_guide_run.py --out DIR \
        --strategy keywords|NAME|ddp [--configure-model] [--init-from FILE]

``--strategy keywords`` passes ``OffloaddStrategy`` the keywords the guide passes
``DeepSpeedStrategy`` for ZeRO-3 on NVMe (``stage=3, offload_optimizer=True,
offload_parameters=True, remote_device="nvme", offload_params_device="nvme",
offload_optimizer_device="nvme", nvme_path=...``); any other value goes to
``Trainer(strategy=...)`` as a string (``"offloadd_stage_3_offload"``, registered by
``import trainer.lightning``, or ``"ddp"``: the reference). A torch AdamW and a per-step
LambdaLR from ``configure_optimizers``, ``gradient_clip_val``. ``--configure-model``
builds the GPT in ``configure_model`` (the guide's "Shard Model Instantly") instead of
``__init__``; ``--init-from`` loads initial weights saved by such a run. Rank 0 writes
``DIR/result.json``: the training loss of every step (mean over ranks), the warnings the
run raised and whether ``configure_model`` built ``meta`` parameters, and
``DIR/initial.pt``: the weights training started from.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _leave import leave_group
from transformers import GPT2Config, GPT2LMHeadModel

import trainer.lightning  # noqa: F401  - registers the offloadd_* strategy names
from trainer.lightning import OffloaddStrategy, TwinAccelerator

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--strategy", required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--configure-model", action="store_true")
parser.add_argument("--init-from", default=None)
args = parser.parse_args()
out = Path(args.out)
SEQ = 16
caught = warnings.catch_warnings(record=True)
raised = caught.__enter__()
warnings.simplefilter("always")


class LanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: GPT2LMHeadModel | None = None
        self.built_meta: bool | None = None
        if not args.configure_model:
            self.build()
        self.losses: list[float] = []

    def build(self) -> None:
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
        self.built_meta = all(param.is_meta for param in self.model.parameters())
        if args.init_from:
            self.load_state_dict(torch.load(args.init_from, weights_only=True))

    def configure_model(self) -> None:
        if args.configure_model and self.model is None:
            self.build()

    def on_train_start(self) -> None:
        strategy = self.trainer.strategy
        state = (strategy.consolidated_state_dict() if isinstance(strategy, OffloaddStrategy)
                 else {name: value.detach().clone() for name, value in self.state_dict().items()})
        if self.trainer.is_global_zero:
            torch.save(state, out / "initial.pt")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(self.all_gather(loss.detach()).float().mean()))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ScratchDirs(pl.Callback):
    """The dirs of the private daemon this rank started (local rank 0), seen at the start
    of training: its swap dir lies under ``nvme_path``."""

    dirs: list[str] = []

    def on_train_start(self, trainer_: Any, module: Any) -> None:
        engine = getattr(trainer_.strategy, "engine", None)
        daemon = getattr(getattr(engine, "backend", None), "private_daemon", None)
        ScratchDirs.dirs = list(daemon.scratch_dirs) if daemon is not None else []


class SummaryCounts(pl.Callback):
    """What the model summary (on by default, as the guide leaves it) counts at the start
    of fitting: at ZeRO-3 the parameters are partitioned then."""

    counts: dict[str, int] = {}

    def on_fit_start(self, trainer_: Any, module: Any) -> None:
        summary_callback = next(callback for callback in trainer_.callbacks
                                if isinstance(callback, pl.callbacks.ModelSummary))
        summary = summary_callback._summary(trainer_, module)
        SummaryCounts.counts = {"total": summary.total_parameters,
                                "trainable": summary.trainable_parameters}


strategy: Any = args.strategy
if args.strategy == "keywords":
    strategy = OffloaddStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                                remote_device="nvme", offload_params_device="nvme",
                                offload_optimizer_device="nvme", nvme_path=str(out / "swap"))
module = LanguageModel()
tokens = torch.randint(0, 97, (16, SEQ), generator=torch.Generator().manual_seed(1))
twin = args.strategy != "ddp" and TwinAccelerator.is_available()  # OFFLOADD_TWIN_DEVICE
lightning_trainer = pl.Trainer(
    accelerator=TwinAccelerator() if twin else "cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=strategy,
    max_steps=args.steps, gradient_clip_val=0.5, logger=False, enable_progress_bar=False,
    enable_checkpointing=False, num_sanity_val_steps=0,
    callbacks=[ScratchDirs(), SummaryCounts()])
lightning_trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(tokens,
                                                                             batch_size=2))
caught.__exit__(None, None, None)
if lightning_trainer.is_global_zero:
    (out / "result.json").write_text(json.dumps({
        "strategy": type(lightning_trainer.strategy).__name__,
        "device": str(lightning_trainer.strategy.root_device),
        "built_meta": module.built_meta,
        "losses": module.losses,
        "scratch_dirs": ScratchDirs.dirs,
        "summary": SummaryCounts.counts,
        "warnings": [f"{item.category.__name__}: {item.message}" for item in raised
                     if "offloadd" in str(item.message) or "lr_scheduler" in str(item.message)]}))
leave_group()
