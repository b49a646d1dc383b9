"""Units and flat parameters.

The model is split into *units*: unit 0 is the root module, units 1..N are
submodules chosen by class name (``units.module_classes``, e.g. transformer
blocks), by FSDP-style size-based auto-wrap (``units.min_num_params``), or by
default the model's repeated blocks: HF ``_no_split_modules`` (``GPT2Block``,
``LlamaDecoderLayer``), else the classes repeated inside a ``ModuleList`` /
``Sequential``, else size-based with ``DEFAULT_MIN_NUM_PARAMS``. A container
without a forward of its own (``ModuleList``, ``ModuleDict``) never becomes a
unit: its hooks would never fire and its parameters would never be gathered.
A unit owns the trainable parameters of its subtree that no nested unit owns;
a parameter shared between units (tied embeddings) belongs to the root unit,
which stays gathered for the whole forward. A module's parameters are split
into one unit per parameter group (``trainer.zero.groups``), so a unit steps with
one set of hyper-parameters; under stage 3 frozen parameters form units of
their own too (``group`` None): partitioned and gathered like the rest, with no
gradient and no optimizer state.

Each unit's parameters are concatenated into one flat buffer padded to a
multiple of the number of partitions, so every rank owns an equal contiguous
slice: ``[index * part_numel, (index + 1) * part_numel)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.config import UnitsConfig


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ds_status`` of a ZeRO-3 parameter: whether its full value is there now.
    Scripts read it to gather only what is partitioned (DeepSpeed-Chat's and OpenRLHF's
    ``_z3_params_to_fetch``: ``GatheredParameters`` over the ``NOT_AVAILABLE`` ones)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
    """DeepSpeed's state for a gather in flight; offloadd's gathers set the value at once."""


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
    group: int | None = 0
    """The parameter group (``trainer.zero.groups``); None: frozen parameters, no optimizer."""
    flat: torch.Tensor | None = field(default=None, repr=False)
    """Full flat parameters in the training dtype, when materialised."""
    compute_device: torch.device | None = None
    """Where the full parameters and gradients live; None: where the parameters are."""
    described: bool = False
    """Its parameters carry DeepSpeed's ZeRO-3 attributes (``describe_sharded``), whose
    ``ds_status`` follows every gather and release."""

    @property
    def trainable(self) -> bool:
        return self.group is not None

    @property
    def shard_prefix(self) -> str:
        return f"u{self.index}"

    @property
    def device(self) -> torch.device:
        """The compute device the unit's full parameters live on (stage 3 builds them
        there from a model still on the host)."""
        return self.compute_device or self.slots[0].param.device

    def part_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's partition of a flat tensor of ``padded_numel`` elements."""
        start = self.part_index * self.part_numel
        return flat.narrow(0, start, self.part_numel)

    def flatten_params(self, dtype: torch.dtype) -> torch.Tensor:
        """A new padded flat copy of the current parameter values."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        for slot in self.slots:  # host parameters are copied to the device here
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
        self.set_status(ZeroParamStatus.AVAILABLE)

    def fragment_span(self, slot: ParamSlot) -> tuple[int, int]:
        """``[begin, end)`` in the flat buffer where ``slot``'s parameter meets this rank's
        partition (``begin == end``: the partition holds none of it)."""
        part_begin = self.part_index * self.part_numel
        begin = max(slot.offset, part_begin)
        end = min(slot.offset + slot.numel, part_begin + self.part_numel)
        return begin, max(begin, end)

    def describe_sharded(self, first_id: int) -> int:
        """Give each parameter DeepSpeed's ZeRO-3 description of a partitioned parameter,
        which libraries read where ``numel()`` is 0 between gathers: ``ds_numel`` and
        ``ds_shape`` (the whole parameter: HF Trainer's and PEFT's parameter counts, PEFT's
        layer shapes), ``ds_id`` (unique, from ``first_id``) and ``partition_numel()`` (its
        elements in this rank's partition: Lightning's ZeRO-3 model summary),
        ``ds_status`` (``ZeroParamStatus``, kept by every gather and release from now on)
        and ``ds_active_sub_modules``.
        Returns the next free id."""
        for offset, slot in enumerate(self.slots):
            param: Any = slot.param
            param.ds_numel = slot.numel
            param.ds_shape = slot.shape
            param.ds_id = first_id + offset
            begin, end = self.fragment_span(slot)
            param.partition_numel = _Constant(end - begin)
            param.ds_status = (ZeroParamStatus.AVAILABLE if param.numel() == slot.numel
                               else ZeroParamStatus.NOT_AVAILABLE)
            param.ds_active_sub_modules = set()  # DeepSpeed's; TRL clears it, nothing reads it
        self.described = True
        return first_id + len(self.slots)

    def set_status(self, status: ZeroParamStatus) -> None:
        if self.described:
            for slot in self.slots:
                slot.param.ds_status = status  # type: ignore[attr-defined]

    def release_params(self) -> None:
        """Drop the parameters' storage; they become empty until the next gather."""
        empty = torch.empty(0, dtype=self.slots[0].param.dtype, device=self.device)
        for slot in self.slots:
            slot.param.data = empty
        self.set_status(ZeroParamStatus.NOT_AVAILABLE)


