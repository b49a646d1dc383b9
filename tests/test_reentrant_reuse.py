"""A block applied several times in one forward, each application checkpointed
reentrantly (a Universal Transformer's shared layer, ``torch.utils.checkpoint`` with
``use_reentrant=True``): each application's recompute runs a backward of its own, so the
block's parameters accumulate once per application. The block's unit handed its
gradients on after the first and the next one raised ``LateGradientError``, at every
stage. A unit whose forward ran more than once in the pass now waits for the end of the
backward; on 2 gloo ranks (the strict twin) it trains as torch AdamW."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import max_relative_error, run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict

pytestmark = pytest.mark.usefixtures("strict_device_twin")

STEPS = 3
LR = 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden + torch.tanh(self.fc(hidden)))


class Universal(nn.Module):
    """``shared`` applied three times, then two blocks of their own, all checkpointed."""

    def __init__(self, checkpointed: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.inp = nn.Linear(8, 16)
        self.shared = Block()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(features)
        for block in [self.shared] * 3 + list(self.blocks):
            hidden = (checkpoint(block, hidden, use_reentrant=True) if self.checkpointed
                      else block(hidden))
        return self.out(hidden).pow(2).mean()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(7 * step + rank))


def train(rank: int, world: int, stage: int, live: int) -> dict[str, torch.Tensor]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 6, "units": {"module_classes": ["Block"]},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_max_live_parameters": live}}
    engine, *_ = trainer.initialize(model=Universal(), config=config)
    for step in range(STEPS):
        engine.backward(engine(batch(step, rank).to(engine.device)))
        engine.step()
    state = consolidate_fp32_state_dict(engine)
    engine.close()
    return state


@pytest.mark.parametrize(("stage", "live"), [(2, 10**9), (3, 10**9), (3, 10)],
                         ids=["stage2", "stage3", "stage3-released"])
def test_a_block_reused_under_reentrant_checkpoints_trains_as_torch(stage: int,
                                                                     live: int) -> None:
    ours = run_ranks(train, 2, stage, live)[0]
    model = Universal()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(2):
            (model(batch(step, rank)) / 2).backward()
        optimizer.step()
    assert max_relative_error(ours, dict(model.state_dict())) < 1e-5


def deferred_units(rank: int, world: int, checkpointed: bool, passes: int) -> list[str]:
    """The units that waited for the end of the backward, after ``passes`` training
    forwards whose losses one backward sums."""
    config = {"train_micro_batch_size_per_gpu": 6, "units": {"module_classes": ["Block"]},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = trainer.initialize(model=Universal(checkpointed), config=config)
    seen: list[str] = []
    finish = engine.hooks.finish_backward

    def observed() -> None:
        seen.extend(sorted(engine.units[index].name for index in engine.hooks._deferred))
        finish()

    engine.hooks.finish_backward = observed
    loss = sum(engine(batch(index, rank).to(engine.device)) for index in range(passes))
    engine.backward(loss)
    engine.close()
    return seen


def test_only_units_whose_parameters_meet_several_backwards_wait() -> None:
    """Waiting holds a unit's gradients to the end of the backward: only the reused block
    under reentrant checkpoints waits, not every unit of two plain forwards summed (a
    contrastive or preference loss), whose parameters meet one backward."""
    assert run_ranks(deferred_units, 1, True, 1)[0] == ["shared"]
    assert run_ranks(deferred_units, 1, False, 2)[0] == []
    assert run_ranks(deferred_units, 1, True, 2)[0] == ["blocks.0", "blocks.1", "shared"]
