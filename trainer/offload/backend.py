"""The offload component: where each unit's optimizer state lives and where Adam runs.

The engine talks to one ``StateBackend`` and never asks where the state is.
Per unit N it holds this rank's partition of:

- ``u{N}.master``     fp32 master parameters
- ``u{N}.exp_avg``    Adam first moment (fp32; in the daemon optionally bf16 or 8-bit,
                      ``offload_optimizer.state_dtype``, see offloadd.formats)
- ``u{N}.exp_avg_sq`` Adam second moment (likewise)
- ``u{N}.grad``       reduced gradient (fp32, or bf16 where the reduction rounded to it
                      or ``data_types.grad_accum_dtype`` asks for bf16 sums)
- ``u{N}.param``      the master cast to the training dtype (what ranks gather)

Two implementations:

- ``InProcessBackend`` (offload ``none``): torch tensors in the rank, the
  same AdamW math as ``torch.optim.AdamW`` run in the rank.
- ``DaemonBackend`` (offload ``cpu``/``nvme``, in ``trainer.offload.daemon_backend``):
  the same names are daemon shards and the step runs in the daemon
  (``optimizer_step_async``), so the rank holds none of this state.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from offloadd import moment_codec

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")


@dataclass(kw_only=True, frozen=True)
class AdamHyper:
    """Hyper-parameters of one optimizer step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool


@dataclass(kw_only=True, frozen=True)
class UnitSpec:
    """What a backend needs to hold one unit's partition."""

    index: int
    part_numel: int
    param_dtype: torch.dtype
    trainable: bool = True
    """False: frozen parameters (stage 3): only the ``param`` shard, no optimizer state."""
    grad_dtype: torch.dtype = torch.float32
    """Dtype the reduced gradient partition is kept and summed in until the optimizer
    step (``EngineConfig.grad_dtype_name``): bf16 where the reduction already rounded to
    it or the config accumulates in bf16, else fp32."""


@dataclass(kw_only=True, frozen=True)
class StepRedo:
    """What one unit's optimizer step was (or must be) started with: two are equal exactly
    when the two steps give the same bytes."""

    step: int
    hyper: AdamHyper
    grad_scale: float


class GradientUnavailableError(RuntimeError):
    """A unit's gradient was asked for after the backend gave it up."""


class StepHandle(Protocol):
    """An optimizer step in flight; ``wait()`` re-raises its failure."""

    def wait(self) -> None: ...


class FinishedStep:
    """A step that already ran synchronously."""

    def wait(self) -> None:
        return None


