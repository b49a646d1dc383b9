"""The optimizer facade: Adam/AdamW over unit partitions held by a ``StateBackend``.

It receives each unit's reduced gradient partition as soon as the unit's
backward is reduced. At the accumulation boundary it starts that unit's step
right away when nothing global is needed first (*eager*: no clipping and no
overflow check). Otherwise the step needs the global gradient norm (all-reduced
across ranks; ``grad_scale`` folds the clip factor, the loss scale and the
1/world average into one multiply), known only once the whole backward is done.

*Speculative steps* take that wait off the critical path where the step runs
in the daemon: the unit's step starts at once with the scale the step has when
clipping does not fire, and the backend keeps the unit's state from before it
(``StateBackend.step_async(undoable=True)``). ``step()`` then checks each
speculative step against the step the norm asks for: the same arguments give
the same bytes, so it stands (``commit_step``); otherwise (clipping fired, an
overflow, the LR changed meanwhile) the state is put back and the step run
again with the right scale (``revert_step``), bit-identical to having waited.
A revert costs a second pass, so after one speculation pauses for a number of
steps that doubles with each revert in a row; likewise when most speculative
steps are still queued once the norm is known (the CPU is the bottleneck, and
saving the state only adds to its work). Undo data is bounded by the backend's
``undo_budget_nbytes``; the units beyond it wait for the norm.

``param_groups`` is torch-compatible so LR schedulers can drive it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from trainer.config import OptimizerConfig
from trainer.dist.collectives import Collectives
from trainer.offload.backend import AdamHyper, StateBackend, StepRedo
from trainer.zero.precision import LossScaler

CPU_BEHIND_FRACTION = 4
"""Speculation pauses when more than 1/4 of this window's speculative steps are still
queued in the daemon once the norm is known: where the GPU is the bottleneck, only the
last units' steps are."""
MAX_SPECULATION_PAUSE_STEPS = 64
"""Speculation pauses for 1, 2, 4, ... steps after reverts in a row, at most this many:
where clipping fires at most steps, speculating costs a second Adam pass each time."""