class _Constant:
    """A call that returns one number (``partition_numel``; not a closure, so a parameter's
    attributes stay simple to pickle)."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


DEFAULT_MIN_NUM_PARAMS = 1_000_000
"""Size-based auto-wrap threshold when the model has no recognisable repeated block."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Modules that are never called: a unit rooted there would never be gathered."""


def find_unit_modules(model: nn.Module, config: UnitsConfig) -> list[tuple[str, nn.Module]]:
    """Root first, then unit submodules in module-traversal order; none strictly inside a
    leaf module (``set_z3_leaf_modules``): a leaf with units inside is their unit."""
    if config.module_classes:
        chosen = _modules_by_class(model, config.module_classes)
    elif config.min_num_params is not None:
        chosen = set()
        _auto_wrap(model, config.min_num_params, chosen, is_root=True)
    else:
        chosen = _default_blocks(model)
    chosen = _lift_to_leaves(model, chosen)
    units = [("", model)]
    units += [(name, module) for name, module in model.named_modules()
              if module is not model and id(module) in chosen]
    return units


LEAF_NAMES = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
              "get_z3_leaf_modules")
"""The leaf-module functions ``deepspeed.utils`` has (the DeepSpeed facade exports them)."""

LEAF_ATTRIBUTE = "_z3_leaf"
"""DeepSpeed's flag on a module whose whole subtree is gathered at its forward."""


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str]
                        ) -> list[nn.Module]:
    """DeepSpeed's ``deepspeed.utils.set_z3_leaf_modules``, before ``initialize``: the
    modules of these classes (types or class names) are gathered whole when their forward
    starts, with no unit inside them. A mixture-of-experts block runs only the experts its
    router picks, a different set on each rank; an expert that was a unit of its own would
    gather (a collective) on some ranks only (LLaMA-Factory and TRL mark the MoE blocks of
    Mixtral, Qwen-MoE and DeepSeek this way). Returns the modules marked."""
    return _mark_leaves(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type | str]
                          ) -> list[nn.Module]:
    """Undo ``set_z3_leaf_modules`` for these classes (before ``initialize``)."""
    return _mark_leaves(model, leaf_module_classes, False)


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``set_z3_leaf_modules`` marked this module."""
    return bool(getattr(model, LEAF_ATTRIBUTE, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if z3_leaf_module(module)]


def _mark_leaves(model: nn.Module, classes: list[type | str], flag: bool) -> list[nn.Module]:
    names = {cls if isinstance(cls, str) else cls.__name__ for cls in classes}
    marked = [module for module in model.modules() if type(module).__name__ in names]
    if not marked:
        raise ValueError(f"no module of the classes {sorted(names)} in the model: name the "
                         f"classes of its blocks (e.g. MixtralSparseMoeBlock)")
    for module in marked:
        setattr(module, LEAF_ATTRIBUTE, flag)
    return marked


def _lift_to_leaves(model: nn.Module, chosen: set[int]) -> set[int]:
    """``chosen`` with the modules strictly inside a leaf replaced by the leaf."""
    for leaf in get_z3_leaf_modules(model):  # outer leaves first (pre-order)
        inner = {id(module) for module in leaf.modules() if module is not leaf}
        if chosen & inner:
            chosen = (chosen - inner) | {id(leaf)}
    return chosen


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


def block_classes(model: nn.Module) -> tuple[str, ...]:
    """The model's repeated block classes: HF ``_no_split_modules``, else the classes that
    occur at least twice among the children of one ModuleList/Sequential (with params)."""
    present = {type(module).__name__ for module in model.modules()}
    declared = tuple(name for name in getattr(model, "_no_split_modules", None) or ()
                     if name in present)
    if declared:
        return declared
    repeated: dict[str, None] = {}
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        counts: dict[str, int] = {}
        for child in module.children():
            if any(True for _ in child.parameters()):
                name = type(child).__name__
                counts[name] = counts.get(name, 0) + 1
        repeated.update((name, None) for name, count in counts.items() if count >= 2)
    return tuple(repeated)


def _default_blocks(model: nn.Module) -> set[int]:
    classes = block_classes(model)
    if classes:
        return {id(module) for module in model.modules()
                if module is not model and type(module).__name__ in classes}
    chosen: set[int] = set()
    _auto_wrap(model, DEFAULT_MIN_NUM_PARAMS, chosen, is_root=True)
    return chosen


def _auto_wrap(module: nn.Module, min_num_params: int, chosen: set[int], *,
               is_root: bool) -> int:
    """FSDP-style post-order wrap; returns the subtree's param count not yet wrapped."""
    unwrapped = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
    for child in module.children():
        unwrapped += _auto_wrap(child, min_num_params, chosen, is_root=False)
    if not is_root and not isinstance(module, _CONTAINERS) and unwrapped >= min_num_params:
        chosen.add(id(module))
        return 0
    return unwrapped


