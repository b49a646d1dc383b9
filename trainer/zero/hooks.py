"""Module and autograd hooks that tell the engine where each unit is in forward/backward.

- forward pre/post hooks on each unit's module (stage 3 gathers and frees);
- a pre-backward hook: the unit's forward outputs pass through an identity
  autograd Function whose backward fires before the unit's own backward ops
  (stage 3 re-gathers there; the saved tensors are the parameters themselves,
  so restoring ``param.data`` restores what autograd will read);
- a post-backward hook: ``register_post_accumulate_grad_hook`` counts the
  unit's parameters whose gradient is final; the last one triggers the
  unit's gradient reduction. Units with unused parameters never reach the
  count and are finished by ``finish_backward`` in unit order (the engine's
  ``ReduceOrder`` then launches reductions in one order on every rank). A unit
  whose parameters meet more than one backward waits for ``finish_backward`` too
  (*deferred*): one applied repeatedly under reentrant checkpoints (each application
  runs under ``no_grad`` and gets a backward of its own), and an owner of parameters
  other units read (``start_backward(also_defer=...)``: a reentrant recompute of the
  reader adds to them in the reader's own backward);
- a frozen unit (stage 3) has no gradients to count: its forward inputs pass
  through an identity Function whose backward fires once the unit's backward
  has produced the inputs' gradients, which is when its gathered parameters
  can go (the engine frees the rest at the end of backward).

The forward hooks run the engine's callbacks outside ``torch.inference_mode``
(``outside_inference_mode``): a forward under it (Lightning validates so on NCCL,
``generate`` and serving code run so) would otherwise allocate partition and
gather buffers as inference tensors, which the copy engine's worker thread, and
every later training step, may not write.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from trainer.zero.partition import Unit

UnitCallback = Callable[[Unit], None]
PostForward = Callable[[Unit, bool], None]
"""Called after a unit's forward with whether its backward will be signalled
(``pre_backward``): False when grad is on and its output holds no tensor to route."""


def outside_inference_mode() -> contextlib.AbstractContextManager[Any]:
    """Leave ``torch.inference_mode`` (without enabling grad) for the engine's own work:
    buffers it allocates there outlive the pass and are written outside it."""
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))  # turns grad on: off again below
    stack.enter_context(torch.no_grad())
    return stack


def _outside_inference_mode(callback: UnitCallback, unit: Unit) -> None:
    with outside_inference_mode():
        callback(unit)


class _BackwardCallback(torch.autograd.Function):
    """Identity on some tensors whose backward runs a callback first.

    On a unit's outputs it fires as the unit's backward starts; on its inputs,
    once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        return tuple(tensor.detach() for tensor in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.callback()
        return (None, *grads)


def _tensors_needing_grad(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_needing_grad(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_needing_grad(item)
    elif _is_record(value):
        for item in vars(value).values():
            yield from _tensors_needing_grad(item)


def _opaque(value: Any) -> bool:
    """``value`` holds something ``_tensors_needing_grad`` cannot look into."""
    if isinstance(value, (torch.Tensor, int, float, complex, str, bytes, type(None))):
        return False
    if isinstance(value, (list, tuple)):
        return any(_opaque(item) for item in value)
    if isinstance(value, dict):
        return any(_opaque(item) for item in value.values())
    if _is_record(value):
        return any(_opaque(item) for item in vars(value).values())
    return True


def _is_record(value: Any) -> bool:
    """A dataclass instance or a ``SimpleNamespace``: outputs of plain torch models
    (``SimpleNamespace(loss=..., logits=...)``) as HF's ``ModelOutput`` is a dict."""
    record = ((dataclasses.is_dataclass(value) and not isinstance(value, type))
              or isinstance(value, types.SimpleNamespace))
    return record and hasattr(value, "__dict__")  # not a slotted dataclass


def _replace(value: Any, swap: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return swap.get(id(value), value)
    if isinstance(value, tuple):
        items = [_replace(item, swap) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_replace(item, swap) for item in value]
    if isinstance(value, dict):
        for key in list(value):  # in place: keeps dict subclasses (HF ModelOutput) intact
            value[key] = _replace(value[key], swap)
    elif _is_record(value):
        value = copy.copy(value)  # a copy: a caller's input record is left as it was
        for name, item in vars(value).items():
            object.__setattr__(value, name, _replace(item, swap))  # frozen dataclasses too
    return value


def attach_pre_backward(output: Any, callback: Callable[[], None]) -> tuple[Any, bool]:
    """``output`` with its grad-requiring tensors routed through ``_BackwardCallback``, and
    whether ``callback`` will be called when a backward starts there: under grad, not
    when every tensor hides in objects of the model's own (one beside a tensor in sight,
    an HF output's cache object, does not matter)."""
    if not torch.is_grad_enabled():
        return output, True  # no backward follows
    tensors = list(_tensors_needing_grad(output))
    if not tensors:
        return output, not _opaque(output)
    routed = _BackwardCallback.apply(callback, *tensors)
    swap = {id(old): new for old, new in zip(tensors, routed, strict=True)}
    return _replace(output, swap), True


def attach_post_backward(args: Any, kwargs: Any,
                         callback: Callable[[], None]) -> tuple[Any, Any] | None:
    """``(args, kwargs)`` with grad-requiring tensors routed through ``_BackwardCallback``."""
    tensors = list(_tensors_needing_grad((args, kwargs)))
    if not tensors or not torch.is_grad_enabled():
        return None
    routed = _BackwardCallback.apply(callback, *tensors)
    swap = {id(old): new for old, new in zip(tensors, routed, strict=True)}
    return _replace(tuple(args), swap), _replace(dict(kwargs), swap)


class _EagerHook:
    """A forward hook that runs eagerly, never traced by ``torch.compile``.

    A unit compiled in place (``engine.compile``, Accelerate's regional
    ``module.compile()``) calls its hooks inside the compiled ``_call_impl``; traced there,
    the gather's swap of the parameters' storage was lost and the graph ran on the
    released, empty parameters. Behind ``torch._dynamo.disable``, dynamo breaks the graph
    at the hook, runs it as Python and compiles the forward around it. The wrapper is made
    only once dynamo is loaded (``UnitHooks.follow_dynamo``): importing it takes ~70 MB and
    a second, which a run that never compiles should not pay at ``initialize``."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook
        self._call = hook

    def disable_tracing(self) -> None:
        self._call = torch._dynamo.disable(self.hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


class LateGradientError(RuntimeError):
    """A parameter's gradient arrived after its unit's gradients were reduced."""


class UnitHooks:
    """Installs the hooks and turns them into per-unit callbacks."""

    def __init__(self, units: list[Unit], *, on_grads_ready: UnitCallback,
                 on_frozen_backward_done: UnitCallback | None = None) -> None:
        self.units = units
        self.trainable = [unit for unit in units if unit.trainable]
        self.on_grads_ready = on_grads_ready
        self.on_frozen_backward_done = on_frozen_backward_done
        self._waiting: dict[int, set[int]] = {}
        """Trainable unit index -> ids of its parameters whose gradient is not final yet,
        in the backward running now. A set, not a count: a parameter may accumulate twice
        in one backward (a reentrant activation checkpoint runs a backward of its own)."""
        self._fired: set[int] = set()
        """Units whose gradients were handed on in the backward running now."""
        self._handles: list[RemovableHandle] = []
        self._eager_hooks: list[_EagerHook] = []
        """Forward hooks not yet kept out of dynamo's tracing (``follow_dynamo``)."""
        self._forwards: dict[int, list[int]] = {}
        """Trainable unit index -> its forwards in training passes since the last backward,
        [under no_grad (each a reentrant checkpoint's: a backward of its own), under grad]."""
        self._deferred: set[int] = set()
        """Units whose gradients are handed on at ``finish_backward`` in this backward."""
        self._in_backward = False
        self._counting = True
        """The engine's current pass trains (``begin_pass``): its forwards are counted."""
        for unit in self.trainable:
            for slot in unit.slots:
                self._handles.append(slot.param.register_post_accumulate_grad_hook(
                    self._grad_hook(unit)))
            self._handles.append(unit.module.register_forward_pre_hook(self._eager(
                lambda _module, _args, index=unit.index: self._count_forward(index))))

    def _count_forward(self, index: int) -> None:
        if self._counting and not self._in_backward:  # a recompute is not counted
            self._forwards.setdefault(index, [0, 0])[torch.is_grad_enabled()] += 1

    def begin_pass(self, *, trains: bool) -> None:
        """The engine's forward starts; a pass that does not train (an evaluation under
        ``no_grad``) is not counted. (No backward runs now: one that raised did not
        finish.)"""
        self._counting = trains
        self._in_backward = False

    def install_forward(self, *, pre_forward: UnitCallback, post_forward: PostForward,
                        pre_backward: UnitCallback) -> None:
        """Forward/pre-backward hooks (only stage 3 needs them), each an ``_EagerHook``."""
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(self._eager(
                lambda _module, _args, unit=unit: _outside_inference_mode(pre_forward, unit))))
            self._handles.append(unit.module.register_forward_hook(self._eager(
                self._post_forward_hook(unit, post_forward, pre_backward))))
            if not unit.trainable and self.on_frozen_backward_done is not None:
                done = self.on_frozen_backward_done
                self._handles.append(unit.module.register_forward_pre_hook(self._eager(
                    lambda _module, args, kwargs, unit=unit, done=done: attach_post_backward(
                        args, kwargs, lambda: done(unit))), with_kwargs=True))

    def _eager(self, hook: Callable[..., Any]) -> _EagerHook:
        eager = _EagerHook(hook)
        self._eager_hooks.append(eager)
        return eager

    def follow_dynamo(self) -> None:
        """Keep the forward hooks out of ``torch.compile``'s graphs once dynamo is loaded
        (``_EagerHook``); called before each forward, outside any compiled code."""
        if self._eager_hooks and "torch._dynamo" in sys.modules:
            for hook in self._eager_hooks:
                hook.disable_tracing()
            self._eager_hooks.clear()

    def start_backward(self, also_defer: Iterable[int] = ()) -> None:
        """Arm the post-backward counters for one backward pass; the units in
        ``also_defer`` hand their gradients on at ``finish_backward`` (see the module)."""
        self._waiting = {unit.index: {id(slot.param) for slot in unit.slots}
                         for unit in self.trainable}
        self._fired = set()
        # backwards a unit's parameters meet: one per reentrant application, one for the rest
        self._deferred = {index for index, (apart, inline) in self._forwards.items()
                          if apart + min(inline, 1) > 1}
        self._deferred.update(also_defer)
        self._in_backward = True

    def finish_backward(self) -> None:
        """Fire the post-backward callback of every unit that has not fired yet."""
        self._in_backward = False
        self._forwards.clear()
        for unit in self.trainable:
            if self._waiting.pop(unit.index, None) is not None:
                self.on_grads_ready(unit)
        self._fired = set()  # a backward outside the engine's is not checked
        self._deferred = set()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _grad_hook(self, unit: Unit) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            pending = self._waiting.get(unit.index)
            if pending is None:
                if unit.index in self._fired:
                    raise LateGradientError(
                        f"a parameter of unit {unit.index} ({unit.name}) got more gradient "
                        f"after the unit's gradients were reduced in this backward: a "
                        f"reentrant activation checkpoint (torch's use_reentrant=True, "
                        f"deepspeed.checkpointing.checkpoint) recomputes a block that reads "
                        f"this unit's parameter, in a backward of its own (stage 3 finds such "
                        f"reads; stages 0-2 do not). Checkpoint that block non-reentrantly "
                        f"(use_reentrant=False, deepspeed.checkpointing."
                        f"non_reentrant_checkpoint), or put the block and the parameter in "
                        f"one unit (units.module_classes)")
                return
            pending.discard(id(_param))
            if pending or unit.index in self._deferred:
                return
            del self._waiting[unit.index]
            self._fired.add(unit.index)
            self.on_grads_ready(unit)
        return hook

    @staticmethod
    def _post_forward_hook(unit: Unit, post_forward: PostForward,
                           pre_backward: UnitCallback) -> Callable[..., Any]:
        def hook(_module: Any, _args: Any, output: Any) -> Any:
            routed, signalled = attach_pre_backward(output, lambda: pre_backward(unit))
            with outside_inference_mode():
                post_forward(unit, signalled)
            return routed
        return hook
