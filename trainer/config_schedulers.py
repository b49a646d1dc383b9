"""The ``scheduler`` section: one keyword-only dataclass per DeepSpeed schedule type
(``trainer.zero.scheduler`` runs them) and ``build_scheduler``, which parses the section
into the one its ``type`` names. Part of ``trainer.config``'s schema, which re-exports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from trainer.config_parse import build_section, check_value, flatten_typed_section

WarmupType = Literal["log", "linear"]


@dataclass(kw_only=True, frozen=True)
class WarmupLRConfig:
    """``scheduler`` WarmupLR: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold
    (DeepSpeed semantics; every param group gets the same rate)."""

    type: ClassVar[str] = "WarmupLR"
    warmup_min_lr: float = 0.0
    """Learning rate at the start of warmup; >= 0."""
    warmup_max_lr: float = 1e-3
    """Learning rate at the end of warmup; >= warmup_min_lr."""
    warmup_num_steps: int = 1000
    """Optimizer steps of warmup; >= 1 (values below 2 behave as 2, like DeepSpeed)."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup curve."""

    def __post_init__(self) -> None:
        check_value(self.warmup_min_lr >= 0, "scheduler.params.warmup_min_lr", self.warmup_min_lr,
                    ">= 0")
        check_value(
            self.warmup_max_lr >= self.warmup_min_lr,
            "scheduler.params.warmup_max_lr",
            self.warmup_max_lr,
            ">= warmup_min_lr",
        )
        check_value(self.warmup_num_steps >= 1, "scheduler.params.warmup_num_steps",
                    self.warmup_num_steps, ">= 1")


@dataclass(kw_only=True, frozen=True)
class WarmupDecayLRConfig(WarmupLRConfig):
    """``scheduler`` WarmupDecayLR: WarmupLR's warmup, then linear decay to 0."""

    type: ClassVar[str] = "WarmupDecayLR"
    total_num_steps: int | None = None
    """Optimizer steps until the rate reaches 0 (required)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_value(
            self.total_num_steps is not None and self.total_num_steps >= 1,
            "scheduler.params.total_num_steps",
            self.total_num_steps,
            "an int >= 1 (required by WarmupDecayLR)",
        )


@dataclass(kw_only=True, frozen=True)
class WarmupCosineLRConfig:
    """``scheduler`` WarmupCosineLR: each param group's own lr times a ratio that warms up
    from ``warmup_min_ratio`` to 1, then follows a cosine down to ``cos_min_ratio`` at
    ``total_num_steps`` and stays there (DeepSpeed semantics)."""

    type: ClassVar[str] = "WarmupCosineLR"
    total_num_steps: int | None = None
    """Optimizer steps until the ratio reaches cos_min_ratio (required); >= 1."""
    warmup_min_ratio: float = 0.0
    """Ratio of the group's lr at the start of warmup; in [0, 1]."""
    warmup_num_steps: int = 1000
    """Optimizer steps of warmup; >= 1 (values below 2 behave as 2, like DeepSpeed)."""
    cos_min_ratio: float = 0.0001
    """Ratio of the group's lr at the end of the cosine; in [0, 1]."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup curve."""

    def __post_init__(self) -> None:
        check_value(self.total_num_steps is not None and self.total_num_steps >= 1,
                    "scheduler.params.total_num_steps", self.total_num_steps,
                    "an int >= 1 (required by WarmupCosineLR)")
        check_value(0 <= self.warmup_min_ratio <= 1, "scheduler.params.warmup_min_ratio",
                    self.warmup_min_ratio, "[0, 1]")
        check_value(0 <= self.cos_min_ratio <= 1, "scheduler.params.cos_min_ratio",
                    self.cos_min_ratio, "[0, 1]")
        check_value(self.warmup_num_steps >= 1, "scheduler.params.warmup_num_steps",
                    self.warmup_num_steps, ">= 1")