NamedParams = list[tuple[str, nn.Parameter]]


def assign_params(model: nn.Module, unit_modules: list[tuple[str, nn.Module]], *,
                  include_frozen: bool = False) -> list[NamedParams]:
    """Trainable (and with ``include_frozen`` frozen) parameters of each unit, in
    registration order; shared ones go to the root."""
    unit_of_module = {id(module): index for index, (_, module) in enumerate(unit_modules)}
    owner: dict[int, int] = {}
    named: dict[int, tuple[str, nn.Parameter]] = {}
    _walk(model, "", 0, unit_of_module, owner, named, include_frozen)
    owned: list[NamedParams] = [[] for _ in unit_modules]
    for param_id, unit_index in owner.items():
        owned[unit_index].append(named[param_id])
    return owned


def _walk(module: nn.Module, prefix: str, unit_index: int, unit_of_module: dict[int, int],
          owner: dict[int, int], named: dict[int, tuple[str, nn.Parameter]],
          include_frozen: bool) -> None:
    unit_index = unit_of_module.get(id(module), unit_index)
    for name, param in module._parameters.items():
        if param is None or not (param.requires_grad or include_frozen):
            continue
        if id(param) in owner and owner[id(param)] != unit_index:
            owner[id(param)] = 0  # shared across units: the root keeps it gathered
        else:
            owner.setdefault(id(param), unit_index)
            named.setdefault(id(param), (prefix + name, param))
    for child_name, child in module._modules.items():
        if child is not None:
            _walk(child, f"{prefix}{child_name}.", unit_index, unit_of_module, owner, named,
                  include_frozen)


def build_units(model: nn.Module, config: UnitsConfig, *, num_parts: int, part_index: int,
                group_of: dict[int, int] | None = None,
                include_frozen: bool = False, inference: bool = False,
                device: torch.device | None = None) -> list[Unit]:
    """Split ``model`` into units with partition geometry; empty units are dropped.

    ``group_of`` maps parameter ids to parameter groups (absent: group 0); a module's
    parameters become one unit per group, frozen ones (``include_frozen``) last.
    ``inference``: the same units, every one frozen (no optimizer).
    ``device``: the units' compute device (None: where their parameters are).
    """
    unit_modules = find_unit_modules(model, config)
    owned = assign_params(model, unit_modules, include_frozen=include_frozen)
    units: list[Unit] = []
    for (name, module), params in zip(unit_modules, owned, strict=True):
        for group, group_params in _split_by_group(params, group_of or {}):
            unit = _make_unit(len(units), name, module, group_params, num_parts, part_index,
                              group)
            unit.compute_device = device
            units.append(unit)
    if inference:
        for unit in units:
            unit.group = None
    elif not any(unit.trainable for unit in units):
        raise ValueError("the model has no trainable parameters (requires_grad=True); "
                         "nothing to optimise")
    return units


def _split_by_group(params: NamedParams,
                    group_of: dict[int, int]) -> list[tuple[int | None, NamedParams]]:
    """The unit's parameters per group, in first-appearance order; frozen ones last."""
    split: dict[int | None, NamedParams] = {}
    for name, param in params:
        group = group_of.get(id(param), 0) if param.requires_grad else None
        split.setdefault(group, []).append((name, param))
    frozen = split.pop(None, None)
    return [*split.items(), *([(None, frozen)] if frozen else [])]


def _make_unit(index: int, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]],
               num_parts: int, part_index: int, group: int | None = 0) -> Unit:
    slots, offset = [], 0
    for param_name, param in params:
        slots.append(ParamSlot(name=param_name, param=param, offset=offset,
                               numel=param.numel(), shape=param.shape))
        offset += param.numel()
    padded = -(-offset // num_parts) * num_parts
    return Unit(index=index, name=name or "<root>", module=module, slots=slots, numel=offset,
                padded_numel=padded, part_numel=padded // num_parts, part_index=part_index,
                group=group)
