"""An ordinary Lightning script, run by torchrun, with OffloaddStrategy or DDP.

    torchrun --nproc-per-node 2 tests/scripts/lightning_run.py --out DIR --mode offloadd \
        [--ckpt-path DIR/checkpoints/step=3.ckpt] [--precision bf16-mixed] \
        [--evaluate DIR/checkpoints/step=6.ckpt]

``--mode offloadd`` passes ``strategy=OffloaddStrategy(config=...)`` (ZeRO-3, parameters
and optimizer on NVMe), on the strict device twin (``TwinAccelerator``) when
``OFFLOADD_TWIN_DEVICE=strict``; ``--mode ddp`` passes ``strategy="ddp"`` on the CPU (the
reference). The
module's configure_optimizers returns a torch AdamW (no weight decay for biases and norms:
two groups) and a per-step LambdaLR; its hyper-parameters hold the script's arguments
(an ``argparse.Namespace``, which only ``weights_only=False`` loads); the Trainer
clips (gradient_clip_val), validates every 3 steps and keeps a ModelCheckpoint every 3
steps. Before ``fit`` (unless resuming) ``trainer.validate(model)`` gives a baseline; after
it, as Lightning's DeepSpeed guide goes on: ``trainer.test()`` (the
"best" checkpoint, i.e. the last one), ``trainer.predict()``, ``trainer.validate(model)``
(the module's weights as fit left them) and ``trainer.test(ckpt_path=<step 3>)``.
``--stage 2`` puts only the optimizer on NVMe. The position embeddings are frozen in every
run; ``--exclude-frozen`` leaves them out of the checkpoints
(``OffloaddStrategy(exclude_frozen_parameters=True)``) and sets the module's
``strict_loading = False``, as a LoRA run under Lightning's DeepSpeed strategy does.
``--evaluate CKPT`` instead runs only
``trainer.test(fresh_module, ckpt_path=CKPT)`` and ``trainer.predict(that_module)``, as a
fresh process would (recording whether that engine's units hold only the fp32 weights),
then ``predict`` of a second Trainer over a second module; rank 0
saves the first module's weights to ``DIR/first.pt`` after that. Rank 0 writes
``DIR/result.json`` (training and validation losses per step, ``test``, ``validate`` and
rank 0's ``predict`` losses) and, after ``fit``, ``DIR/final.pt`` (the full fp32 weights at
the end of training).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _leave import leave_group
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import GPT2Config, GPT2LMHeadModel

from trainer.lightning import OffloaddStrategy, TwinAccelerator

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=["offloadd", "ddp"], required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-path", default=None)
parser.add_argument("--precision", default="32-true")
parser.add_argument("--evaluate", default=None)
parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (2: optimizer on NVMe)")
parser.add_argument("--exclude-frozen", action="store_true",
                    help="checkpoints without the frozen weights; strict_loading = False")
args = parser.parse_args()
out = Path(args.out)
SEQ = 16


class LanguageModel(pl.LightningModule):
    def __init__(self, run_args: argparse.Namespace | None = None) -> None:
        super().__init__()
        # the script's arguments as a hyper-parameter, as scripts pass them: a class
        # torch's weights-only unpickler refuses. Every checkpoint load passes
        # weights_only=False, as under DDP; Lightning 2.6 drops it for strategies that
        # restore after setup, so OffloaddStrategy reads such files as DeepSpeed's does
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
        self.model.transformer.wpe.requires_grad_(False)  # a frozen part, as fine-tunes have
        self.strict_loading = not args.exclude_frozen
        self.losses: dict[str, float] = {}

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        mean = self.all_gather(loss.detach()).float().mean()
        self.losses[f"train/{self.global_step}"] = float(mean)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self(batch)
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> float:
        return float(self(batch))

    def on_validation_epoch_end(self) -> None:
        value = self.trainer.callback_metrics.get("val_loss")
        if value is not None and not self.trainer.sanity_checking:
            self.losses[f"val/{self.global_step}"] = float(value)

    def configure_optimizers(self) -> Any:
        decay = [param for param in self.parameters() if param.ndim >= 2]
        no_decay = [param for param in self.parameters() if param.ndim < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, OffloaddStrategy):
            state = strategy.consolidated_state_dict()
        else:
            state = {name: value.detach().float().clone()
                     for name, value in self.state_dict().items()}
        if self.trainer.is_global_zero:
            torch.save(state, out / "final.pt")
            (out / "device.txt").write_text(str(self.device))


def loader(seed: int, count: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    tokens = torch.randint(0, 97, (count, SEQ), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(tokens, batch_size=2)


if args.mode == "offloadd":
    offload = {"device": "nvme", "nvme_path": str(out / "swap")}
    strategy: Any = OffloaddStrategy(config={
        "zero_optimization": {"stage": args.stage, "offload_optimizer": offload,
                              **({"offload_param": offload} if args.stage == 3 else {})},
        "offloadd": {"arena_size": 4 << 20},
    }, exclude_frozen_parameters=args.exclude_frozen)
else:
    strategy = "ddp"
checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", filename="{step}",
                              every_n_train_steps=3, save_top_k=-1)


def make_trainer(strategy: Any, callbacks: list[Any]) -> pl.Trainer:
    # offloadd on the strict twin (OFFLOADD_TWIN_DEVICE=strict): a device that refuses
    # what CUDA refuses, so the run meets what a GPU run would
    return pl.Trainer(
        accelerator=TwinAccelerator() if TwinAccelerator.is_available() else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy, max_steps=args.steps, precision=args.precision,
        gradient_clip_val=0.5, val_check_interval=3, check_val_every_n_epoch=None,
        num_sanity_val_steps=0, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=True)


lightning_trainer = make_trainer(strategy, [checkpoints])
module = LanguageModel(argparse.Namespace(seq=SEQ, mode=args.mode))
if args.evaluate is None:
    if args.ckpt_path is None:  # a baseline first, as scripts do before training
        module.losses["baseline"] = lightning_trainer.validate(
            module, dataloaders=loader(2, 8))[0]["val_loss"]
    lightning_trainer.fit(module, train_dataloaders=loader(1, 12),
                          val_dataloaders=loader(2, 8), ckpt_path=args.ckpt_path,
                          weights_only=False)
    # no ckpt_path: Lightning loads the "best" checkpoint, the module's hyper-parameters too
    module.losses["test"] = lightning_trainer.test(dataloaders=loader(3, 8),
                                                   weights_only=False)[0]["test_loss"]
    module.losses["predict"] = lightning_trainer.predict(dataloaders=loader(4, 4),
                                                         weights_only=False)
    module.losses["validate"] = lightning_trainer.validate(
        module, dataloaders=loader(2, 8))[0]["val_loss"]
    # an earlier checkpoint read into the engine fit left: the step-3 weights' loss
    step3 = Path(args.ckpt_path) if args.ckpt_path else out / "checkpoints" / "step=3.ckpt"
    module.losses["test/3"] = lightning_trainer.test(
        dataloaders=loader(3, 8), ckpt_path=step3, weights_only=False)[0]["test_loss"]
else:
    module.losses["test"] = lightning_trainer.test(
        module, dataloaders=loader(3, 8), ckpt_path=args.evaluate,
        weights_only=False)[0]["test_loss"]
    module.losses["predict"] = lightning_trainer.predict(module, dataloaders=loader(4, 4))
    # A second Trainer and module in the same process (a sweep): the first engine, idle
    # now, is destroyed as the second one starts, and leaves its module whole
    first = lightning_trainer.strategy.engine
    # an evaluation engine (stage 3): fit's units, the weights only (no master, no moments)
    module.losses["first_units"] = [unit.trainable for unit in first.units]
    module.losses["first_weights_only"] = first.offload_stats()["shard_nbytes"] == 4 * sum(
        unit.padded_numel for unit in first.units)
    second = make_trainer(OffloaddStrategy(config=lightning_trainer.strategy.config), [])
    module.losses["second"] = second.predict(LanguageModel(), dataloaders=loader(4, 4),
                                             ckpt_path=args.evaluate, weights_only=False)
    module.losses["first_closed"] = first.closed
    if lightning_trainer.is_global_zero:
        torch.save({name: value.detach().clone() for name, value in module.state_dict().items()},
                   out / "first.pt")
if lightning_trainer.is_global_zero:
    (out / "result.json").write_text(json.dumps(module.losses))

leave_group()
