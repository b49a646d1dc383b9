"""DeepSpeed's activation checkpointing API (``deepspeed.checkpointing``) on offloadd.

A model written for DeepSpeed checkpoints its blocks with
``deepspeed.checkpointing.checkpoint(block, *inputs)``: the block's activations are
dropped after its forward and recomputed in the backward, and only its inputs are kept
(Lightning's DeepSpeed guide, Megatron-style models). The facade serves these names as
``deepspeed.checkpointing`` (``trainer.hf``); anything else can import them from here.

``checkpoint`` is torch's reentrant checkpoint (DeepSpeed's ``CheckpointFunction`` is
one too: the block's parameters get gradients through inputs that require them, the RNG
state is replayed in the recompute). Where no input requires a gradient (the first
block, fed the batch: Lightning's guide checkpoints just that) a reentrant checkpoint's
output needs none either, and the block's parameters silently get no gradient, under
DeepSpeed too; here that call runs non-reentrant instead, so they do. With
``cpu_checkpointing`` the kept inputs go to host memory, pinned on CUDA, until the
backward brings them back to recompute the block: the device then holds no activation of
a checkpointed block between its forward and its backward. DeepSpeed applies that only
together with ``partition_activations``; here it is what it says in either case, since
there is no model parallelism to split the inputs over (``partition_activations`` is
accepted and splits nothing, as DeepSpeed at a model-parallel size of 1).

The settings come from the config's ``activation_checkpointing`` section when an engine
is initialised, or from ``configure`` (DeepSpeed's arguments); they are per process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from trainer.config import ActivationCheckpointingConfig, parse_config
from trainer.deepspeed_features import UnsupportedFeatureError

logger = logging.getLogger("offloadd.checkpointing")

_settings: ActivationCheckpointingConfig | None = None


def configure(mpu_: Any = None, deepspeed_config: Any = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: the settings from
    ``deepspeed_config`` (a config dict or the path of a JSON file; its
    ``activation_checkpointing`` section), each argument given overriding its key.
    ``mpu_`` (Megatron's model-parallel unit) must describe a model-parallel size of 1:
    offloadd has no model parallelism to split inputs over."""
    if mpu_ is not None:
        size = mpu_.get_model_parallel_world_size()
        if size != 1:
            raise UnsupportedFeatureError(
                f"deepspeed.checkpointing.configure(mpu_=...) with a model-parallel size of "
                f"{size}: offloadd has no model (tensor) parallelism; run data-parallel "
                f"ZeRO (an mpu of size 1, or none)")
    settings = ActivationCheckpointingConfig()
    if deepspeed_config is not None:
        settings = _from_config(deepspeed_config)
    given: dict[str, Any] = {"partition_activations": partition_activations,
                             "contiguous_memory_optimization": contiguous_checkpointing,
                             "number_checkpoints": num_checkpoints,
                             "cpu_checkpointing": checkpoint_in_cpu,
                             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    settings = dataclasses.replace(settings, **{key: value for key, value in given.items()
                                                if value is not None})
    use(settings)


def _from_config(source: Any) -> ActivationCheckpointingConfig:
    if isinstance(source, (str, Path)):
        source = json.loads(Path(source).read_text())
    if not isinstance(source, dict):
        raise TypeError(f"deepspeed_config must be a config dict or the path of a JSON "
                        f"config, got {type(source).__name__}")
    section = source.get("activation_checkpointing", {})
    parsed: ActivationCheckpointingConfig = parse_config(
        {"activation_checkpointing": section}).activation_checkpointing
    return parsed


def use(settings: ActivationCheckpointingConfig) -> None:
    """Make ``settings`` this process's (``initialize`` passes the config's section)."""
    global _settings
    if settings.profile:
        logger.warning("activation_checkpointing.profile: offloadd keeps no per-checkpoint "
                       "timers; time the steps, or read the daemon's metrics")
    _settings = settings


def adopt_section(section: ActivationCheckpointingConfig) -> None:
    """An engine's config section: it sets the settings unless it is the default one and
    ``configure`` set them already (a config without the section leaves them)."""
    if section != ActivationCheckpointingConfig() or not is_configured():
        use(section)


def is_configured() -> bool:
    """Whether ``configure`` (or an engine's config) has set the settings."""
    return _settings is not None


def reset() -> None:
    """DeepSpeed frees its contiguous input buffers between iterations; the kept inputs
    here are ordinary tensors, freed by the backward that used them."""


def settings() -> ActivationCheckpointingConfig:
    return _settings if _settings is not None else ActivationCheckpointingConfig()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with its activations recomputed in the backward (DeepSpeed's
    ``deepspeed.checkpointing.checkpoint``); see the module docstring."""
    needs_grad = any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args)
    return _checkpointed(function, args, reentrant=needs_grad or not torch.is_grad_enabled())


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's non-reentrant variant: gradients reach the block's parameters even
    when no input requires one. Its inputs stay where they are (on the device)."""
    return _checkpointed(function, args, reentrant=False)


def _checkpointed(function: Callable[..., Any], args: tuple[Any, ...], *,
                  reentrant: bool) -> Any:
    current = settings()
    # the reentrant checkpoint saves its inputs for the backward: there they can go to host
    offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
               if reentrant and current.cpu_checkpointing else contextlib.nullcontext())
    _boundary(current)
    with offload:
        outputs = torch_checkpoint(function, *args, use_reentrant=reentrant)
    _boundary(current)
    return outputs


def _boundary(current: ActivationCheckpointingConfig) -> None:
    if current.synchronize_checkpoint_boundary and torch.cuda.is_available():
        torch.cuda.synchronize()


DEEPSPEED_NAMES = ("configure", "is_configured", "reset", "checkpoint",
                   "non_reentrant_checkpoint")
"""The names ``deepspeed.checkpointing`` serves (``trainer.hf``)."""
