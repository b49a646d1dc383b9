"""Parameters a unit's forward uses that another unit owns (DeepSpeed's external parameters).

Under stage 3 a unit's parameters are valid only while the unit is gathered. A forward
that reads a parameter of another unit after that unit was released (the parent that
reuses a child's weight after the child ran, as DeepSpeed's ZeRO-3 tutorial shows; a
block that reads a later block's weight; a module whose parameter only others use)
would see an empty tensor, and fail with a shape error or only once
``stage3_max_live_parameters`` forces the release, at scale.

As DeepSpeed (since 0.3.15) does, such uses are found as they happen: every module that
holds a unit's parameter reads it through ``_WatchedParameters``, its ``_parameters``,
which reports a read of a parameter whose storage is released. Inside a unit's forward
(or an activation-checkpoint recompute) the owning unit is gathered there and then, and
the use is remembered, so from then on the owner is gathered when the using unit starts
its forward and stays gathered until that forward ends, and is gathered again when the
using unit's backward starts (its backward ops read the same parameters).
``register_external_parameter(module, param)`` declares a use before it happens
(DeepSpeed's name and arguments); ``unregister_external_parameter`` forgets it.

An owner gathered for such a use stays gathered until its own release point: its
gradient is final only after every use's backward, so a trainable owner is released
when its gradients are ready (as any unit); a frozen one at the end of backward; after a
forward that builds no graph (evaluation), at the end of that forward. Reads outside the
engine's forward see the released parameter, as in DeepSpeed: gather it with
``zero.GatheredParameters`` there.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trainer.zero.partition import Unit

_REGISTERED = "_offloadd_external_params"
"""A module's attribute: the parameters its forward is declared to use
(``register_external_parameter``)."""

UnitCallback = Callable[[Unit], None]


class _WatchedParameters(dict[str, Any]):
    """A module's ``_parameters`` that reports every read of a released parameter
    (``nn.Module.__getattr__`` reads parameters by subscript)."""

    __slots__ = ("on_released",)

    def __init__(self, items: dict[str, Any], on_released: Callable[[nn.Parameter], None]
                 ) -> None:
        super().__init__(items)
        self.on_released = on_released

    def __getitem__(self, name: str) -> Any:
        param = dict.__getitem__(self, name)
        if param is not None and param.numel() == 0:
            self.on_released(param)
        return param

    def __reduce__(self) -> Any:
        # pickle and copy.deepcopy of the module see a plain dict, not the engine
        return dict, (dict(self),)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another unit owns: it is
    gathered whenever ``module``'s unit starts its forward or backward (DeepSpeed's
    ``deepspeed.zero.register_external_parameter``; such uses are also found on their own,
    this only saves the first pass its on-demand gather)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be a torch.nn.Module, "
                        f"got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter: parameter must be a "
                        f"torch.nn.Parameter, got {type(parameter).__name__}")
    registered: dict[int, nn.Parameter] = module.__dict__.setdefault(_REGISTERED, {})
    registered[id(parameter)] = parameter
    engine = _engine_of(parameter)
    if engine is not None and engine.external is not None:
        engine.external.declare(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Forget ``register_external_parameter(module, parameter)`` (a use seen in a forward
    is found again when it happens)."""
    registered: dict[int, nn.Parameter] = module.__dict__.get(_REGISTERED, {})
    if registered.pop(id(parameter), None) is None:
        raise ValueError("unregister_external_parameter: this parameter was not registered "
                         "as external to this module (register_external_parameter)")
    engine = _engine_of(parameter)
    if engine is not None and engine.external is not None:
        engine.external.forget(module, parameter)


def external_parameters(module: nn.Module) -> list[tuple[int, nn.Parameter]]:
    """DeepSpeed's ``module.ds_external_parameters()`` (every module of a stage-3 model has
    it): the parameters declared used by ``module``'s forward (``register_external_parameter``),
    as (id, parameter) pairs. TRL lists them beside a model's own parameters."""
    return list(module.__dict__.get(_REGISTERED, {}).items())


def _engine_of(parameter: nn.Parameter) -> Any:
    ref = getattr(parameter, "_zero_engine", None)
    return ref() if ref is not None else None