@dataclass(kw_only=True, frozen=True)
class OneCycleConfig:
    """``scheduler`` OneCycle: one triangular cycle of the rate between ``cycle_min_lr`` and
    ``cycle_max_lr`` (and of Adam's beta1 inversely, between ``cycle_max_mom`` and
    ``cycle_min_mom``), then an optional decay (DeepSpeed semantics; with
    ``cycle_momentum`` beta2 is 0.99, as DeepSpeed sets it)."""

    type: ClassVar[str] = "OneCycle"
    cycle_min_lr: float | None = None
    """Rate at the start and end of the cycle (required); >= 0."""
    cycle_max_lr: float | None = None
    """Rate at the peak of the cycle (required); >= 0."""
    decay_lr_rate: float = 0.0
    """After the cycle the rate is cycle_min_lr / (1 + decay_lr_rate * t / decay_step_size);
    >= 0 (0: no decay)."""
    cycle_first_step_size: int = 2000
    """Optimizer steps of the rising half of the cycle; >= 1."""
    cycle_second_step_size: int | None = None
    """Optimizer steps of the falling half; unset: cycle_first_step_size; >= 1."""
    cycle_first_stair_count: int = 0
    """Stairs of the rising half (the rate holds flat on each); 0: continuous; >= 0."""
    cycle_second_stair_count: int | None = None
    """Stairs of the falling half; unset: cycle_first_stair_count; >= 0."""
    decay_step_size: int = 0
    """Optimizer steps per unit of post-cycle decay; 0: no decay; >= 0."""
    cycle_momentum: bool = True
    """Cycle Adam's beta1 inversely to the rate."""
    cycle_min_mom: float = 0.8
    """beta1 at the peak of the rate; in [0, 1)."""
    cycle_max_mom: float = 0.9
    """beta1 at the start and end of the cycle; in [0, 1)."""
    decay_mom_rate: float = 0.0
    """After the cycle beta1 is cycle_max_mom * (1 + decay_mom_rate * t / decay_step_size);
    >= 0."""

    def __post_init__(self) -> None:
        for key in ("cycle_min_lr", "cycle_max_lr"):
            value = getattr(self, key)
            check_value(value is not None and value >= 0, f"scheduler.params.{key}", value,
                        "a number >= 0 (required by OneCycle)")
        for key in ("decay_lr_rate", "decay_mom_rate", "cycle_first_stair_count",
                    "decay_step_size"):
            check_value(getattr(self, key) >= 0, f"scheduler.params.{key}", getattr(self, key),
                        ">= 0")
        check_value(self.cycle_first_step_size >= 1, "scheduler.params.cycle_first_step_size",
                    self.cycle_first_step_size, ">= 1")
        check_value(self.cycle_second_step_size is None or self.cycle_second_step_size >= 1,
                    "scheduler.params.cycle_second_step_size", self.cycle_second_step_size,
                    ">= 1 (or unset for cycle_first_step_size)")
        check_value(self.cycle_second_stair_count is None or self.cycle_second_stair_count >= 0,
                    "scheduler.params.cycle_second_stair_count", self.cycle_second_stair_count,
                    ">= 0 (or unset for cycle_first_stair_count)")
        for key in ("cycle_min_mom", "cycle_max_mom"):
            check_value(0 <= getattr(self, key) < 1, f"scheduler.params.{key}", getattr(self, key),
                        "[0, 1)")


SchedulerConfig = WarmupLRConfig | WarmupCosineLRConfig | OneCycleConfig
"""One ``scheduler`` section (WarmupDecayLRConfig is a WarmupLRConfig)."""

SCHEDULER_CONFIGS: dict[str, type] = {
    cls.type: cls for cls in (WarmupLRConfig, WarmupDecayLRConfig, WarmupCosineLRConfig,
                              OneCycleConfig)}
"""``scheduler.type`` -> its params' dataclass."""


def build_scheduler(section: dict[str, Any]) -> SchedulerConfig:
    """The ``scheduler`` section as the dataclass of its ``type`` (default WarmupLR)."""
    params = flatten_typed_section(section, "scheduler")
    kind = params.pop("type", "WarmupLR")
    if kind not in SCHEDULER_CONFIGS:
        guess = difflib.get_close_matches(str(kind), list(SCHEDULER_CONFIGS), n=1)
        hint = f" (did you mean {guess[0]}?)" if guess else ""
        raise ValueError(f"config key scheduler.type={kind!r} is invalid{hint}: accepted "
                         + ", ".join(map(repr, SCHEDULER_CONFIGS)))
    cls = SCHEDULER_CONFIGS[kind]
    own = {f.name for f in dataclasses.fields(cls)}
    for key in params:
        owners = [name for name, other in SCHEDULER_CONFIGS.items()
                  if key not in own and key in {f.name for f in dataclasses.fields(other)}]
        if owners:
            raise ValueError(f"config key scheduler.params.{key} belongs to "
                             f"{' / '.join(owners)}, but scheduler.type is {kind}: remove "
                             "it or change the type")
    return typing.cast(SchedulerConfig, build_section(cls, params, "scheduler."))
