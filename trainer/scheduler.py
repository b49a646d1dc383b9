"""DeepSpeed-compatible learning-rate schedules: WarmupLR and WarmupDecayLR.

The schedule writes ``lr`` into ``optimizer.param_groups`` like a torch
scheduler; the engine calls ``step()`` once per optimizer step. Semantics
follow DeepSpeed's ``lr_schedules.py``: at construction the rate is
``warmup_min_lr``; after the k-th ``step()`` (iteration k-1) it is
``min + (max - min) * gamma(k-1)`` where gamma ramps over warmup_num_steps.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from trainer.config import SchedulerConfig


class HasParamGroups(Protocol):
    """Anything with torch-style ``param_groups`` (our optimizer facade)."""

    param_groups: list[dict[str, Any]]


class WarmupLR:
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    def __init__(self, optimizer: HasParamGroups, config: SchedulerConfig) -> None:
        self.optimizer = optimizer
        self.min_lr = config.warmup_min_lr
        self.delta_lr = config.warmup_max_lr - config.warmup_min_lr
        self.warmup_num_steps = max(2, config.warmup_num_steps)
        self.warmup_type = config.warmup_type
        self.last_batch_iteration = -1
        self._set_lr(self.min_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step (or jump to ``last_batch_iteration``)."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._set_lr(self.get_lr()[0])

    def get_lr(self) -> list[float]:
        """Rate for the current iteration, one entry per param group."""
        if self.last_batch_iteration < 0:
            return [self.min_lr]
        return [self.min_lr + self.delta_lr * self._gamma()]

    def get_last_lr(self) -> list[float]:
        """Rate currently written in the optimizer."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._set_lr(self.get_lr()[0])

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return math.log(self.last_batch_iteration + 1) / math.log(self.warmup_num_steps)
        return self.last_batch_iteration / self.warmup_num_steps

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr


class WarmupDecayLR(WarmupLR):
    """Warm up like WarmupLR, then decay linearly to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: HasParamGroups, config: SchedulerConfig) -> None:
        assert config.total_num_steps is not None  # validated by SchedulerConfig
        self.total_num_steps = config.total_num_steps
        super().__init__(optimizer, config)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


def build_scheduler(optimizer: HasParamGroups, config: SchedulerConfig | None) -> WarmupLR | None:
    """The schedule named by the config, or None when there is no ``scheduler`` section."""
    if config is None:
        return None
    if config.type == "WarmupDecayLR":
        return WarmupDecayLR(optimizer, config)
    return WarmupLR(optimizer, config)
