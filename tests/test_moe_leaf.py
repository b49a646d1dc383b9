"""A mixture-of-experts model under ZeRO-3 with its MoE blocks marked as leaves, as
LLaMA-Factory and TRL mark Mixtral's, Qwen-MoE's and DeepSeek's before
``deepspeed.initialize`` (``from deepspeed.utils import set_z3_leaf_modules``).

The router sends each token to one expert, so each rank runs the experts its own batch
picks. Units chosen by size (``units.min_num_params``) would make every expert a unit of
its own, gathered (a collective) only on the ranks whose tokens reach it; a leaf block is
instead one unit, gathered whole when its forward starts. Before: the name did not exist
in the DeepSpeed facade (ImportError). Now: 2 gloo ranks on the strict device twin,
parameters and optimizer offloaded to the module's daemon, against torch AdamW on both
ranks' batches: the units are the blocks (no expert alone) and the weights match.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, max_relative_error, run_ranks, with_offload

pytestmark = pytest.mark.usefixtures("strict_device_twin")

WIDTH, EXPERTS, STEPS = 13, 4, 3


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 16)
        self.down = torch.nn.Linear(16, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(hidden)))


class MoeBlock(torch.nn.Module):
    """Top-1 routing: only the experts some token picks run (a data-dependent set)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, EXPERTS)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(hidden), dim=-1)
        weight, choice = gates.max(dim=-1)
        out = torch.zeros_like(hidden)
        for index in torch.unique(choice).tolist():
            rows = choice == index
            out[rows] = self.experts[index](hidden[rows]) * weight[rows, None]
        return hidden + out


class MoeNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, WIDTH)
        self.blocks = torch.nn.ModuleList(MoeBlock() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, 5)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(features)
        for block in self.blocks:
            hidden = block(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden), labels)


def moe_net() -> MoeNet:
    torch.manual_seed(4)  # a start whose routers send the two ranks' batches apart
    return MoeNet()


def train_rank(rank: int, world: int, socket: str) -> tuple[list[str], dict[str, torch.Tensor],
                                                             list[int]]:
    import trainer.deepspeed  # noqa: F401  - the line a DeepSpeed script adds, first

    # isort: split
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules

    from trainer.state.checkpoint import consolidate_fp32_state_dict

    model = moe_net()
    marked = set_z3_leaf_modules(model, [MoeBlock])
    config = with_offload(base_config(zero_optimization={"stage": 3},
                                      units={"min_num_params": 300}), "cpu", socket, "moe")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    try:
        for step in range(STEPS):
            features, labels = (t.to(engine.device) for t in make_batch(step, 0, rank, 6))
            loss = engine(features, labels)
            engine.backward(loss)
            engine.step()
        names = [unit.name for unit in engine.engine.units]
        return names, consolidate_fp32_state_dict(engine.engine), [len(marked)]
    finally:
        engine.close()


def test_moe_blocks_marked_as_leaves_train_as_torch(daemon: Any) -> None:
    results = run_ranks(train_rank, 2, str(daemon.socket_path))
    names, weights, marked = results[0]
    assert marked == [2]
    assert "blocks.0" in names and "blocks.1" in names
    assert not [name for name in names if "experts" in name], names
    model = moe_net()
    with torch.no_grad():  # the ranks' first batches reach different sets of experts
        picked = [set(model.blocks[0].router(model.inp(make_batch(0, 0, rank, 6)[0]))
                      .argmax(-1).tolist()) for rank in range(2)]
    assert picked[0] != picked[1] and len(picked[0] | picked[1]) > 1, picked
    hyper = base_config()["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=hyper["lr"], betas=hyper["betas"],
                                  eps=hyper["eps"], weight_decay=hyper["weight_decay"])
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(2):
            (model(*make_batch(step, 0, rank, 6)) / 2).backward()
        for param in model.parameters():  # an expert no token reached: a zero gradient in
            if param.grad is None:       # the flat partitions (DeepSpeed's too); torch skips it
                param.grad = torch.zeros_like(param)
        optimizer.step()
    expected = {name: value.detach().clone() for name, value in model.state_dict().items()}
    assert max_relative_error(weights, expected) < 2e-5
