"""DeepSpeed-compatible learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle.

A schedule writes ``lr`` (and, for OneCycle, Adam's ``betas``) into
``optimizer.param_groups`` like a torch scheduler; the engine calls ``step()``
once per applied optimizer step. Semantics follow DeepSpeed's
``lr_schedules.py``: ``last_batch_iteration`` starts at -1, construction
writes the rate of iteration -1 (the first optimizer step uses it), and the
k-th ``step()`` writes the rate of iteration k-1.

- WarmupLR: ``min + (max - min) * gamma`` where gamma ramps (log or linear)
  over ``warmup_num_steps`` (at least 2) and then holds at 1; every group gets
  the same rate.
- WarmupDecayLR: the same warmup, then gamma falls linearly to 0 at
  ``total_num_steps``.
- WarmupCosineLR: each group's own lr times a ratio: 0 before the first step,
  then a warmup from ``warmup_min_ratio`` to 1, then a half cosine down to
  ``cos_min_ratio`` at ``total_num_steps``, held there after.
- OneCycle: one triangular cycle between ``cycle_min_lr`` and ``cycle_max_lr``
  (optionally in stairs), beta1 cycling the other way between
  ``cycle_max_mom`` and ``cycle_min_mom`` with beta2 0.99 (as DeepSpeed does),
  then an optional hyperbolic decay.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Protocol

from trainer.config import (
    OneCycleConfig,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupDecayLRConfig,
    WarmupLRConfig,
)

ONE_CYCLE_BETA2 = 0.99
"""Adam's beta2 while OneCycle cycles momentum: DeepSpeed's OneCycle writes
``betas = (momentum, 0.99)`` into every group, whatever beta2 was configured."""


class HasParamGroups(Protocol):
    """Anything with torch-style ``param_groups`` (our optimizer facade)."""

    param_groups: list[dict[str, Any]]


class LRSchedule(abc.ABC):
    """The iteration bookkeeping every DeepSpeed schedule shares."""

    def __init__(self, optimizer: HasParamGroups) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = -1

    @abc.abstractmethod
    def get_lr(self) -> list[float]:
        """Rate for the current iteration, one entry per param group."""

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step (or jump to ``last_batch_iteration``)."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        """Rate currently written in the optimizer."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup fraction at ``iteration`` (< warmup_num_steps)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class WarmupLR(LRSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    def __init__(self, optimizer: HasParamGroups, config: WarmupLRConfig) -> None:
        super().__init__(optimizer)
        self.min_lr = config.warmup_min_lr
        self.delta_lr = config.warmup_max_lr - config.warmup_min_lr
        self.warmup_num_steps = max(2, config.warmup_num_steps)
        self.warmup_type = config.warmup_type
        self._apply()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            rate = self.min_lr
        else:
            rate = self.min_lr + self.delta_lr * self._gamma()
        return [rate] * len(self.optimizer.param_groups)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps,
                                 self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """Warm up like WarmupLR, then decay linearly to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: HasParamGroups, config: WarmupDecayLRConfig) -> None:
        assert config.total_num_steps is not None  # validated by WarmupDecayLRConfig
        self.total_num_steps = config.total_num_steps
        super().__init__(optimizer, config)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRSchedule):
    """Each group's lr (as configured when the schedule starts) times a warmup-then-cosine
    ratio."""

    def __init__(self, optimizer: HasParamGroups, config: WarmupCosineLRConfig) -> None:
        super().__init__(optimizer)
        assert config.total_num_steps is not None  # validated by WarmupCosineLRConfig
        self.total_num_steps = config.total_num_steps
        self.warmup_min_ratio = config.warmup_min_ratio
        self.warmup_num_steps = max(2, config.warmup_num_steps)
        self.warmup_type = config.warmup_type
        self.cos_min_ratio = config.cos_min_ratio
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        """The groups' own rates the ratio scales (DeepSpeed's ``org_lrs``)."""
        self._apply()

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio()
        return [base * ratio for base in self.base_lrs]

    def lr_ratio(self) -> float:
        """The factor on every group's lr at the current iteration."""
        iteration = self.last_batch_iteration
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped: past total_num_steps the ratio stays at its floor instead of rising
        # along the cosine again (also when total_num_steps <= warmup_num_steps).
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


class OneCycle(LRSchedule):
    """DeepSpeed's 1Cycle policy (see the module docstring)."""

    def __init__(self, optimizer: HasParamGroups, config: OneCycleConfig) -> None:
        super().__init__(optimizer)
        assert config.cycle_min_lr is not None and config.cycle_max_lr is not None
        self.min_lr, self.max_lr = config.cycle_min_lr, config.cycle_max_lr
        self.first_step_size = config.cycle_first_step_size
        self.second_step_size = config.cycle_second_step_size or config.cycle_first_step_size
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = config.cycle_first_stair_count
        self.second_stair_count = (config.cycle_first_stair_count
                                   if config.cycle_second_stair_count is None
                                   else config.cycle_second_stair_count)
        self.decay_step_size = config.decay_step_size
        self.decay_lr_rate = config.decay_lr_rate
        self.cycle_momentum = config.cycle_momentum
        self.min_mom, self.max_mom = config.cycle_min_mom, config.cycle_max_mom
        self.decay_mom_rate = config.decay_mom_rate
        self._apply()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            rate = self.min_lr
        elif self.last_batch_iteration < self.total_size:
            rate = self.min_lr + (self.max_lr - self.min_lr) * self._scale()
        elif self.decay_step_size == 0 or self.decay_lr_rate == 0:
            rate = self.min_lr
        else:
            rate = self.min_lr / (1.0 + self.decay_lr_rate * self._decay_interval())
        return [rate] * len(self.optimizer.param_groups)

    def get_mom(self) -> float:
        """Adam's beta1 at the current iteration."""
        if self.last_batch_iteration < 0:
            return self.min_mom
        if self.last_batch_iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale()
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return self.max_mom
        return self.max_mom * (1.0 + self.decay_mom_rate * self._decay_interval())

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _scale(self) -> float:
        """Position in the cycle: 0 at its ends, 1 at its peak (stairs when counted)."""
        batch = self.last_batch_iteration + 1
        in_cycle = batch % self.total_size
        rising = in_cycle <= self.first_step_size
        stairs = self.first_stair_count if rising else self.second_stair_count
        if rising:
            position = in_cycle / self.first_step_size
        else:
            position = (self.total_size - in_cycle) / self.second_step_size
        if stairs > 0:
            # From the integer offset, not the float position, so an exact stair edge
            # (the peak included) is never floored one stair down.
            steps = self.first_step_size if rising else self.second_step_size
            offset = in_cycle if rising else self.total_size - in_cycle
            return math.floor(offset * stairs / steps) / stairs
        return position

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            betas = (self.get_mom(), ONE_CYCLE_BETA2)
            for group in self.optimizer.param_groups:
                group["betas"] = betas


def build_scheduler(optimizer: HasParamGroups,
                    config: SchedulerConfig | None) -> LRSchedule | None:
    """The schedule named by the config, or None when there is no ``scheduler`` section."""
    if config is None:
        return None
    if isinstance(config, WarmupDecayLRConfig):
        return WarmupDecayLR(optimizer, config)
    if isinstance(config, WarmupLRConfig):
        return WarmupLR(optimizer, config)
    if isinstance(config, WarmupCosineLRConfig):
        return WarmupCosineLR(optimizer, config)
    return OneCycle(optimizer, config)
