"""Parameter groups and frozen parameters (issue 14, items 6 and 7) on 2 gloo ranks.

- torch-style group dicts (a no-weight-decay group for biases and norms with its
  own lr) match torch.optim.AdamW with the same groups, in every stage, with the
  state in the rank and in the daemon (whose optimizer service gets each unit's
  group hyper-parameters);
- a frozen base with a trainable head under stage 3: the base is partitioned
  (and offloaded) like the rest, costs no optimizer state, and stays unchanged
  while the head matches AdamW.
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import Any

import pytest
import torch
from _dist import (
    adamw_steps,
    make_batch,
    make_model,
    max_relative_error,
    run_ranks,
    shared_daemon,
)
from torch import nn

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero.groups import resolve_param_groups

pytestmark = pytest.mark.slow

STEPS = 5
HAS_NVME_TIER = importlib.util.find_spec("offloadd.swap.nvme") is not None
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8,
                                         "weight_decay": 0.1}}


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".norm." in name


def groups_of(model: nn.Module) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not no_decay(n)]},
            {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0, "lr": 3e-3,
             "betas": (0.8, 0.95)}]


def frozen_base(model: nn.Module) -> list[torch.Tensor]:
    """Only the classifier head trains."""
    return list(model.head.parameters())


def frozen_middle(model: nn.Module) -> list[torch.Tensor]:
    """The input projection and the head train; gradients flow through the frozen blocks."""
    return [*model.inp.parameters(), *model.head.parameters()]


def zero_section(stage: int, device: str, swap_dir: str | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if device != "none":
        zero["offload_optimizer"] = {"device": device, "nvme_path": swap_dir}
        if stage == 3:
            zero["offload_param"] = {"device": device, "nvme_path": swap_dir}
    return zero


CASES = [("groups", 0, "none"), ("groups", 1, "none"), ("groups", 2, "none"),
         ("groups", 3, "none"), ("groups", 2, "cpu"), ("groups", 3, "cpu"),
         ("frozen", 3, "none"), ("frozen", 3, "cpu"), ("frozen", 2, "none"),
         ("middle", 3, "none"), ("middle", 3, "cpu")]
NVME_CASES = [("groups", 3, "nvme"), ("frozen", 3, "nvme"), ("middle", 3, "nvme")]
SELECT = {"groups": groups_of, "frozen": frozen_base, "middle": frozen_middle}
TRAINED = {"frozen": ("head.",), "middle": ("head.", "inp.")}


def train_rank(rank: int, world: int, cases: list[tuple[str, int, str]]) -> list[Any]:
    swap_dir = tempfile.mkdtemp(prefix="offloadd-groups-")
    results = []
    with shared_daemon(rank, swap_dir) as socket_path:
        for index, (kind, stage, device) in enumerate(cases):
            config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4,
                                      "optimizer": OPTIMIZER,
                                      "zero_optimization": zero_section(stage, device, swap_dir)}
            if device != "none":
                config["offloadd"] = {"socket": socket_path, "job": f"groups{index}",
                                      "arena_size": 4 << 20}
            model = make_model()
            engine, _, _, _ = trainer.initialize(model=model, config=config,
                                                 model_parameters=SELECT[kind](model))
            try:
                for step in range(STEPS):
                    engine.backward(engine(*make_batch(step, 0, rank, 4)))
                    engine.step()
                frozen = [unit for unit in engine.units if not unit.trainable]
                facts = {"frozen_units": len(frozen),
                         "frozen_state": [engine.backend.get_state(u.index) for u in frozen],
                         # Outside forward a frozen unit is freed, or held gathered for
                         # the next forward (its values never change: FullParams.hold).
                         "frozen_numel_outside_forward": [
                             slot.param.numel() for u in frozen for slot in u.slots
                             if u.index not in engine.placement.held],
                         "frozen_held": sum(u.index in engine.placement.held
                                            for u in frozen),
                         "lrs": engine.get_lr()}
                state = consolidate_fp32_state_dict(engine)
                if stage == 3:
                    facts["reloaded"] = _save_and_reload(engine, config, kind)
                results.append((state, facts))
            finally:
                engine.close()
    return results


def _save_and_reload(engine: Any, config: dict[str, Any], kind: str) -> dict[str, Any]:
    """A checkpoint round trip: frozen units keep their parameters, groups their lrs."""
    directory = engine.collectives.all_gather_object(tempfile.mkdtemp(prefix="ckpt-"))[0]
    engine.save_checkpoint(directory)
    if "offloadd" in config:
        config = {**config, "offloadd": {**config["offloadd"],
                                         "job": config["offloadd"]["job"] + "-reload"}}
    model = make_model(seed=1)
    fresh, _, _, _ = trainer.initialize(model=model, config=config,
                                        model_parameters=SELECT[kind](model))
    try:
        fresh.load_checkpoint(directory)
        return consolidate_fp32_state_dict(fresh)
    finally:
        fresh.close()


def reference(kind: str) -> dict[str, torch.Tensor]:
    model = make_model()
    selected = SELECT[kind](model)
    groups = selected if kind == "groups" else [{"params": selected}]
    adamw_steps(model, STEPS, lambda step, _micro, rank: model(*make_batch(step, 0, rank, 4)),
                world_size=2, params=groups, config={"optimizer": OPTIMIZER})
    return model.state_dict()


def check(cases: list[tuple[str, int, str]]) -> None:
    results = run_ranks(train_rank, 2, cases)[0]
    initial = make_model().state_dict()
    for (kind, stage, device), (state, facts) in zip(cases, results, strict=True):
        label = f"{kind} stage {stage} offload {device}"
        assert max_relative_error(state, reference(kind)) < 1e-5, label
        if stage == 3:
            reloaded = facts["reloaded"]
            assert all(torch.equal(reloaded[name], state[name]) for name in state), label
        if kind == "groups":
            assert facts["lrs"] == [1e-2, 3e-3], label
            continue
        for name, value in initial.items():
            if not name.startswith(TRAINED[kind]):
                assert torch.equal(state[name], value), (label, name)
        if stage == 3:  # partitioned like the rest: one frozen unit per block (+ the root's)
            assert facts["frozen_units"] == (4 if kind == "frozen" else 3), label
            assert all(state == {} for state in facts["frozen_state"]), label
            assert set(facts["frozen_numel_outside_forward"]) <= {0}, label
            assert facts["frozen_held"] == facts["frozen_units"], label  # all fit the budget
        else:
            assert facts["frozen_units"] == 0, label


def test_param_groups_and_frozen_base_match_adamw() -> None:
    check(CASES)


@pytest.mark.skipif(not HAS_NVME_TIER, reason="the daemon's NVMe tier is not in this tree")
def test_param_groups_and_frozen_base_through_nvme() -> None:
    check(NVME_CASES)


def test_group_mistakes_name_the_fix() -> None:
    model = make_model()
    config = trainer.parse_config({"train_micro_batch_size_per_gpu": 1}).optimizer
    head = list(model.head.parameters())
    with pytest.raises(ValueError, match="groups 0 and 1"):
        resolve_param_groups(model, [{"params": head}, {"params": head}], config)
    with pytest.raises(ValueError, match="no 'params' key"):
        resolve_param_groups(model, [{"lr": 1.0}], config)
    with pytest.raises(ValueError, match=r"group 0: .*lr"):
        resolve_param_groups(model, [{"params": head, "lr": -1.0}], config)
    with pytest.raises(ValueError, match="mixes tensors and group dicts"):
        resolve_param_groups(model, [head[0], {"params": head[1:]}], config)
