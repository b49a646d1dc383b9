"""Lightning's DeepSpeed guide, its activation checkpointing as written there: the
module calls ``deepspeed.checkpointing.checkpoint(self.block_1, x)`` and the strategy
gets ``partition_activations=True, cpu_checkpointing=True``. With ``import
trainer.deepspeed`` before ``import deepspeed`` (the line a DeepSpeed script adds), the
name is offloadd's facade and ``OffloaddStrategy`` in ``DeepSpeedStrategy``'s place trains
the guide's module on 2 ranks at ZeRO-3, parameters and optimizer offloaded, to where
torch AdamW takes the same module (blocks called plainly) from the same start."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import max_relative_error, run_ranks

pytest.importorskip("lightning", reason="the lightning extra is not installed")
pytestmark = pytest.mark.slow

STEPS = 3
LR = 1e-2


def _module(checkpointed: bool) -> Any:
    import lightning.pytorch as pl
    from torch import nn

    class GuideModel(pl.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "block_1"):
                self.block_1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
                self.block_2 = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if checkpointed:
                import deepspeed

                x = deepspeed.checkpointing.checkpoint(self.block_1, x)
            else:
                x = self.block_1(x)
            return self.block_2(x)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return GuideModel()


def _data() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(
        torch.randn(4 * STEPS, 32, generator=torch.Generator().manual_seed(3)))


def _fit(rank: int, world: int) -> dict[str, Any]:
    import trainer.deepspeed  # noqa: F401  - before `import deepspeed`, as the guide's script

    return _fit_guide(rank, world)


def _fit_guide(rank: int, world: int) -> dict[str, Any]:
    import deepspeed
    import lightning.pytorch as pl

    from trainer.lightning import OffloaddStrategy

    states: dict[str, Any] = {}

    class Snapshots(pl.Callback):
        def on_train_start(self, trainer_: Any, module: Any) -> None:
            states["initial"] = trainer_.strategy.consolidated_state_dict()

        def on_train_end(self, trainer_: Any, module: Any) -> None:
            states["final"] = trainer_.strategy.consolidated_state_dict()

    strategy = OffloaddStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                                partition_activations=True, cpu_checkpointing=True)
    trainer_ = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy,
                          max_steps=STEPS, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          use_distributed_sampler=False, callbacks=[Snapshots()])
    mine = torch.utils.data.Subset(_data(), range(rank, 4 * STEPS, world))
    trainer_.fit(_module(checkpointed=True), torch.utils.data.DataLoader(mine, batch_size=2))
    states["facade"] = bool(getattr(deepspeed, "OFFLOADD_FACADE", False))
    return states


def test_guide_checkpointing_through_the_facade_trains_as_torch() -> None:
    result = run_ranks(_fit, 2)[0]
    assert result["facade"]
    module = _module(checkpointed=False)
    module.configure_model()
    module.load_state_dict(result["initial"])
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    inputs = _data().tensors[0]
    for step in range(STEPS):
        # each rank reads every other sample (its Subset)
        batch = inputs[4 * step:4 * step + 4]
        per_rank = [batch[rank::2] for rank in range(2)]
        optimizer.zero_grad()
        (sum(module(part).pow(2).mean() for part in per_rank) / 2).backward()
        optimizer.step()
    assert max_relative_error(result["final"], dict(module.state_dict())) < 1e-5
    assert not torch.equal(result["final"]["block_2.weight"], result["initial"]["block_2.weight"])
