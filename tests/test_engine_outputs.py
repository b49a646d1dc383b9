"""Units whose forward returns its tensors inside an object, on 2 gloo ranks at stage 3.

Stage 3 gathers a unit again for its backward when a gradient reaches the unit's
output: the engine routes the output's tensors through an autograd node that signals
it. It looked only into tensors, tuples, lists and dicts (HF's ``ModelOutput``); a
plain-torch model returning ``SimpleNamespace(loss=..., logits=...)`` or a dataclass
gave no signal, and with its unit released after the forward
(``stage3_max_live_parameters`` below one unit) the backward read the released
parameters ("setStorage: ... out of bounds for storage of size 0"). Dataclasses and
namespaces are now looked into; an object of any other class keeps its unit gathered
for the backward, unless a tensor beside it signals (HF's output with its cache object).
Each trains as torch AdamW does, and only the opaque outputs keep anything gathered
between forward and backward."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch
from _dist import max_relative_error, run_ranks
from torch import nn

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict

WIDTH = 16
STEPS = 3
LR = 1e-2


@dataclasses.dataclass(frozen=True)
class Frozen:
    hidden: torch.Tensor
    aux: Any = None


class Box:
    """An output class the engine cannot look into."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


def wrap(kind: str, hidden: torch.Tensor) -> Any:
    if kind == "namespace":
        return types.SimpleNamespace(hidden=hidden, aux=[hidden.detach()])
    if kind == "dataclass":
        return Frozen(hidden=hidden, aux={"scale": 2})
    if kind == "beside":  # a tensor in sight beside an object: the tensor signals
        return Frozen(hidden=hidden, aux=Box(hidden.detach()))
    return Box(hidden)


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, hidden: torch.Tensor) -> Any:
        return wrap(self.kind, self.norm(hidden + torch.tanh(self.fc(hidden))))


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(3))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, features: torch.Tensor, target: torch.Tensor) -> Any:
        hidden = self.inp(features)
        for block in self.blocks:
            hidden = block(hidden).hidden
        loss = nn.functional.mse_loss(self.head(hidden), target)
        return wrap(self.kind, loss)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)


def train(rank: int, world: int, kind: str, live: int) -> tuple[dict[str, torch.Tensor],
                                                                  list[int]]:
    config = {"train_micro_batch_size_per_gpu": 6,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_max_live_parameters": live},
              "units": {"module_classes": ["Block"]}}
    engine, *_ = trainer.initialize(model=Net(kind), config=config)
    live_before_backward = []
    for step in range(STEPS):
        features, target = batch(step, rank)
        loss = engine(features.to(engine.device), target.to(engine.device)).hidden
        live_before_backward.append(engine.placement.live_numel)
        engine.backward(loss)
        engine.step()
    state = consolidate_fp32_state_dict(engine)
    engine.close()
    return state, live_before_backward


def reference(kind: str) -> dict[str, torch.Tensor]:
    model = Net(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(2):
            (model(*batch(step, rank)).hidden / 2).backward()
        optimizer.step()
    return dict(model.state_dict())


@pytest.mark.parametrize("live", [10, 10**9], ids=["released", "kept"])
@pytest.mark.parametrize("kind", ["namespace", "dataclass", "beside", "opaque"])
def test_outputs_in_objects_train_as_torch(kind: str, live: int) -> None:
    ours, live_numel = run_ranks(train, 2, kind, live)[0]
    assert max_relative_error(ours, reference(kind)) < 1e-5
    if live == 10:  # every unit released after its forward, unless nothing would gather
        # it for its backward
        assert all(numel > 0 for numel in live_numel) == (kind == "opaque"), live_numel
        assert all(numel == 0 for numel in live_numel) == (kind != "opaque"), live_numel