class StateBackend(abc.ABC):
    """Home of the units' fp32 optimizer state and reduced gradients; runs Adam."""

    @abc.abstractmethod
    def register(self, spec: UnitSpec, master: torch.Tensor) -> None:
        """Create the unit's state: master from ``master`` (fp32), zero moments and grad;
        a frozen unit (``spec.trainable`` False) gets only its parameter partition."""

    def plan(self, specs: list[UnitSpec]) -> None:  # noqa: B027 - most backends need no plan
        """Every unit ``register`` will get, in index order, before the first call (the
        same on every rank; ``trainer.offload.split`` places units by their sizes)."""

    @abc.abstractmethod
    def accumulate_grad(self, unit: int, grad: torch.Tensor, *, first: bool,
                        want_sq_norm: bool, last: bool = True) -> torch.Tensor | None:
        """Copy (``first``) or add ``grad`` into the unit's grad; return its squared L2 norm
        (float64 scalar, inf/nan on overflow) when ``want_sq_norm``. ``last``: the window's
        final micro-batch (the sum must be in the grad shard when this returns)."""

    @abc.abstractmethod
    def read_grad(self, unit: int) -> torch.Tensor:
        """A copy of the unit's gradient partition as summed so far in the window
        (``grad_dtype``; the loss scale and the sum over ranks still in it), on the host or
        the compute device. Raises ``GradientUnavailableError`` where a step that ran
        already gave it up (the NVMe tier frees a consumed gradient)."""

    undo_budget_nbytes: int = 0
    """Bytes of undo data (``undo_nbytes``) undoable steps may hold at once; 0: none."""

    @abc.abstractmethod
    def step_async(self, unit: int, *, step: int, hyper: AdamHyper, grad_scale: float,
                   undoable: bool = False) -> StepHandle:
        """Start Adam on the unit with ``grad * grad_scale``; ``step`` is 1-based.

        ``undoable`` (after ``prepare_undo`` said yes): keep what ``revert_step`` needs to
        put the state back as it was before this step, and leave the gradient as it is;
        ``commit_step`` or ``revert_step`` ends it."""

    def step_runs_async(self, unit: int) -> bool:
        """True when the unit's step runs off the rank's critical path (in the daemon): only
        then does starting it before the global gradient norm is known pay."""
        return False

    def undo_nbytes(self, unit: int) -> int:
        """Bytes an undoable step of the unit keeps: its master and both moments."""
        return 0

    def prepare_undo(self, unit: int) -> bool:
        """Make room for the unit's undo data; False when there is none (step it later)."""
        return False

    def steps_behind(self, units: list[int]) -> int:
        """How many of ``units``' steps are still queued or running now."""
        return 0

    @abc.abstractmethod
    def commit_step(self, unit: int) -> None:
        """The unit's undoable step stands: drop its undo data (and the consumed gradient
        where the backend drops it after a step)."""

    @abc.abstractmethod
    def revert_step(self, unit: int, redo: StepRedo | None) -> StepHandle:
        """Put the unit's state (and parameter) back as before its undoable step, then, with
        ``redo``, run the step again with those arguments on the unchanged gradient."""

    @abc.abstractmethod
    def read_params(self, unit: int, out: torch.Tensor) -> None:
        """Copy the unit's parameter partition (training dtype) into ``out``."""

    def host_params(self, unit: int) -> torch.Tensor:
        """A host copy of the unit's parameter partition (checkpoints, exports)."""
        part = torch.empty(self.part_numel(unit), dtype=self.param_dtype(unit))
        self.read_params(unit, part)
        return part

    def lease_params(self, unit: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """The unit's parameter partition to read from (valid until the callback runs)."""
        part = torch.empty(self.part_numel(unit), dtype=self.param_dtype(unit))
        self.read_params(unit, part)
        return part, _no_release

    @abc.abstractmethod
    def part_numel(self, unit: int) -> int:
        """Elements of the unit's partition."""

    @abc.abstractmethod
    def param_dtype(self, unit: int) -> torch.dtype:
        """The unit's training dtype."""

    def wait_steps(self) -> None:  # noqa: B027 - synchronous backends have nothing pending
        """Wait for every optimizer step in flight (re-raising the first failure)."""

    def prefetch_params(self, units: list[int]) -> None:  # noqa: B027 - optional hint
        """Hint that ``read_params`` will soon be called for ``units``."""

    def begin_step(self) -> None:  # noqa: B027 - optional hint
        """A micro-step's forward starts (the daemon learns access order per step)."""

    def end_window(self) -> None:  # noqa: B027 - optional hint
        """An accumulation window ended: its optimizer step was issued."""

    @abc.abstractmethod
    def get_state(self, unit: int) -> dict[str, torch.Tensor]:
        """Copies of the unit's master (fp32), exp_avg and exp_avg_sq (as stored: fp32,
        bf16 or blockwise8 bytes, see offloadd.moment_codec), in the rank; empty for a
        frozen unit."""

    @abc.abstractmethod
    def set_state(self, unit: int, state: dict[str, torch.Tensor]) -> None:
        """Overwrite master/exp_avg/exp_avg_sq (and the param copy derived from master);
        moments in another format than the backend's are converted to it. A frozen unit
        takes ``state["param"]``."""

    def flush(self, tag: str | None) -> None:  # noqa: B027 - nothing to persist in-process
        """Make the state durable (daemon NVMe tier); a no-op in-process."""

    def stats(self) -> dict[str, Any]:
        """Counters for progress reports (bytes moved, ...)."""
        return {}

    def close(self) -> None:  # noqa: B027 - nothing to release in-process
        """Release the backend's resources."""


def _no_release() -> None:
    return None


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, hyper: AdamHyper) -> None:
    """torch.optim.AdamW / Adam math, in place on fp32 tensors (``grad`` may be modified)."""
    if hyper.weight_decay:
        if hyper.decoupled_weight_decay:
            param.mul_(1 - hyper.lr * hyper.weight_decay)
        else:
            grad = grad.add(param, alpha=hyper.weight_decay)
    exp_avg.lerp_(grad, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1 - hyper.beta2)
    step_size = hyper.lr / (1 - hyper.beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - hyper.beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm in float64 (inf/nan propagate, which is how overflow shows)."""
    return torch.linalg.vector_norm(tensor, dtype=torch.float64).square()


class _UnitState:
    def __init__(self, spec: UnitSpec, master: torch.Tensor) -> None:
        self.spec = spec
        self.master = master.detach().to(torch.float32, copy=True)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.grad = torch.zeros_like(self.master, dtype=spec.grad_dtype)
        """The reduced gradient, summed over the window in ``spec.grad_dtype``."""
        self.undo: tuple[torch.Tensor, ...] | None = None
        """Master and moments before an undoable step, until it is committed or reverted."""

    def step(self, redo: StepRedo) -> None:
        grad = self.grad
        if grad.dtype != torch.float32 or redo.grad_scale != 1.0:
            # Adam runs on fp32 scaled by grad_scale: a new tensor, so the window's sum stays
            # as summed (an undoable step runs again from it; ``read_grad`` reads it)
            grad = grad.to(torch.float32, copy=True).mul_(redo.grad_scale)
        adam_update(self.master, grad, self.exp_avg, self.exp_avg_sq, step=redo.step,
                    hyper=redo.hyper)


class InProcessBackend(StateBackend):
    """Optimizer state as torch tensors in the rank (offload device ``none``)."""

    def __init__(self) -> None:
        self._units: dict[int, _UnitState] = {}
        self._frozen: dict[int, tuple[UnitSpec, torch.Tensor]] = {}

    def register(self, spec: UnitSpec, master: torch.Tensor) -> None:
        if spec.trainable:
            self._units[spec.index] = _UnitState(spec, master)
        else:
            self._frozen[spec.index] = (spec, master.to(spec.param_dtype, copy=True))

    def accumulate_grad(self, unit: int, grad: torch.Tensor, *, first: bool,
                        want_sq_norm: bool, last: bool = True) -> torch.Tensor | None:
        target = self._units[unit].grad
        if first:
            target.copy_(grad)
        else:
            target.add_(grad)
        return squared_norm(target) if want_sq_norm else None

    def step_async(self, unit: int, *, step: int, hyper: AdamHyper, grad_scale: float,
                   undoable: bool = False) -> StepHandle:
        state = self._units[unit]
        if undoable:
            state.undo = tuple(getattr(state, kind).clone() for kind in STATE_KINDS)
        state.step(StepRedo(step=step, hyper=hyper, grad_scale=grad_scale))
        return FinishedStep()

    def read_grad(self, unit: int) -> torch.Tensor:
        return self._units[unit].grad.clone()

    def undo_nbytes(self, unit: int) -> int:
        return 3 * self._units[unit].master.nbytes

    def prepare_undo(self, unit: int) -> bool:
        return True

    def commit_step(self, unit: int) -> None:
        self._units[unit].undo = None

    def revert_step(self, unit: int, redo: StepRedo | None) -> StepHandle:
        state = self._units[unit]
        assert state.undo is not None, f"unit {unit} has no undoable step to revert"
        for kind, saved in zip(STATE_KINDS, state.undo, strict=True):
            getattr(state, kind).copy_(saved)
        state.undo = None
        if redo is not None:
            state.step(redo)
        return FinishedStep()

    def read_params(self, unit: int, out: torch.Tensor) -> None:
        frozen = self._frozen.get(unit)
        out.copy_(frozen[1] if frozen is not None else self._units[unit].master)

    def _spec(self, unit: int) -> UnitSpec:
        frozen = self._frozen.get(unit)
        return frozen[0] if frozen is not None else self._units[unit].spec

    def part_numel(self, unit: int) -> int:
        return self._spec(unit).part_numel

    def param_dtype(self, unit: int) -> torch.dtype:
        return self._spec(unit).param_dtype

    def get_state(self, unit: int) -> dict[str, torch.Tensor]:
        if unit in self._frozen:
            return {}
        state = self._units[unit]
        return {kind: getattr(state, kind).clone() for kind in STATE_KINDS}

    def set_state(self, unit: int, state: dict[str, torch.Tensor]) -> None:
        if unit in self._frozen:
            self._frozen[unit][1].copy_(state["param"])
            return
        target = self._units[unit]
        target.master.copy_(state["master"])
        for kind in MOMENT_KINDS:
            value = state[kind]
            if value.dtype != torch.float32:  # a checkpoint of compact daemon moments
                value = moment_codec.decode(value.cpu(), signed=kind == "exp_avg",
                                            numel=target.spec.part_numel)
            getattr(target, kind).copy_(value)
