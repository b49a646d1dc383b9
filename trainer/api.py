"""``initialize()``, DeepSpeed-shaped: the config (a dict, a JSON path, or DeepSpeed's
``--deepspeed_config`` flag), the compute device and process group, the state backend
(in-process, or a daemon's), the engine with its state layer, and a data loader.

Everything below it is a layer of its own (``device``, ``dist``, ``offload``, ``zero``,
``state``); the integrations (HF, Accelerate, Lightning) and the demo call it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer.config import EngineConfig, parse_config
from trainer.device.compute import ComputeDevice, activate, resolve_device
from trainer.dist.collectives import Collectives
from trainer.dist.distributed import init_distributed
from trainer.offload.backend import InProcessBackend, StateBackend
from trainer.offload.split import SplitBackend
from trainer.state.engine_io import EngineStateIO
from trainer.zero import checkpointing
from trainer.zero.engine import Engine
from trainer.zero.groups import resolve_param_groups
from trainer.zero.optimizer import ZeroOptimizer
from trainer.zero.scheduler import LRSchedule

log = logging.getLogger(__name__)


def initialize(
    args: Any = None,
    *,
    model: nn.Module,
    model_parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
    config: dict[str, Any] | str | os.PathLike[str] | EngineConfig | None = None,
    config_params: dict[str, Any] | None = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Dataset[Any] | None = None,
    collate_fn: Any = None,
    dist_init_required: bool | None = None,
    inference: bool = False,
) -> tuple[Engine, ZeroOptimizer, DataLoader[Any] | None, LRSchedule | None]:
    """Build the engine; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``model_parameters`` selects the trained parameters, as tensors or torch-style
    group dicts with per-group ``lr``/``weight_decay``/``betas``/``eps``
    (``trainer.zero.groups``); the model's other parameters are frozen
    (``requires_grad=False``). ``optimizer`` and
    ``lr_scheduler`` must come from the config (``optimizer``/``scheduler``
    sections). With ``training_data`` a DataLoader of micro-batches (one
    distributed shard per rank) is returned. As in DeepSpeed, the config may instead
    come from ``args.deepspeed_config`` (``add_config_arguments``), and
    ``dist_init_required=False`` means the caller has set up torch.distributed.
    ``inference=True`` (ZeRO stage 3) builds an engine without an optimizer, as DeepSpeed
    does when it is given none: the units training would have (so a training
    checkpoint's weights load into them), partitioned and offloaded in the training
    dtype, with no fp32 master and no moments; ``backward`` and ``step`` are refused.
    """
    if optimizer is not None or lr_scheduler is not None:
        raise ValueError("pass the optimizer and lr scheduler through the config "
                         "('optimizer' and 'scheduler' sections), not as objects")
    source = config_source(args, config, config_params)
    parsed = parse_config(source if not isinstance(source, os.PathLike) else Path(source))
    if inference:
        parsed = dataclasses.replace(parsed,
                                     zero_optimization=parsed.zero_optimization.for_inference())
    else:
        parsed.zero_optimization.check_trains()
    _check_model(model)
    checkpointing.adopt_section(parsed.activation_checkpointing)
    _release_previous_engines(model)
    groups = resolve_param_groups(model, model_parameters, parsed.optimizer)
    groups.inference = inference
    compute = start_compute(parsed, dist_init_required)
    collectives = Collectives(compute)
    parsed.batch_sizes(collectives.world_size)  # fail before any daemon or collective work
    backend = _build_backend(parsed, collectives, model)
    try:
        engine = Engine(model, parsed, collectives=collectives, backend=backend,
                        state_io=EngineStateIO(), param_groups=groups)
    except BaseException:
        backend.close()
        raise
    loader = _build_loader(training_data, engine, collate_fn) if training_data else None
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _release_previous_engines(model: nn.Module) -> None:
    """Hand ``model`` over from the engines that trained it before: each still open is
    destroyed first, its trained weights written back into the module (continual training:
    a new HF Trainer, or a new ``initialize``, over the same model; DeepSpeed fails there
    with stage 3's empty parameters and the old engine's hooks still firing). A stage-3
    parameter whose engine was closed instead is empty: refused, naming the way out.
    Collective where ``destroy`` is: every rank hands the same model over."""
    previous: list[Engine] = []
    for name, param in model.named_parameters():
        link = getattr(param, "_zero_engine", None)
        engine = link() if link is not None else None
        if engine is not None and not engine.closed:
            if all(engine is not seen for seen in previous):
                previous.append(engine)
            continue
        unit = getattr(param, "_zero_unit", None)
        shapes = [slot.shape for slot in unit.slots if slot.param is param] if unit else []
        if shapes and tuple(param.shape) != tuple(shapes[0]):
            raise ValueError(
                f"model parameter {name} is empty: a ZeRO stage 3 engine partitioned it and "
                "was closed (engine.close() gives the weights up with the offload job); "
                "call engine.destroy() instead of close() to keep them in the model, or "
                "load them again (a new model, or load_checkpoint after initialize)")
    for engine in previous:
        log.info("handing the model over from an earlier engine: destroying it first")
        engine.destroy(handover=True)


def start_compute(parsed: EngineConfig, dist_init_required: bool | None) -> ComputeDevice:
    """The config's compute device, made current, and the process group unless the caller
    has set it up (``dist_init_required=False``)."""
    compute = resolve_device(parsed.device)
    activate(compute)
    if dist_init_required is not False:
        init_distributed(compute.dist_backend)
    return compute


def _build_backend(config: EngineConfig, collectives: Collectives,
                   model: nn.Module) -> StateBackend:
    if not config.zero_optimization.offloaded:
        return InProcessBackend()
    from trainer.offload.daemon_connect import connect_backend

    daemon = connect_backend(config, collectives, model)
    ratio = config.zero_optimization.offload_optimizer.ratio
    if ratio == 1.0:
        return daemon
    # Twin-Flow: the rest stays on the device
    return SplitBackend(daemon, ratio=ratio, collectives=collectives)


def _build_loader(data: Dataset[Any], engine: Engine, collate_fn: Any) -> DataLoader[Any]:
    world = engine.collectives.world_size
    sampler: DistributedSampler[Any] | None = None
    if world > 1:
        sampler = DistributedSampler(data, num_replicas=world, rank=engine.collectives.rank)
    return DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(),
                      sampler=sampler, shuffle=sampler is None, collate_fn=collate_fn)


# -- DeepSpeed launcher conventions: a DeepSpeed script's argument handling runs unchanged


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` flags (same names)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable the engine (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed-style JSON config file")
    return parser


def config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config ``initialize`` parses: ``config``, else ``config_params``, else
    ``args.deepspeed_config``; two of them at once is an error, as in DeepSpeed."""
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    given = [source for source in (config, config_params) if source is not None]
    if from_args is not None and given:
        raise ValueError("initialize() got a config both in args.deepspeed_config and in "
                         "config=/config_params=: pass only one")
    if given:
        return given[0]
    if from_args is not None:
        if not isinstance(from_args, (str, os.PathLike)) or not os.path.exists(from_args):
            raise ValueError(f"args.deepspeed_config={from_args!r} is not an existing JSON "
                             "file path")
        return from_args
    raise ValueError("initialize() needs config= (a dict, a JSON path or an EngineConfig) "
                     "or args with a deepspeed_config attribute")
