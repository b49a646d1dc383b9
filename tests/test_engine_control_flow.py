"""Models whose ranks take different paths (issue 14, defects 2 and 3), on 2 gloo ranks.

- A parameter that gets no gradient on one rank (a branch taken only there) and
  one that never gets a gradient: every rank still reduces in one order, and
  training matches torch.optim.AdamW (stages 2 and 3).
- A whole unit skipped on one rank (LayerDrop, an MoE expert no token picked):
  stage 3's gathers would follow different traces per rank, so the engine fails
  with ``TraceDivergenceError`` on the rank that diverged instead of pairing
  one unit's all-gather with another's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import max_relative_error, run_ranks
from torch import nn

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict

pytestmark = pytest.mark.slow

WIDTH = 12
STEPS = 4
LR = 1e-2


class BranchBlock(nn.Module):
    """A residual block with an optional extra layer (and a parameter nothing reads)."""

    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Linear(WIDTH, WIDTH)
        if with_unused:
            self.unused = nn.Parameter(torch.ones(WIDTH))

    def forward(self, hidden: torch.Tensor, use_extra: bool) -> torch.Tensor:
        hidden = hidden + torch.tanh(self.fc(self.norm(hidden)))
        if use_extra:
            hidden = hidden + self.extra(hidden)
        return hidden


class BranchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, WIDTH)
        self.blocks = nn.ModuleList(BranchBlock(with_unused=index == 0) for index in range(3))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, features: torch.Tensor, labels: torch.Tensor, extra_in: int = -1,
                skip: int = -1) -> torch.Tensor:
        hidden = self.inp(features)
        for index, block in enumerate(self.blocks):
            if index != skip:
                hidden = block(hidden, index == extra_in)
        return nn.functional.cross_entropy(self.head(hidden), labels)


def make_model() -> BranchNet:
    torch.manual_seed(0)
    return BranchNet()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def config(stage: int) -> dict[str, Any]:
    # weight_decay 0: torch's AdamW leaves a parameter without a gradient untouched, and
    # a zero gradient with zero moments gives a zero Adam update, so both agree on it.
    return {"train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage}}


def extra_on(rank: int) -> int:
    """Rank 0 runs block 2's extra layer; rank 1 never does."""
    return 2 if rank == 0 else -1


def train_unused(rank: int, world: int, stages: list[int]) -> list[dict[str, torch.Tensor]]:
    states = []
    for stage in stages:
        engine, _, _, _ = trainer.initialize(model=make_model(), config=config(stage))
        try:
            for step in range(STEPS):
                loss = engine(*batch(step, rank), extra_in=extra_on(rank))
                engine.backward(loss)
                engine.step()
            states.append(consolidate_fp32_state_dict(engine))
        finally:
            engine.close()
    return states


def reference_unused() -> dict[str, torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(2):
            (model(*batch(step, rank), extra_in=extra_on(rank)) / 2).backward()
        optimizer.step()
    return model.state_dict()


def test_unused_parameters_reduce_in_one_order_on_every_rank() -> None:
    stages = [2, 3]
    results = run_ranks(train_unused, 2, stages, timeout_s=120)[0]
    expected = reference_unused()
    for stage, state in zip(stages, results, strict=True):
        assert max_relative_error(state, expected) < 1e-5, stage
        assert torch.equal(state["blocks.0.unused"], expected["blocks.0.unused"])


def train_skipping(rank: int, world: int, skip_from_step: int) -> tuple[str, str]:
    """Rank 1 skips block 1 from ``skip_from_step`` on; the outcome as (error type, text)."""
    engine, _, _, _ = trainer.initialize(model=make_model(), config=config(3))
    try:
        for step in range(STEPS):
            skip = 1 if rank == 1 and step >= skip_from_step else -1
            loss = engine(*batch(step, rank), skip=skip)
            engine.backward(loss)
            engine.step()
        return "", ""
    except Exception as error:  # the outcome is the result under test
        return type(error).__name__, str(error)
    finally:
        engine.close()


def test_unit_skipped_in_the_first_step_fails_on_every_rank() -> None:
    outcomes = run_ranks(train_skipping, 2, 0, timeout_s=120)
    for kind, text in outcomes:
        assert kind == "TraceDivergenceError", text
        assert "unit 2 (blocks.1)" in text and "LayerDrop" in text


def test_unit_skipped_later_fails_on_the_rank_that_diverged() -> None:
    # Rank 0 then waits on a gather rank 1 never issues; it fails once rank 1's process
    # group goes away (under torchrun the launcher stops it).
    kind, text = run_ranks(train_skipping, 2, 2, timeout_s=120)[1]
    assert kind == "TraceDivergenceError", text
    assert "rank 1 left its recorded stage-3 trace" in text
    assert "expected unit 2 (blocks.1), got unit 3 (blocks.2)" in text


def train_with_eval(rank: int, world: int) -> list[float]:
    """Eval passes that skip a unit on every rank are a pass kind of their own, not a
    divergence from the training trace."""
    engine, _, _, _ = trainer.initialize(model=make_model(), config=config(3))
    losses = []
    try:
        for step in range(STEPS):
            engine.train()
            engine.backward(engine(*batch(step, rank)))
            engine.step()
            engine.eval()
            with torch.no_grad():
                losses.append(engine(*batch(0, rank), skip=1).item())
        return losses
    finally:
        engine.close()


def test_eval_passes_are_checked_apart_from_training_passes() -> None:
    for losses in run_ranks(train_with_eval, 2, timeout_s=120):
        assert len(losses) == STEPS
