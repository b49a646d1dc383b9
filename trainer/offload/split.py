"""Twin-Flow: part of the optimizer state stays on the compute device, the rest is offloaded.

DeepSpeed's ZeRO-Offload++ ``zero_optimization.offload_optimizer.ratio`` is the fraction
of the optimizer state that is offloaded; the rest is updated on the GPU, so the GPU
steps its share while the CPU steps the rest. ``SplitBackend`` routes each unit to one of
two backends: an ``InProcessBackend`` (state and Adam on the compute device, synchronous)
for the *device units*, the daemon's backend for the others.

Which units stay on the device (``device_units``): the trainable units with the lowest
indices (forward order, ``trainer.zero.partition.build_units``), taken while their
partitions' elements add up to at most ``(1 - ratio)`` of all trainable partitions'
elements. They are the units whose gradients reach the optimizer last in backward (the
daemon is already stepping the others meanwhile) and whose parameters the next forward
needs first (no wait for a daemon step or a host copy there). Frozen units always go to
the daemon backend. The choice depends only on unit sizes and ratio, so every rank makes
the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

from trainer.device.compute import free_memory_nbytes
from trainer.offload.backend import (
    STATE_KINDS,
    AdamHyper,
    InProcessBackend,
    StateBackend,
    StepHandle,
    UnitSpec,
)

if TYPE_CHECKING:
    from trainer.dist.collectives import Collectives
    from trainer.offload.backend import StepRedo
    from trainer.offload.daemon_backend import DaemonBackend

FP32_STATE_TENSORS = len(STATE_KINDS)
"""fp32 tensors a device unit keeps per partition element: master and both moments (its
gradient is kept in the unit's ``grad_dtype``)."""


def device_units(specs: list[UnitSpec], ratio: float) -> frozenset[int]:
    """The units whose optimizer state stays on the compute device (see module docstring)."""
    trainable = [spec for spec in specs if spec.trainable]
    room_numel = (1.0 - ratio) * sum(spec.part_numel for spec in trainable)
    chosen: list[int] = []
    taken_numel = 0
    for spec in sorted(trainable, key=lambda spec: spec.index):
        if taken_numel + spec.part_numel > room_numel:
            break
        taken_numel += spec.part_numel
        chosen.append(spec.index)
    return frozenset(chosen)


def device_state_nbytes(spec: UnitSpec) -> int:
    """A device unit's state: the optimizer's tensors and its parameters in the training
    dtype."""
    return optimizer_state_nbytes(spec) + spec.part_numel * spec.param_dtype.itemsize


def optimizer_state_nbytes(spec: UnitSpec) -> int:
    """A device unit's optimizer state: the fp32 master and moments and its gradient."""
    return spec.part_numel * (4 * FP32_STATE_TENSORS + spec.grad_dtype.itemsize)


def check_device_room(specs: list[UnitSpec], chosen: frozenset[int], ratio: float | str,
                      free_nbytes: int | None, device: torch.device) -> None:
    """Refuse, naming the ratio that fits, a split whose device state alone exceeds the
    device's free memory (None: unbounded, as the host): a GPU would fail on it with an
    out-of-memory deep inside ``initialize``."""
    needed = sum(device_state_nbytes(spec) for spec in specs if spec.index in chosen)
    if free_nbytes is None or needed <= free_nbytes:
        return
    total = sum(device_state_nbytes(spec) for spec in specs if spec.trainable)
    # The suggestion keeps the state within half the free memory: the other half is for
    # the activations and gathered parameters, which no one knows before a step ran.
    fitting = math.ceil(100 * (1.0 - free_nbytes / 2 / total)) / 100
    raise ValueError(
        f"zero_optimization.offload_optimizer.ratio={ratio} keeps {needed / 2**20:.3f} MiB "
        f"of optimizer state on {device}, which has {free_nbytes / 2**20:.3f} MiB free: "
        f"set the ratio to at least {min(1.0, fitting)} (the fraction offloaded; 1.0 "
        "offloads all of it), which keeps it within half the free memory")


def _compute_marker(device: torch.device) -> Any:
    """An event after the work queued so far on the current (compute) stream; None off
    CUDA, where every op but the copy engine's copies runs at issue."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class SplitBackend(StateBackend):
    """Device units in an ``InProcessBackend``, the others in ``offloaded`` (the daemon's)."""

    def __init__(self, offloaded: DaemonBackend, *, ratio: float | Literal["auto"],
                 on_device: StateBackend | None = None,
                 collectives: Collectives | None = None) -> None:
        self.offloaded = offloaded
        """The daemon backend: frozen units and the offloaded ``ratio`` of the state."""
        self.on_device = on_device or InProcessBackend()
        """The device units' state, as torch tensors on the compute device."""
        self.ratio = ratio
        """"auto": every unit starts offloaded; after the first accumulation window the
        first units that fit the device memory it left free move to the device
        (``_take_device_room``)."""
        self._collectives = collectives
        """Where the ranks agree on the room for "auto" (None: one rank)."""
        self._auto_pending = ratio == "auto"
        self.device_units: frozenset[int] = frozenset()
        """Indices of the units held by ``on_device`` (decided in ``plan``)."""
        self._planned = False
        self._planned_specs: list[UnitSpec] = []
        self._specs: dict[int, UnitSpec] = {}
        self._device: torch.device | None = None
        """The compute device (where the device units' masters were registered)."""
        self._params: dict[int, torch.Tensor] = {}
        """Device units' parameter partitions in the training dtype, what stage 3 gathers
        from (``lease_params``); re-derived from the master at the first lease after a
        step."""
        self._stale: dict[int, Any] = {}
        """Device units whose ``_params`` copy predates the master, with the compute-stream
        event after the master's last change (None off CUDA)."""

    @property
    def copies(self) -> Any:
        """The offloaded side's copy engine: stage 3 issues its gathers through it."""
        return getattr(self.offloaded, "copies", None)

    @property
    def undo_budget_nbytes(self) -> int:  # type: ignore[override]
        """Only daemon units step off the rank, so only they take undoable steps."""
        return self.offloaded.undo_budget_nbytes

    def _owner(self, unit: int) -> StateBackend:
        return self.on_device if unit in self.device_units else self.offloaded

    def _changed(self, unit: int) -> None:
        """The device unit's master changed: its parameter copy is stale."""
        assert self._device is not None
        self._stale[unit] = _compute_marker(self._device)

    # ------------------------------------------------------------------ setup

    def plan(self, specs: list[UnitSpec]) -> None:
        self.device_units = (frozenset() if self.ratio == "auto"
                             else device_units(specs, self.ratio))
        self._planned = True
        self._planned_specs = specs
        self.on_device.plan([spec for spec in specs if spec.index in self.device_units])
        self.offloaded.plan([spec for spec in specs if spec.index not in self.device_units])

    def register(self, spec: UnitSpec, master: torch.Tensor) -> None:
        assert self._planned, "the engine plans every unit before registering one"
        self._specs[spec.index] = spec
        if spec.index in self.device_units:
            if self._device is None:
                check_device_room(self._planned_specs, self.device_units, self.ratio,
                                  free_memory_nbytes(master.device), master.device)
            self._device = master.device
            self._stale[spec.index] = None
        self._owner(spec.index).register(spec, master)

    def part_numel(self, unit: int) -> int:
        return self._specs[unit].part_numel

    def param_dtype(self, unit: int) -> torch.dtype:
        return self._specs[unit].param_dtype

    # ----------------------------------------------------------- grads, steps

    def accumulate_grad(self, unit: int, grad: torch.Tensor, *, first: bool,
                        want_sq_norm: bool, last: bool = True) -> torch.Tensor | None:
        return self._owner(unit).accumulate_grad(unit, grad, first=first,
                                                 want_sq_norm=want_sq_norm, last=last)

    def read_grad(self, unit: int) -> torch.Tensor:
        return self._owner(unit).read_grad(unit)

    def step_async(self, unit: int, *, step: int, hyper: AdamHyper, grad_scale: float,
                   undoable: bool = False) -> StepHandle:
        handle = self._owner(unit).step_async(unit, step=step, hyper=hyper,
                                              grad_scale=grad_scale, undoable=undoable)
        if unit in self.device_units:
            self._changed(unit)
        return handle

    def step_runs_async(self, unit: int) -> bool:
        return self._owner(unit).step_runs_async(unit)

    def undo_nbytes(self, unit: int) -> int:
        return self._owner(unit).undo_nbytes(unit)

    def prepare_undo(self, unit: int) -> bool:
        return self._owner(unit).prepare_undo(unit)

    def steps_behind(self, units: list[int]) -> int:
        return self.offloaded.steps_behind([unit for unit in units
                                            if unit not in self.device_units])

    def commit_step(self, unit: int) -> None:
        self._owner(unit).commit_step(unit)

    def revert_step(self, unit: int, redo: StepRedo | None) -> StepHandle:
        handle = self._owner(unit).revert_step(unit, redo)
        if unit in self.device_units:
            self._changed(unit)
        return handle

    def wait_steps(self) -> None:
        self.on_device.wait_steps()
        self.offloaded.wait_steps()

    def begin_step(self) -> None:
        self.offloaded.begin_step()

    def end_window(self) -> None:
        self.offloaded.end_window()
        if self._auto_pending:
            self._auto_pending = False
            self._take_device_room()

    def _take_device_room(self) -> None:
        """``ratio: "auto"``: the device memory the first window left free beyond the
        running sums' room (the smallest on any rank, so every rank makes the same
        split) takes the first trainable units' state, in forward order, as a ratio
        would; each unit's state moves over as it is, after its step finished."""
        lent = room = self.offloaded.lend_device_room()
        if self._collectives is not None and self._collectives.world_size > 1:
            room = min(self._collectives.all_gather_object(lent))
        taken = 0
        for spec in sorted(self._planned_specs, key=lambda spec: spec.index):
            if not spec.trainable:
                continue
            if taken + device_state_nbytes(spec) > room:
                break
            taken += device_state_nbytes(spec)
            self._move_to_device(spec)
        self.offloaded.device_sum_room_nbytes += lent - taken  # the rest: the sums' again

    def _move_to_device(self, spec: UnitSpec) -> None:
        state = self.offloaded.hand_over(spec.index)
        device = self.copies.device
        self.on_device.register(spec, state["master"].to(device))
        self.on_device.set_state(spec.index, state)
        self.device_units = self.device_units | {spec.index}
        self._device = device
        self._stale[spec.index] = None

    # -------------------------------------------------------------- parameters

    def read_params(self, unit: int, out: torch.Tensor) -> None:
        self._owner(unit).read_params(unit, out)

    def host_params(self, unit: int) -> torch.Tensor:
        return self._owner(unit).host_params(unit)

    def lease_params(self, unit: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A device unit's partition on the compute device, never through host memory.

        Hazard: stage 3 leases inside ``CopyEngine.ahead_of_compute``, on CUDA on the copy
        stream, while the master was last written by Adam on the compute stream: the
        copy stream waits for that step's event before re-deriving the partition."""
        if unit not in self.device_units:
            return self.offloaded.lease_params(unit)
        part = self._params.get(unit)
        if part is None:
            assert self._device is not None
            part = torch.empty(self._specs[unit].part_numel,
                               dtype=self._specs[unit].param_dtype, device=self._device)
            self._params[unit] = part
        if unit in self._stale:
            marker = self._stale.pop(unit)
            if marker is not None:
                torch.cuda.current_stream(part.device).wait_event(marker)
            self.on_device.read_params(unit, part)
        return part, _nothing

    def prefetch_params(self, units: list[int]) -> None:
        offloaded = [unit for unit in units if unit not in self.device_units]
        if offloaded:
            self.offloaded.prefetch_params(offloaded)

    # ------------------------------------------------------------------ state

    def get_state(self, unit: int) -> dict[str, torch.Tensor]:
        """Host copies for device units too: a checkpoint holds the same tensors at any
        ratio (loading one under another ratio moves each unit to its new side)."""
        state = self._owner(unit).get_state(unit)
        if unit in self.device_units:
            return {kind: value.cpu() for kind, value in state.items()}
        return state

    def set_state(self, unit: int, state: dict[str, torch.Tensor]) -> None:
        self._owner(unit).set_state(unit, state)
        if unit in self.device_units:
            self._changed(unit)

    def flush(self, tag: str | None) -> None:
        self.on_device.flush(tag)
        self.offloaded.flush(tag)

    def stats(self) -> dict[str, Any]:
        """The daemon side's counters, plus how much stays on the device."""
        device_nbytes = sum(optimizer_state_nbytes(self._specs[unit])
                            for unit in self.device_units if unit in self._specs)
        return {**self.offloaded.stats(), **self.on_device.stats(),
                "device_units": len(self.device_units), "device_state_nbytes": device_nbytes}

    def close(self) -> None:
        self._params.clear()
        try:
            self.on_device.close()
        finally:
            self.offloaded.close()


def _nothing() -> None:
    return None