class ZeroOptimizer:
    """Adam/AdamW whose state lives in a backend, partitioned by unit."""

    def __init__(self, backend: StateBackend, config: OptimizerConfig, *,
                 collectives: Collectives, scaler: LossScaler, clip_norm: float,
                 partitioned: bool, groups: list[dict[str, Any]] | None = None,
                 unit_groups: dict[int, int] | None = None,
                 before_step: Callable[[int], None] | None = None,
                 speculative: bool = True, step_in_backward: bool = True) -> None:
        self.backend = backend
        self.before_step = before_step
        """Called with a unit's index right before its step starts (the engine lets go of
        anything that still reads the unit's parameter partition)."""
        self.collectives = collectives
        self.scaler = scaler
        self.clip_norm = clip_norm
        self.partitioned = partitioned
        """Partitions differ across ranks, so norms must be summed over ranks."""
        self.param_groups: list[dict[str, Any]] = [dict(group) for group in groups or [{
            "lr": config.lr, "betas": config.betas, "eps": config.eps,
            "weight_decay": config.weight_decay,
        }]]
        self.unit_groups = unit_groups or {}
        """Unit index -> its param group (``trainer.zero.groups``); absent: group 0."""
        self.decoupled = config.type == "AdamW" or config.adam_w_mode
        self.step_count = 0
        """Adam's t: applied steps so far (skipped overflow steps do not count)."""
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._sq_norms: dict[int, torch.Tensor] = {}
        """Unit -> its window gradient's squared norm (in hand-over order)."""
        self._edited: set[int] = set()
        """Units whose gradient was replaced after the window's backward (``replace_grad``)."""
        self.step_in_backward = step_in_backward
        """Steps may start during the backward that ends a window when nothing global is
        needed first (``zero_optimization.step_in_backward``)."""
        self._ready: list[int] = []
        self._speculated: dict[int, StepRedo] = {}
        """Units stepped speculatively this window, with the arguments they were run with."""
        self._undo_nbytes = 0
        """Undo data the speculative steps of this window hold."""
        self._pause_steps = 0
        """Optimizer steps left before speculation resumes after a revert."""
        self._pause_length = 0
        self.speculative = speculative
        """Steps may start before the global norm is known (``offload_optimizer``'s
        ``speculative_step``)."""
        self.speculated_units = 0
        """Unit steps started before the global norm was known (cumulative)."""
        self.reverted_units = 0
        """Of those, the ones put back and run again (or skipped on overflow)."""
        self.after_step: list[Callable[[], None]] = []
        """Called after every applied step (``trainer.integrations.ds_facade.link_groups``
        marks the client's torch optimizer as stepped for its LR scheduler)."""

    @property
    def eager(self) -> bool:
        """Steps can start per unit during backward: nothing global is needed first."""
        return (self.step_in_backward and self.clip_norm == 0
                and not self.scaler.checks_overflow)

    def hyper(self, group_index: int = 0) -> AdamHyper:
        """The step's hyper-parameters for one param group (the scheduler writes ``lr``)."""
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return AdamHyper(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"],
                         decoupled_weight_decay=self.decoupled)

    def take_grad(self, unit: int, grad: torch.Tensor, *, first: bool, boundary: bool) -> None:
        """Hand over one reduced gradient partition of ``unit``."""
        want_norm = boundary and not self.eager
        sq_norm = self.backend.accumulate_grad(unit, grad, first=first, want_sq_norm=want_norm,
                                               last=boundary)
        if not boundary:
            return
        if sq_norm is not None:
            self._sq_norms[unit] = sq_norm
        if self.eager:
            self._start(unit, self._redo(unit, self.base_grad_scale()))
        elif self._may_speculate(unit):
            self._speculated[unit] = self._start(unit, self._redo(unit, self.base_grad_scale()),
                                                 undoable=True)
            self.speculated_units += 1
        else:
            self._ready.append(unit)

    def grad_editable(self, unit: int) -> bool:
        """``unit``'s window gradient can still be replaced: handed over at the window's end
        and its step not begun for good (waiting for the norm, or speculative)."""
        return unit in self._ready or unit in self._speculated

    def replace_grad(self, unit: int, grad: torch.Tensor) -> None:
        """Make ``grad`` (this rank's partition, as the backend sums it: loss scale and the
        sum over ranks in it) the window's gradient of ``unit`` (``grad_editable``); its
        norm joins the global norm, and a speculative step of it is undone and run again
        at ``step()``."""
        assert self.grad_editable(unit), unit
        sq_norm = self.backend.accumulate_grad(unit, grad, first=True, want_sq_norm=True)
        assert sq_norm is not None
        self._sq_norms[unit] = sq_norm
        if unit in self._speculated:
            self._edited.add(unit)

    def _may_speculate(self, unit: int) -> bool:
        """Start the unit's step before the norm is known: it runs off the rank, recent
        steps did not revert, and its undo data fits the budget and the backend."""
        if not self.speculative or self._pause_steps or not self.backend.step_runs_async(unit):
            return False
        undo_nbytes = self.backend.undo_nbytes(unit)
        if self._undo_nbytes + undo_nbytes > self.backend.undo_budget_nbytes:
            return False
        if not self.backend.prepare_undo(unit):
            return False
        self._undo_nbytes += undo_nbytes
        return True

    def step(self) -> bool:
        """Start the step of every unit handed over; False when skipped on overflow.

        Steps run on in the backend: each is waited for at its unit's next use
        (``StateBackend`` orders every access to a unit after its step).
        """
        applied = True
        if not self.eager:
            applied = self._step_all_with_norm()
        self._ready.clear()
        self._speculated.clear()
        self._edited.clear()
        self._undo_nbytes = 0
        self.scaler.update(not applied)
        if applied:
            self.step_count += 1
            for callback in self.after_step:
                callback()
        else:
            self.skipped_steps += 1
        return applied

    def _step_all_with_norm(self) -> bool:
        norm = self._global_grad_norm()
        self.last_grad_norm = norm
        applied = math.isfinite(norm)
        grad_scale = self.base_grad_scale()
        if self.clip_norm > 0 and applied:
            grad_scale *= min(1.0, self.clip_norm / (norm + 1e-6))
        # Many speculative steps still running when the backward is done: the CPU is the
        # bottleneck, and saving the state only adds to its work. Pause as after a revert.
        behind = self.backend.steps_behind(list(self._speculated)) if self._speculated else 0
        pause = behind * CPU_BEHIND_FRACTION > len(self._speculated)
        # Forward order: the next forward needs the lowest units first.
        for unit in sorted([*self._ready, *self._speculated]):
            redo = self._redo(unit, grad_scale) if applied else None
            speculated = self._speculated.get(unit)
            if speculated is None:
                if redo is not None:
                    self._start(unit, redo)
            elif speculated == redo and unit not in self._edited:
                self.backend.commit_step(unit)
            else:
                self._revert(unit, redo)
                pause = True
        if self._speculated:
            self._pause_after(pause=pause)
        elif self._pause_steps:
            self._pause_steps -= 1
        return applied

    def _revert(self, unit: int, redo: StepRedo | None) -> None:
        if self.before_step is not None:
            self.before_step(unit)  # the revert rewrites the parameter partition
        self.backend.revert_step(unit, redo)
        self.reverted_units += 1

    def _pause_after(self, *, pause: bool) -> None:
        """Pause 1, 2, 4, ... steps after windows that reverted (or found the CPU behind)
        in a row; a window whose speculation stood resets the length."""
        if pause:
            self._pause_length = min(max(1, 2 * self._pause_length),
                                     MAX_SPECULATION_PAUSE_STEPS)
            self._pause_steps = self._pause_length
        else:
            self._pause_length = 0

    def _global_grad_norm(self) -> float:
        device = self.collectives.device  # a split backend's norms come from two places
        total = (torch.stack([norm.to(device) for norm in self._sq_norms.values()]).sum()
                 if self._sq_norms else torch.zeros((), dtype=torch.float64, device=device))
        self._sq_norms.clear()
        if self.partitioned:
            self.collectives.all_reduce(total)
        return math.sqrt(float(total)) * self.base_grad_scale()

    def base_grad_scale(self) -> float:
        """Undo the loss scale and turn the sum over ranks into a mean."""
        return 1.0 / (self.scaler.scale * self.collectives.world_size)

    def _redo(self, unit: int, grad_scale: float) -> StepRedo:
        """The arguments of the unit's step now."""
        return StepRedo(step=self.step_count + 1, hyper=self.hyper(self.unit_groups.get(unit, 0)),
                        grad_scale=grad_scale)

    def _start(self, unit: int, redo: StepRedo, *, undoable: bool = False) -> StepRedo:
        if self.before_step is not None:
            self.before_step(unit)
        self.backend.step_async(unit, step=redo.step, hyper=redo.hyper,
                                grad_scale=redo.grad_scale, undoable=undoable)
        return redo

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the backend and are overwritten each window; nothing to do."""

    def state_dict(self) -> dict[str, Any]:
        """Scalar state; per-unit tensors are saved by the checkpoint module."""
        return {"step_count": self.step_count, "skipped_steps": self.skipped_steps,
                "param_groups": [dict(group) for group in self.param_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])
        for group, saved in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(saved)
