"""WarmupCosineLR and OneCycle with DeepSpeed's parameters (issue 19, items 6 and 11).

The expected rates are built independently of ``trainer.zero.scheduler``: piecewise
curves through the points DeepSpeed's documentation names (numpy
interpolation for OneCycle's triangle, the cosine written per phase), plus
hand-computed spot values. Then a single-process engine with two parameter
groups trains under each schedule and matches torch AdamW driven by the same
rates (and, for OneCycle, beta1) step by step, in the rank and through the
daemon's optimizer service.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from _dist import make_batch, make_model, max_relative_error

import trainer
from trainer.config import parse_config
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero.scheduler import ONE_CYCLE_BETA2, build_scheduler

STEPS = 24


class Groups:
    """Two param groups with their own lr, as the optimizer facade has them."""

    def __init__(self, lrs: tuple[float, ...] = (0.1, 0.02)) -> None:
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": (0.9, 0.999)}
                                                   for lr in lrs]


def rates(scheduler: dict[str, Any], steps: int,
          lrs: tuple[float, ...] = (0.1, 0.02)) -> tuple[np.ndarray, list[Any]]:
    """Per optimizer step n (0-based), each group's lr it runs with, and the betas."""
    groups = Groups(lrs)
    schedule = build_scheduler(groups, parse_config({"scheduler": scheduler}).scheduler)
    assert schedule is not None
    seen, betas = [], []
    for _ in range(steps):
        seen.append([group["lr"] for group in groups.param_groups])
        betas.append(groups.param_groups[0]["betas"])
        schedule.step()
    return np.array(seen), betas


# ------------------------------------------------------------------ WarmupCosineLR


def cosine_reference(n: int, *, total: int, warmup: int, min_ratio: float, cos_min: float,
                     kind: str) -> float:
    """The ratio optimizer step n runs with: 0 first (the schedule has not started), then
    warmup from min_ratio to 1 over ``warmup`` steps, then half a cosine to cos_min at
    ``total``, flat after."""
    if n == 0:
        return 0.0
    k = n - 1  # iterations completed before step n
    if k < warmup:
        fraction = math.log(1 + k, warmup) if kind == "log" else k / warmup
        return min_ratio + (1 - min_ratio) * fraction
    decay = max(1, total - warmup)
    done = min(decay, k - warmup + 1)
    return cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * done / decay))


@pytest.mark.parametrize("kind", ["linear", "log"])
def test_warmup_cosine_matches_its_definition(kind: str) -> None:
    params = {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
              "cos_min_ratio": 0.05, "warmup_type": kind}
    seen, betas = rates({"type": "WarmupCosineLR", "params": params}, 30)
    expected = np.array([[cosine_reference(n, total=20, warmup=5, min_ratio=0.1,
                                           cos_min=0.05, kind=kind) * lr for lr in (0.1, 0.02)]
                         for n in range(30)])
    np.testing.assert_allclose(seen, expected, rtol=1e-12, atol=0)
    assert betas[-1] == (0.9, 0.999)  # WarmupCosineLR leaves momentum alone
    # Hand values: the ratio's start, the top of warmup, mid-cosine, the floor.
    assert seen[0, 0] == 0.0 and seen[1, 0] == pytest.approx(0.1 * 0.1)
    assert seen[6, 0] == pytest.approx(0.1 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi / 15))))
    assert seen[13, 1] == pytest.approx(
        0.02 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * 8 / 15))))
    assert seen[20:, 0] == pytest.approx(0.1 * 0.05)
    assert seen[20:, 1] == pytest.approx(0.02 * 0.05)


