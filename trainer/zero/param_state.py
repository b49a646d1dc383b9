"""One parameter's share of the state ZeRO partitions: its fp32 master, its Adam moments
and its gradient, whole or this rank's fragment, found from the parameter alone.

These are DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` and kin (the facade
exposes them under those names, ``trainer.integrations.hf``), which its ZeRO guide uses to
inspect and edit partitioned state in a training loop. A unit keeps its parameters in
one flat buffer partitioned over the ranks (``trainer.zero.partition``): a parameter is
the span ``[offset, offset + numel)`` of it, and this rank's fragment is where that span
meets the rank's partition (empty where they do not meet; the whole parameter below
stage 1). The ``full`` calls are collective, as DeepSpeed's are: every rank calls them
with the same parameter. The ``local`` calls are not. A parameter no open training
engine manages, or a frozen one, has no such state: reads give None, writes do nothing.

Gradients exist from a window's first backward to the step that ends the window (None
before and after, as ``param.grad`` after ``zero_grad``). They are what the step uses
before clipping: the sum over the window's micro-batches, averaged over ranks, the loss
scale taken out, in fp32; under torch DDP with the loss divided by the accumulation
steps, ``param.grad``. Mid-window at stages 0-1 (where each rank sums its own until the
window ends) a read reduces a copy of the sums.

Gradients are written (``set_full_grad``, ``set_local_grad``) between the backward that
ends a window and ``engine.step()``, as in DeepSpeed: the step uses them, the clipping
norm included (a step begun speculatively on the old gradient is undone and run again).

Where this differs from DeepSpeed: a unit's optimizer step may run during the backward
that ends a window (when nothing global is needed first, ``ZeroOptimizer.eager``), so
masters and moments read between that backward and ``engine.step()`` may already be
the step's; and writes are refused there (``ParamStateTimingError``), where DeepSpeed
would let the step overwrite them. A gradient written there is refused too, naming
``zero_optimization.step_in_backward: false``, which makes the steps wait for
``engine.step()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from offloadd import moment_codec
from trainer.offload.backend import MOMENT_KINDS
from trainer.zero.engine import Engine
from trainer.zero.partition import ParamSlot, Unit
from trainer.zero.stages import AllReduceReducer


class ParamStateTimingError(RuntimeError):
    """A write to partitioned state between a window's last backward and its step."""


@dataclass(frozen=True)
class _Place:
    """Where one parameter's state lives, and this rank's fragment of it."""

    engine: Engine
    unit: Unit
    slot: ParamSlot
    part_start: int
    """The fragment's first element within this rank's partition."""
    param_start: int
    """The fragment's first element within the flattened parameter."""
    numel: int
    """The fragment's elements (0: this rank's partition holds none of the parameter)."""

    def fragment(self, part: torch.Tensor) -> torch.Tensor:
        """The fragment's view into a partition-sized tensor."""
        return part.narrow(0, self.part_start, self.numel)

    def whole(self, part: torch.Tensor) -> torch.Tensor:
        """The whole parameter, in its shape and fp32, on the compute device, from every
        rank's partition-sized ``part`` (collective where the unit is partitioned: each rank
        adds its fragment into zeros, so the sum is the fragments side by side)."""
        device = self.engine.collectives.device
        full = torch.zeros(self.slot.numel, dtype=torch.float32, device=device)
        full.narrow(0, self.param_start, self.numel).copy_(self.fragment(part))
        if self.engine.optimizer.partitioned:
            self.engine.collectives.all_reduce(full)
        return full.view(self.slot.shape)


def _place(param: torch.Tensor) -> _Place | None:
    link = getattr(param, "_zero_engine", None)
    engine: Engine | None = link() if link is not None else None
    if engine is None or engine.closed or engine.inference:
        return None
    unit: Unit = param._zero_unit  # type: ignore[attr-defined]
    if not unit.trainable:
        return None
    slot = next(slot for slot in unit.slots if slot.param is param)
    begin, end = unit.fragment_span(slot)
    if end == begin:  # this rank's partition holds none of the parameter
        return _Place(engine=engine, unit=unit, slot=slot, part_start=0, param_start=0,
                      numel=0)
    return _Place(engine=engine, unit=unit, slot=slot,
                  part_start=begin - unit.part_index * unit.part_numel,
                  param_start=begin - slot.offset, numel=end - begin)


