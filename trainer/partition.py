"""Units and flat parameters.

The model is split into *units*: unit 0 is the root module, units 1..N are
submodules chosen by class name (``units.module_classes``, e.g. transformer
blocks) or by FSDP-style size-based auto-wrap (``units.min_num_params``).
A unit owns the trainable parameters of its subtree that no nested unit owns;
a parameter shared between units (tied embeddings) belongs to the root unit,
which stays gathered for the whole forward.

Each unit's parameters are concatenated into one flat buffer padded to a
multiple of the number of partitions, so every rank owns an equal contiguous
slice: ``[index * part_numel, (index + 1) * part_numel)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.config import UnitsConfig


@dataclass(kw_only=True)
class ParamSlot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass(kw_only=True)
class Unit:
    """One flat-parameter unit and this rank's partition geometry."""

    index: int
    name: str
    module: nn.Module
    slots: list[ParamSlot]
    numel: int
    """Elements of real parameters (before padding)."""
    padded_numel: int
    """Elements of the flat buffer, a multiple of num_parts."""
    part_numel: int
    """Elements of one rank's partition."""
    part_index: int
    """This rank's partition (0 when the optimizer is not partitioned)."""
    flat: torch.Tensor | None = field(default=None, repr=False)
    """Full flat parameters in the training dtype, when materialised."""

    @property
    def shard_prefix(self) -> str:
        return f"u{self.index}"

    @property
    def device(self) -> torch.device:
        """The compute device the unit's parameters live on."""
        return self.slots[0].param.device

    def part_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's partition of a flat tensor of ``padded_numel`` elements."""
        start = self.part_index * self.part_numel
        return flat.narrow(0, start, self.part_numel)

    def flatten_params(self, dtype: torch.dtype) -> torch.Tensor:
        """A new padded flat copy of the current parameter values."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        for slot in self.slots:
            flat.narrow(0, slot.offset, slot.numel).copy_(slot.param.detach().reshape(-1))
        return flat

    def flatten_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """A padded flat copy of the parameters' ``.grad`` (zeros where absent); clears them."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        for slot in self.slots:
            grad = slot.param.grad
            if grad is not None:
                flat.narrow(0, slot.offset, slot.numel).copy_(grad.reshape(-1))
                slot.param.grad = None
        return flat

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into ``flat`` (the full buffer)."""
        for slot in self.slots:
            slot.param.data = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def release_params(self) -> None:
        """Drop the parameters' storage; they become empty until the next gather."""
        empty = torch.empty(0, dtype=self.slots[0].param.dtype, device=self.device)
        for slot in self.slots:
            slot.param.data = empty


def find_unit_modules(model: nn.Module, config: UnitsConfig) -> list[tuple[str, nn.Module]]:
    """Root first, then unit submodules in module-traversal order."""
    if config.module_classes:
        chosen = _modules_by_class(model, config.module_classes)
    else:
        chosen = set()
        _auto_wrap(model, config.min_num_params, chosen, is_root=True)
    units = [("", model)]
    units += [(name, module) for name, module in model.named_modules()
              if module is not model and id(module) in chosen]
    return units


def _modules_by_class(model: nn.Module, class_names: tuple[str, ...]) -> set[int]:
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in class_names if name not in present]
    if len(missing) == len(class_names):
        raise ValueError(
            f"units.module_classes={list(class_names)} matches no module of the model; "
            f"module classes present: {sorted(present)}"
        )
    return {id(module) for module in model.modules()
            if module is not model and type(module).__name__ in class_names}


def _auto_wrap(module: nn.Module, min_num_params: int, chosen: set[int], *,
               is_root: bool) -> int:
    """FSDP-style post-order wrap; returns the subtree's param count not yet wrapped."""
    unwrapped = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
    for child in module.children():
        unwrapped += _auto_wrap(child, min_num_params, chosen, is_root=False)
    if not is_root and unwrapped >= min_num_params:
        chosen.add(id(module))
        return 0
    return unwrapped


NamedParams = list[tuple[str, nn.Parameter]]


def assign_params(model: nn.Module, unit_modules: list[tuple[str, nn.Module]]) -> list[NamedParams]:
    """Trainable parameters of each unit, in registration order; shared ones go to the root."""
    unit_of_module = {id(module): index for index, (_, module) in enumerate(unit_modules)}
    owner: dict[int, int] = {}
    named: dict[int, tuple[str, nn.Parameter]] = {}
    _walk(model, "", 0, unit_of_module, owner, named)
    owned: list[NamedParams] = [[] for _ in unit_modules]
    for param_id, unit_index in owner.items():
        owned[unit_index].append(named[param_id])
    return owned


def _walk(module: nn.Module, prefix: str, unit_index: int, unit_of_module: dict[int, int],
          owner: dict[int, int], named: dict[int, tuple[str, nn.Parameter]]) -> None:
    unit_index = unit_of_module.get(id(module), unit_index)
    for name, param in module._parameters.items():
        if param is None or not param.requires_grad:
            continue
        if id(param) in owner and owner[id(param)] != unit_index:
            owner[id(param)] = 0  # shared across units: the root keeps it gathered
        else:
            owner.setdefault(id(param), unit_index)
            named.setdefault(id(param), (prefix + name, param))
    for child_name, child in module._modules.items():
        if child is not None:
            _walk(child, f"{prefix}{child_name}.", unit_index, unit_of_module, owner, named)


def build_units(model: nn.Module, config: UnitsConfig, *, num_parts: int,
                part_index: int) -> list[Unit]:
    """Split ``model`` into units with partition geometry; empty units are dropped."""
    unit_modules = find_unit_modules(model, config)
    owned = assign_params(model, unit_modules)
    units: list[Unit] = []
    for (name, module), params in zip(unit_modules, owned, strict=True):
        if params:
            units.append(_make_unit(len(units), name, module, params, num_parts, part_index))
    if not units:
        raise ValueError("the model has no trainable parameters (requires_grad=True); "
                         "nothing to optimise")
    return units


def _make_unit(index: int, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]],
               num_parts: int, part_index: int) -> Unit:
    slots, offset = [], 0
    for param_name, param in params:
        slots.append(ParamSlot(name=param_name, param=param, offset=offset,
                               numel=param.numel(), shape=param.shape))
        offset += param.numel()
    padded = -(-offset // num_parts) * num_parts
    return Unit(index=index, name=name or "<root>", module=module, slots=slots, numel=offset,
                padded_numel=padded, part_numel=padded // num_parts, part_index=part_index)