class ExternalParams:
    """Finds, remembers and gathers the units whose parameters other units' forwards use.

    ``gather(unit)`` makes a unit's parameters valid (taking it out of the held set);
    ``release(unit)`` drops them. The engine calls ``enter``/``leave`` from each unit's
    forward hooks, ``before_backward`` from its pre-backward hook."""

    def __init__(self, model: nn.Module, units: list[Unit], *, gather: UnitCallback,
                 release: UnitCallback, is_ready: Callable[[Unit], bool]) -> None:
        self.units = units
        self._gather = gather
        self._release = release
        self._is_ready = is_ready
        self._owner = {id(slot.param): unit for unit in units for slot in unit.slots}
        self._user_of_module = _innermost_units(model, units)
        self.uses: dict[int, dict[int, None]] = {}
        """Using unit's index -> owning units' indices (ordered sets)."""
        self._declared: dict[tuple[int, int], int] = {}
        """(module id, parameter id) -> owner index, of ``register_external_parameter``."""
        self.stack: list[Unit] = []
        """The units whose forward runs now, innermost last."""
        self.gathered: dict[int, Unit] = {}
        """Owners gathered for a use in the current pass."""
        self._watched: list[nn.Module] = []
        """Modules whose ``_parameters`` are ``_WatchedParameters`` (``unwatch`` undoes it)."""
        self._eager = False
        """The watch runs outside dynamo's tracing (``follow_dynamo``)."""
        self.num_found = 0
        """Uses found by a read of a released parameter (each gathers on demand once)."""
        self._watch(model)
        self._described = list(model.modules())
        for module in self._described:
            for param in module.__dict__.get(_REGISTERED, {}).values():
                self.declare(module, param)
            module.__dict__["ds_external_parameters"] = functools.partial(external_parameters,
                                                                         module)

    def _watch(self, model: nn.Module) -> None:
        callback = _weak_method(self._on_released)
        for module in model.modules():
            params = module.__dict__["_parameters"]
            if isinstance(params, _WatchedParameters) or not any(
                    id(param) in self._owner for param in params.values() if param is not None):
                continue
            module.__dict__["_parameters"] = _WatchedParameters(params, callback)
            self._watched.append(module)

    def follow_dynamo(self) -> None:
        """Once dynamo is loaded: a read traced inside a compiled unit calls the watch
        eagerly (``torch._dynamo.disable``: the graph breaks there), as the unit hooks do
        (``trainer.zero.hooks._EagerHook``); traced, the on-demand gather became part of
        the graph, which then ran on the parameter's released shape."""
        if self._eager or "torch._dynamo" not in sys.modules:
            return
        self._eager = True
        for module in self._watched:
            params = module.__dict__["_parameters"]
            if isinstance(params, _WatchedParameters):
                params.on_released = torch._dynamo.disable(params.on_released)

    def unwatch(self) -> None:
        """Give the modules plain ``_parameters`` back (the engine is closing)."""
        for module in self._watched:
            current = module.__dict__["_parameters"]
            if isinstance(current, _WatchedParameters):
                module.__dict__["_parameters"] = dict(current)
        self._watched.clear()
        for module in self._described:
            module.__dict__.pop("ds_external_parameters", None)
        self._described.clear()

    # ------------------------------------------------------------- declared uses

    def declare(self, module: nn.Module, param: nn.Parameter) -> None:
        owner = self._owner.get(id(param))
        user = self._user_of_module.get(id(module))
        if owner is None or user is None or owner.index == user.index:
            return  # not a unit's parameter, not this model's module, or its own
        self._declared[(id(module), id(param))] = owner.index
        self.uses.setdefault(user.index, {})[owner.index] = None

    def forget(self, module: nn.Module, param: nn.Parameter) -> None:
        owner_index = self._declared.pop((id(module), id(param)), None)
        user = self._user_of_module.get(id(module))
        if owner_index is not None and user is not None:
            self.uses.get(user.index, {}).pop(owner_index, None)

    # ------------------------------------------------------------------ the pass

    def begin_pass(self) -> None:
        self.stack.clear()
        self.gathered.clear()

    def enter(self, unit: Unit) -> None:
        """``unit``'s forward starts: gather what it is known to use."""
        self.stack.append(unit)
        self._gather_owners(self.uses.get(unit.index, ()))

    def leave(self, unit: Unit, *, pass_ends_without_backward: bool) -> None:
        # A module split into several units (parameter groups) ends their forwards in the
        # order it began them: the first to leave is not the innermost.
        for position in range(len(self.stack) - 1, -1, -1):
            if self.stack[position] is unit:
                del self.stack[position]
                break
        if pass_ends_without_backward and not self.stack:
            for owner in self.gathered.values():
                self._release(owner)
            self.gathered.clear()

    def owners(self) -> set[int]:
        """Indices of the units whose parameters other units' forwards use."""
        return {owner for owners in self.uses.values() for owner in owners}

    def in_use(self, unit: Unit) -> bool:
        """A unit whose forward runs now uses ``unit``'s parameters: keep them gathered
        past ``unit``'s own forward (DeepSpeed's external parameters stay gathered for
        the forward of the module that declared them)."""
        return any(unit.index in self.uses.get(user.index, ()) for user in self.stack)

    def before_backward(self, unit: Unit, done: Iterable[int]) -> None:
        """``unit``'s backward starts: its ops read what its forward used. Owners whose
        gradients are final (``done``) had every use's backward run already."""
        finished = set(done)
        self._gather_owners(index for index in self.uses.get(unit.index, ())
                            if index not in finished)

    def _gather_owners(self, indices: Iterable[int]) -> None:
        for index in list(indices):
            owner = self.units[index]
            self._gather(owner)
            self.gathered[index] = owner

    def _on_released(self, param: nn.Parameter) -> None:
        owner = self._owner.get(id(param))
        if owner is None or not self.stack or self._is_ready(owner):
            return  # not ours, read outside a forward, or an empty parameter by shape
        user = self.stack[-1]
        self.num_found += 1
        self.uses.setdefault(user.index, {})[owner.index] = None
        self._gather_owners((owner.index,))


def _innermost_units(model: nn.Module, units: list[Unit]) -> dict[int, Unit]:
    """Module id -> the unit whose forward runs that module's (its own unit, else its
    nearest ancestor's; the first of a module's units when it has several)."""
    first: dict[int, Unit] = {}
    for unit in units:
        first.setdefault(id(unit.module), unit)
    result: dict[int, Unit] = {}

    def walk(module: nn.Module, current: Unit | None) -> None:
        current = first.get(id(module), current)
        if id(module) in result:
            return
        if current is not None:
            result[id(module)] = current
        for child in module.children():
            walk(child, current)

    walk(model, first.get(id(model)))
    return result


def _weak_method(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """``method`` without a strong reference to its object: a module outliving its engine
    does not keep the engine alive."""
    ref = weakref.WeakMethod(method)

    def call(param: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)
    return call