def _check_key(key: str | None) -> None:
    if key is not None and key not in MOMENT_KINDS:
        raise ValueError(f"optimizer state key {key!r}: the optimizer keeps "
                         f"{' and '.join(MOMENT_KINDS)} per parameter")


def _state_part(place: _Place, key: str | None) -> torch.Tensor:
    """This rank's fp32 partition of the unit's master (``key`` None) or moment ``key``."""
    state = place.engine.backend.get_state(place.unit.index)
    return _decoded(state["master" if key is None else key], key, place.unit)


def _decoded(value: torch.Tensor, key: str | None, unit: Unit) -> torch.Tensor:
    """A master or moment partition in fp32: compact moments
    (``offload_optimizer.state_dtype``) decoded."""
    if value.dtype == torch.float32:
        return value
    return moment_codec.decode(value.cpu(), signed=key == "exp_avg", numel=unit.part_numel)


def _grad_part(place: _Place) -> torch.Tensor | None:
    """This rank's partition of the window's gradient as the step will use it (unclipped)."""
    engine, unit = place.engine, place.unit
    if engine.window_backwards == 0:
        return None
    own = (engine.reducer.local_sum(unit) if isinstance(engine.reducer, AllReduceReducer)
           else None)
    if own is not None:  # stages 0-1 mid-window: reduce a copy of this rank's sum
        total = own.clone()
        engine.collectives.all_reduce(total)
        part = unit.part_slice(total)
    else:
        part = engine.backend.read_grad(unit.index)
    return part.to(torch.float32) * engine.optimizer.base_grad_scale()


def _window_ended(engine: Engine) -> bool:
    """The backward that ends a window has run and ``engine.step()`` has not."""
    return (engine.window_backwards > engine.micro_steps % engine.gradient_accumulation_steps()
            and engine.is_gradient_accumulation_boundary())


def _fragment_of(place: _Place, value: torch.Tensor, *, whole: bool) -> torch.Tensor:
    """This rank's fragment of ``value`` (the whole parameter's values, or with ``whole``
    False the fragment's, any shape)."""
    fragment = _cut(place, value) if whole else value
    if fragment.numel() != place.numel:
        raise ValueError(f"the value has {fragment.numel()} elements; this rank's fragment "
                         f"of {place.slot.name} has {place.numel}")
    return fragment.reshape(-1)


def _write(place: _Place, key: str | None, value: torch.Tensor, *, whole: bool) -> None:
    """Put ``value`` (the whole parameter's values, or with ``whole`` False the fragment's,
    any shape) into this rank's partition of the master or moment ``key``; the
    training-dtype parameters follow a new master."""
    engine, unit = place.engine, place.unit
    if _window_ended(engine):
        raise ParamStateTimingError(
            "partitioned state was written between the backward that ends a window and "
            "engine.step(): the optimizer steps of that window may already be running. "
            "Write it before that backward or after engine.step()")
    fragment = _fragment_of(place, value, whole=whole)
    state = engine.backend.get_state(unit.index)  # copies
    state.pop("param", None)  # set_state derives it from the master
    name = "master" if key is None else key
    target = _decoded(state[name], key, unit)  # the other moment stays as stored
    place.fragment(target).copy_(fragment.to(target.device, torch.float32))
    state[name] = target
    engine.backend.set_state(unit.index, state)
    if key is None:  # the parameters in use follow the new master
        engine.placement.after_step(unit)


def _write_grad(place: _Place, value: torch.Tensor, *, whole: bool) -> None:
    """Make ``value`` (as ``_write`` takes it) the parameter's gradient of the window that
    ``engine.step()`` will end, in the form ``_grad_part`` reads (averaged over ranks, the
    loss scale out); this rank keeps its fragment."""
    engine, unit = place.engine, place.unit
    if not _window_ended(engine):
        raise ParamStateTimingError(
            f"the gradient of {place.slot.name} was written before the backward that ends "
            f"the gradient accumulation window: the window's gradient is complete only then. "
            f"Write it between that backward and engine.step()")
    if not engine.optimizer.grad_editable(unit.index):
        raise ParamStateTimingError(
            f"the gradient of {place.slot.name} was written after its unit's optimizer step "
            f"had begun: with no gradient_clipping and no fp16 loss scaling each unit's step "
            f"starts during the backward that ends the window. Set "
            f"zero_optimization.step_in_backward to false to replace gradients between "
            f"backward and engine.step()")
    fragment = _fragment_of(place, value, whole=whole)
    part = engine.backend.read_grad(unit.index).to(engine.collectives.device)
    scaled = fragment.to(part.device, torch.float32) / engine.optimizer.base_grad_scale()
    place.fragment(part).copy_(scaled)
    engine.optimizer.replace_grad(unit.index, part)


