"""A Lightning module trained on offloadd: pass ``OffloaddStrategy`` as the strategy.

    torchrun --nproc-per-node 2 examples/lightning_train.py

ZeRO-3 keeps parameters and optimizer state on NVMe; bf16-mixed precision, gradient
clipping, validation and ModelCheckpoint work as with any strategy, and
``fit(ckpt_path=...)`` resumes from a saved checkpoint directory.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
from common import RandomTokens, tiny_causal_lm
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer.lightning import OffloaddStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--nvme-path", default="/tmp/offloadd-swap")
parser.add_argument("--output-dir", default="lightning_out")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--ckpt-path", default=None)
args = parser.parse_args()


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_causal_lm()  # a real run: AutoModelForCausalLM.from_pretrained(...)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.01)


offload = {"device": "nvme", "nvme_path": args.nvme_path}
strategy = OffloaddStrategy(config={  # was: strategy="deepspeed_stage_3_offload"
    "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
})
lightning_trainer = pl.Trainer(
    accelerator="auto", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=strategy, precision="bf16-mixed", max_steps=args.steps, gradient_clip_val=1.0,
    val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
    callbacks=[ModelCheckpoint(dirpath=f"{args.output_dir}/checkpoints",
                               every_n_train_steps=2, save_top_k=-1)],
    default_root_dir=args.output_dir, logger=False, enable_progress_bar=False)
loader = torch.utils.data.DataLoader(RandomTokens(32), batch_size=4)
val_loader = torch.utils.data.DataLoader(RandomTokens(8, seed=1), batch_size=4)
lightning_trainer.fit(CausalLM(), loader, val_loader, ckpt_path=args.ckpt_path)