def test_warmup_cosine_defaults_and_short_runs() -> None:
    """DeepSpeed's defaults (log warmup from 0 over 1000 steps, floor 1e-4); a total below
    the warmup goes straight to the floor after it."""
    seen, _ = rates({"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}, 3)
    assert seen[1, 0] == 0.0 and seen[2, 0] == pytest.approx(0.1 * math.log(2, 1000))
    short = {"type": "WarmupCosineLR", "params": {"total_num_steps": 2, "warmup_num_steps": 4,
                                                  "warmup_type": "linear"}}
    seen, _ = rates(short, 9)
    np.testing.assert_allclose(seen[1:5, 0], [0.0, 0.025, 0.05, 0.075])
    np.testing.assert_allclose(seen[5:, 0], 0.1 * 1e-4)


# ------------------------------------------------------------------------ OneCycle


def one_cycle_reference(steps: int, *, low: float, high: float, first: int, second: int,
                        decay_rate: float = 0.0, decay_size: int = 0,
                        stairs: tuple[int, int] = (0, 0), mom: tuple[float, float] = (0.8, 0.9),
                        mom_decay: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Rate and beta1 of optimizer steps 0..steps-1: step 0 runs at the start values, step
    n >= 1 at batch b = n of a triangle low -> high (b = first) -> low (b = first+second),
    then a hyperbolic decay."""
    total = first + second
    batch = np.arange(steps, dtype=np.float64)
    up = np.clip(batch / first, 0, 1)
    down = np.clip((total - batch) / second, 0, 1)
    height = np.where(batch <= first, up, down)
    if any(stairs):
        count = np.where(batch <= first, stairs[0], stairs[1])
        height = np.where(count > 0, np.floor(height * np.maximum(count, 1) + 1e-9)
                          / np.maximum(count, 1), height)
    lr = low + (high - low) * height
    beta1 = mom[1] - (mom[1] - mom[0]) * height
    after = batch > total
    if decay_rate and decay_size:
        lr = np.where(after, low / (1 + decay_rate * np.maximum(batch - total, 0) / decay_size),
                      lr)
    else:
        lr = np.where(after, low, lr)
    if mom_decay and decay_size:
        beta1 = np.where(after, mom[1] * (1 + mom_decay * (batch - total) / decay_size), beta1)
    else:
        beta1 = np.where(after, mom[1], beta1)
    lr[0], beta1[0] = low, mom[0]
    return lr, beta1


@pytest.mark.parametrize("params", [
    {},
    {"cycle_second_step_size": 6},
    {"decay_lr_rate": 0.5, "decay_step_size": 3, "decay_mom_rate": 0.01},
    {"cycle_first_stair_count": 2},
    {"cycle_first_stair_count": 4, "cycle_second_step_size": 6, "cycle_second_stair_count": 3},
])
def test_one_cycle_matches_its_definition(params: dict[str, Any]) -> None:
    config = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, **params}
    seen, betas = rates({"type": "OneCycle", "params": config}, 20)
    stairs = (params.get("cycle_first_stair_count", 0),
              params.get("cycle_second_stair_count", params.get("cycle_first_stair_count", 0)))
    lr, beta1 = one_cycle_reference(
        20, low=0.01, high=0.1, first=4, second=params.get("cycle_second_step_size", 4),
        decay_rate=params.get("decay_lr_rate", 0.0),
        decay_size=params.get("decay_step_size", 0), stairs=stairs,
        mom_decay=params.get("decay_mom_rate", 0.0))
    np.testing.assert_allclose(seen[:, 0], lr, rtol=1e-12)
    np.testing.assert_allclose(seen[:, 1], lr, rtol=1e-12)  # OneCycle sets every group
    np.testing.assert_allclose([b[0] for b in betas], beta1, rtol=1e-12)
    assert {b[1] for b in betas} == {ONE_CYCLE_BETA2}


def test_one_cycle_hand_values() -> None:
    """cycle 0.01 -> 0.1 over 4 steps and back over 4: steps 0..9 by hand."""
    seen, betas = rates({"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}}, 10)
    np.testing.assert_allclose(seen[:, 0], [0.01, 0.0325, 0.055, 0.0775, 0.1, 0.0775, 0.055,
                                            0.0325, 0.01, 0.01])
    np.testing.assert_allclose([b[0] for b in betas], [0.8, 0.875, 0.85, 0.825, 0.8, 0.825,
                                                       0.85, 0.875, 0.9, 0.9])


def test_one_cycle_without_momentum_keeps_betas() -> None:
    _, betas = rates({"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_momentum": False}}, 5)
    assert set(betas) == {(0.9, 0.999)}


# ------------------------------------------------------------- through the engine

SCHEDULES = {
    "cosine": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 16, "warmup_num_steps": 4, "warmup_min_ratio": 0.2,
        "cos_min_ratio": 0.1, "warmup_type": "linear"}},
    "one_cycle": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 5,
        "cycle_second_step_size": 7, "decay_lr_rate": 0.3, "decay_step_size": 2,
        "cycle_first_stair_count": 2}},
}


def groups_of(model: torch.nn.Module, lrs: tuple[float, float]) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "lr": lrs[0]},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": lrs[1],
             "weight_decay": 0.0}]


def torch_reference(name: str, lrs: tuple[float, float]) -> dict[str, torch.Tensor]:
    """torch AdamW whose groups' lr (and beta1) follow the independent definitions."""
    model = make_model()
    optimizer = torch.optim.AdamW(groups_of(model, lrs), eps=1e-8, weight_decay=0.01)
    if name == "cosine":
        params = SCHEDULES["cosine"]["params"]
        ratio = [cosine_reference(n, total=16, warmup=4, min_ratio=params["warmup_min_ratio"],
                                  cos_min=params["cos_min_ratio"], kind="linear")
                 for n in range(STEPS)]
        schedule = [[r * lr for lr in lrs] for r in ratio]
        beta1, beta2 = [0.9] * STEPS, 0.999
    else:
        lr, beta = one_cycle_reference(STEPS, low=0.002, high=0.02, first=5, second=7,
                                       decay_rate=0.3, decay_size=2, stairs=(2, 2))
        schedule, beta1, beta2 = [[x, x] for x in lr], list(beta), ONE_CYCLE_BETA2
    for step in range(STEPS):
        for group, rate in zip(optimizer.param_groups, schedule[step], strict=True):
            group["lr"] = rate
            group["betas"] = (beta1[step], beta2)
        optimizer.zero_grad()
        model(*make_batch(step, 0, 0, 4)).backward()
        optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_engine_follows_the_schedule(name: str, offload: str) -> None:
    lrs = (0.01, 0.004)
    zero: dict[str, Any] = {"stage": 2}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1.0, "betas": [0.9, 0.999],
                                                        "eps": 1e-8, "weight_decay": 0.01}},
              "scheduler": SCHEDULES[name], "units": {"module_classes": ["Block"]}}
    model = make_model()
    engine, _, _, _ = trainer.initialize(model=model, config=config,
                                         model_parameters=groups_of(model, lrs))
    try:
        for step in range(STEPS):
            engine.backward(engine(*make_batch(step, 0, 0, 4)))
            engine.step()
        state = consolidate_fp32_state_dict(engine)
    finally:
        engine.close()
    assert max_relative_error(state, torch_reference(name, lrs)) < 1e-5