def _cut(place: _Place, value: torch.Tensor) -> torch.Tensor:
    """This rank's fragment of the whole parameter's ``value``."""
    if tuple(value.shape) != tuple(place.slot.shape) and value.numel() != place.slot.numel:
        raise ValueError(f"the value's shape {tuple(value.shape)} is not that of "
                         f"{place.slot.name}, {tuple(place.slot.shape)}")
    return value.reshape(-1).narrow(0, place.param_start, place.numel)


# ------------------------------------------------------------- whole parameter


def full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's fp32 master, whole (collective)."""
    place = _place(param)
    return None if place is None else place.whole(_state_part(place, None))


def full_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """The parameter's ``exp_avg`` or ``exp_avg_sq``, whole, in fp32 (collective)."""
    _check_key(key)
    place = _place(param)
    return None if place is None else place.whole(_state_part(place, key))


def full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's gradient of the open window, whole (collective; see the module)."""
    place = _place(param)
    part = None if place is None else _grad_part(place)
    return None if place is None or part is None else place.whole(part)


def set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give the parameter a new fp32 master (and training-dtype value); collective: every
    rank passes the whole value and keeps its fragment."""
    place = _place(param)
    if place is not None:
        _write(place, None, value, whole=True)


def set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace the parameter's gradient of the window, between the backward that ends it
    and ``engine.step()``: every rank passes the whole gradient (as ``full_grad`` gives
    it) and keeps its fragment; the step, its clipping norm included, uses it."""
    place = _place(param)
    if place is not None:
        _write_grad(place, value, whole=True)


def set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    """Give the parameter a new ``exp_avg`` or ``exp_avg_sq``; collective, as
    ``set_full_fp32_param``."""
    _check_key(key)
    place = _place(param)
    if place is not None:
        _write(place, key, value, whole=True)


# ------------------------------------------------------------ this rank's fragment


def local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment of the parameter's fp32 master (1-D)."""
    place = _place(param)
    return None if place is None else place.fragment(_state_part(place, None)).clone()


def local_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """This rank's fragment of the parameter's ``exp_avg`` or ``exp_avg_sq`` (1-D, fp32)."""
    _check_key(key)
    place = _place(param)
    return None if place is None else place.fragment(_state_part(place, key)).clone()


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment of the open window's gradient (1-D; collective mid-window at
    stages 0-1 only, where reading it reduces the ranks' sums)."""
    place = _place(param)
    part = None if place is None else _grad_part(place)
    return None if place is None or part is None else place.fragment(part).clone()


def set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's fragment of the parameter's gradient of the window (as
    ``local_grad`` gives it), between the backward that ends it and ``engine.step()``."""
    place = _place(param)
    if place is not None:
        _write_grad(place, value, whole=False)


def set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's fragment of the parameter's fp32 master (and, at stages 0-2, the
    replicated parameters: collective there, every rank calling)."""
    place = _place(param)
    if place is not None:
        _write(place, None, value, whole=False)


def set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    """Write this rank's fragment of the parameter's ``exp_avg`` or ``exp_avg_sq`` (and, as
    ``set_local_fp32_param``, collective at stages 0-2)."""
    _check_key(key)
    place = _place(param)
    if place is not None:
        _write(place, key, value, whole=False)


DEEPSPEED_NAMES = {
    "safe_get_full_fp32_param": full_fp32_param,
    "safe_get_full_optimizer_state": full_optimizer_state,
    "safe_get_full_grad": full_grad,
    "safe_set_full_fp32_param": set_full_fp32_param,
    "safe_set_full_grad": set_full_grad,
    "safe_set_full_optimizer_state": set_full_optimizer_state,
    "safe_get_local_fp32_param": local_fp32_param,
    "safe_get_local_optimizer_state": local_optimizer_state,
    "safe_get_local_grad": local_grad,
    "safe_set_local_fp32_param": set_local_fp32_param,
    "safe_set_local_grad": set_local_grad,
    "safe_set_local_optimizer_state": set_local_optimizer_state,
}
"""``deepspeed.utils``' names for these (the facade registers them; same arguments)."""
