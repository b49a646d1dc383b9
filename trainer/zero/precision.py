"""Mixed precision: the training dtype, input casting and loss scaling.

Parameters and activations live in the training dtype (fp32, bf16 or fp16);
the optimizer always keeps fp32 masters. fp16 needs loss scaling: the loss is
multiplied by ``scale`` before backward and the optimizer step divides the
gradients by it again (folded into the step's ``grad_scale``, so there is no
extra pass over the gradients). Dynamic scaling follows DeepSpeed's
``DynamicLossScaler`` (hysteresis, window, floor).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import EngineConfig, Fp16Config

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class LossScaler:
    """No scaling (fp32/bf16) or a static scale; the base of the dynamic scaler."""

    def __init__(self, scale: float = 1.0, *, checks_overflow: bool = False) -> None:
        self.scale = scale
        self.checks_overflow = checks_overflow
        """Whether a step must look for inf/nan gradients and skip if it finds any."""

    def update(self, overflow: bool) -> None:
        """Account one optimizer step; ``overflow`` means it was skipped."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """Halve on overflow (after ``hysteresis`` overflows), double after a clean window."""

    def __init__(self, config: Fp16Config) -> None:
        super().__init__(float(2**config.initial_scale_power), checks_overflow=True)
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.min_scale = config.min_loss_scale
        self.hysteresis_left = config.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.iteration += 1

    def _on_overflow(self) -> None:
        if self.hysteresis == 1 or self.hysteresis_left == 1:
            self.scale = max(self.scale / 2, self.min_scale)
        else:
            self.hysteresis_left -= 1
        self.last_overflow_iteration = self.iteration

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if (self.iteration - self.last_overflow_iteration) % self.window == 0:
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


class Precision:
    """Training dtype plus its loss scaler."""

    def __init__(self, config: EngineConfig) -> None:
        self.dtype_name = config.dtype_name
        self.dtype = DTYPES[self.dtype_name]
        self.scaler = _build_scaler(config)

    def cast_inputs(self, value: Any) -> Any:
        """Cast floating tensors (nested in tuples/lists/dicts) to the training dtype."""
        if isinstance(value, torch.Tensor):
            return value.to(self.dtype) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_inputs(item) for item in value)
        if isinstance(value, dict):
            return {key: self.cast_inputs(item) for key, item in value.items()}
        return value


def _build_scaler(config: EngineConfig) -> LossScaler:
    if not config.fp16.enabled:
        return LossScaler(1.0)
    if config.fp16.loss_scale > 0:
        return LossScaler(config.fp16.loss_scale, checks_overflow=True)
    return DynamicLossScaler(config.fp16)
