"""Parameter groups: ``model_parameters`` as torch-style group dicts, per-group hyper-parameters.

    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n]
    decay = [p for n, p in model.named_parameters() if not any(p is q for q in no_decay)]
    trainer.initialize(model=model, config=cfg, model_parameters=[
        {"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-4}])

A group may set ``lr``, ``weight_decay``, ``betas`` and ``eps``; the rest come
from the config's ``optimizer.params``. Parameters in no group are frozen
(``requires_grad=False``). Units never mix groups (``trainer.zero.partition``
splits a module's parameters into one unit per group), so every optimizer
step — in the rank or in the daemon's optimizer service — runs one set of
hyper-parameters over a contiguous partition.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.config import OptimizerConfig

GROUP_HYPER_KEYS = ("lr", "weight_decay", "betas", "eps")
"""Keys a group dict may override (others, e.g. ``name``, are kept but unused)."""


@dataclass(kw_only=True)
class ParamGroups:
    """The trainable parameters split into groups, and each group's hyper-parameters."""

    hyper: list[dict[str, Any]]
    """Per group: lr, betas, eps, weight_decay (and any extra keys the user passed)."""
    group_of: dict[int, int] = field(default_factory=dict)
    """Parameter id -> group index, for every trainable parameter."""
    inference: bool = False
    """No optimizer (DeepSpeed's inference engine): units are laid out by the groups, as
    training's would be, so a training checkpoint's weights load, but every unit is
    frozen: no fp32 master, no moments, the parameters' ``requires_grad`` untouched."""


def resolve_param_groups(model: nn.Module, model_parameters: Iterable[Any] | None,
                         optimizer: OptimizerConfig) -> ParamGroups:
    """Validate ``model_parameters`` (tensors or group dicts) and freeze what is left out."""
    params = list(model.parameters())
    if not params:
        raise ValueError(f"model {type(model).__name__} has no parameters; nothing to train")
    defaults = {"lr": optimizer.lr, "betas": tuple(optimizer.betas), "eps": optimizer.eps,
                "weight_decay": optimizer.weight_decay}
    if model_parameters is None:
        return ParamGroups(hyper=[dict(defaults)], group_of={
            id(param): 0 for param in params if param.requires_grad})
    entries = list(model_parameters)
    if entries and all(isinstance(entry, dict) for entry in entries):
        groups = [_group(entry, index, defaults) for index, entry in enumerate(entries)]
    elif any(isinstance(entry, dict) for entry in entries):
        raise ValueError("model_parameters mixes tensors and group dicts; pass either "
                         "parameters or a list of {'params': [...], ...} dicts")
    else:
        groups = [(entries, dict(defaults))]
    resolved = ParamGroups(hyper=[hyper for _, hyper in groups])
    known = {id(param) for param in params}
    for index, (group_params, _) in enumerate(groups):
        for param in group_params:
            if id(param) not in known:
                raise ValueError(f"model_parameters group {index} contains a tensor that is "
                                 "not a parameter of model")
            if id(param) in resolved.group_of:
                raise ValueError(f"a parameter appears in param groups "
                                 f"{resolved.group_of[id(param)]} and {index}; each "
                                 "parameter must be in exactly one group")
            resolved.group_of[id(param)] = index
    for param in params:
        if id(param) not in resolved.group_of:
            param.requires_grad_(False)
        elif not param.requires_grad:
            del resolved.group_of[id(param)]  # frozen by the user: nothing to optimise
    return resolved


def _group(entry: dict[str, Any], index: int,
           defaults: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    if "params" not in entry:
        raise ValueError(f"model_parameters group {index} has no 'params' key "
                         f"(keys: {sorted(entry)})")
    group_params = entry["params"]
    group_params = [group_params] if isinstance(group_params, torch.Tensor) else list(
        group_params)
    hyper = {**defaults, **{key: value for key, value in entry.items() if key != "params"}}
    hyper["betas"] = tuple(hyper["betas"])
    # The config's own validation, so a group's bad value names the same accepted range.
    try:
        OptimizerConfig(**{key: hyper[key] for key in GROUP_HYPER_KEYS})
    except ValueError as error:
        raise ValueError(f"model_parameters group {index}: {error}") from None
    return group_params, hyper
