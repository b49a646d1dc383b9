"""The training engine: DeepSpeed-style ``forward`` / ``backward`` / ``step`` over ZeRO units.

The engine only sequences work. What it delegates:

- ``trainer.zero.partition``: the model split into units with flat parameters;
- ``trainer.zero``: the stage (parameter placement + gradient reducer), with
  ``trainer.zero.gather`` for stage 3's async, prefetched all-gathers;
- ``trainer.zero.hooks``: per-unit forward/backward callbacks;
- ``trainer.zero.optimizer``: Adam/AdamW over unit partitions, clipping, skipping;
- ``trainer.offload.backend``: where the optimizer state lives (rank or daemon);
- ``trainer.zero.groups``: parameter groups and their hyper-parameters;
- ``trainer.zero.reduce_order``: one gradient-reduction order on every rank;
- ``trainer.zero.trace``: stage 3's check that ranks gather the same units in order;
- ``trainer.dist.agreement``: setup steps that fail on every rank or on none;
- ``trainer.zero.precision``, ``trainer.zero.scheduler``;
- ``StateIO`` (``trainer.state``, handed in): checkpoints, the 16-bit export and the
  pretrained weights a meta-built model is filled from.

A micro-step is ``loss = engine(batch)``, ``engine.backward(loss)``,
``engine.step()``; the optimizer only steps at accumulation boundaries.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

import torch
from torch import nn

from trainer.config import BatchSizes, EngineConfig
from trainer.device.twin import adopt_module
from trainer.dist.agreement import agree
from trainer.dist.collectives import Collectives
from trainer.offload.backend import StateBackend, UnitSpec
from trainer.zero.external import ExternalParams
from trainer.zero.gather import GatherState
from trainer.zero.groups import ParamGroups, resolve_param_groups
from trainer.zero.hooks import UnitHooks, outside_inference_mode
from trainer.zero.init import (
    WeightSource,
    materialise_unit,
    materialise_untracked,
    release_kept_values,
)
from trainer.zero.optimizer import ZeroOptimizer
from trainer.zero.partition import Unit, build_units
from trainer.zero.precision import DTYPES, Precision
from trainer.zero.reduce_order import ReduceOrder
from trainer.zero.scheduler import LRSchedule, build_scheduler
from trainer.zero.stages import PrefetchPlanner, ReducedGrad, Sharded, build_stage
from trainer.zero.trace import GatherTrace


def move_model(model: nn.Module, device: torch.device, dtype: torch.dtype, *,
                sharded: bool) -> None:
    """The training dtype everywhere, and the compute device for every real tensor.

    Parameters built under ``zero.Init`` are still on ``meta`` (no data to copy); each
    gets its storage on ``device`` when its unit is materialised. ``sharded`` (stage 3):
    host parameters stay where they are, each unit's copied to the device as its flat
    partitions are built, so the whole model is never on the device at once (DeepSpeed
    moves it there first: a model larger than the GPU needs its zero.Init).
    """
    model.to(dtype=dtype)
    if sharded or any(param.is_meta for param in model.parameters()):
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if not param.is_meta and not sharded:
                    param.data = param.data.to(device)
            for name, buffer in module.named_buffers(recurse=False):
                if not buffer.is_meta:
                    module._buffers[name] = buffer.to(device)
    else:
        model.to(device=device)
    if device.type == "twin":  # the strict twin: what is on it becomes device tensors
        adopt_module(model, count_params=not sharded)


class StateIO(Protocol):
    """What the engine asks of the state layer, which sits above it and reads its units
    (``trainer.state.engine_io.EngineStateIO``, handed in by ``trainer.initialize``)."""

    def pending_weights(self, model: nn.Module) -> WeightSource | None:
        """The checkpoint a meta-built model is filled from at ``initialize``, if any."""
        ...

    def forget_pending(self, model: nn.Module) -> None:
        """Every unit is filled: drop the pending checkpoint."""
        ...

    def save_checkpoint(self, engine: Engine, save_dir: str | os.PathLike[str],
                        tag: str | None, client_state: dict[str, Any] | None, *,
                        save_latest: bool, exclude_frozen_parameters: bool) -> str: ...

    def load_checkpoint(self, engine: Engine, load_dir: str | os.PathLike[str],
                        tag: str | None, deepspeed_options: dict[str, bool]
                        ) -> tuple[str | None, dict[str, Any]]: ...

    def save_16bit_model(self, engine: Engine, save_dir: str | os.PathLike[str],
                         save_filename: str, exclude_frozen_parameters: bool, *,
                         max_shard_size: int | str) -> bool: ...

    def restore_module(self, engine: Engine, *, handover: bool = False) -> None:
        """Stage 3: the trained weights back into the module's parameters, whole (on rank 0
        only with ``handover``: the others' become ``meta``, for the next engine)."""
        ...


class EngineClosedError(RuntimeError):
    """A closed (or destroyed) engine was asked to train."""


class EngineInferenceError(RuntimeError):
    """An engine built without an optimizer (for inference) was asked to train."""


class Engine(nn.Module):
    """Wraps a model for ZeRO data-parallel training (see module docstring)."""

    def __init__(self, model: nn.Module, config: EngineConfig, *, collectives: Collectives,
                 backend: StateBackend, state_io: StateIO,
                 param_groups: ParamGroups | None = None) -> None:
        super().__init__()
        self.module = model
        self.state_io = state_io
        self.closed = False
        """``close`` (or ``destroy``) ran: the engine trains no more."""
        self.config = config
        self.collectives = collectives
        self.backend = backend
        self.batch: BatchSizes = config.batch_sizes(collectives.world_size)
        self.precision = Precision(config)
        self.global_steps = 0
        self.micro_steps = 0
        self.window_backwards = 0
        """Backwards run in the open accumulation window (``trainer.zero.param_state``)."""
        self._compiled = False
        self.global_samples = 0
        self._inflight: list[tuple[Unit, ReducedGrad]] = []
        self._backward_done: set[int] = set()
        """Units whose gradients are final in the backward running now (see
        ``_prefetch_after``)."""
        stage = config.zero_optimization.stage
        num_parts = collectives.world_size if stage >= 1 else 1
        move_model(model, collectives.device, self.precision.dtype, sharded=stage == 3)
        groups = param_groups or resolve_param_groups(model, None, config.optimizer)
        self.inference = groups.inference
        """Built without an optimizer (``trainer.zero.groups.ParamGroups.inference``): it
        evaluates, and refuses ``backward`` and ``step``."""
        if self.inference and stage != 3:
            raise ValueError(
                f"an engine without an optimizer (for inference) needs ZeRO stage 3, got "
                f"stage {stage}: below it the module keeps its whole weights, so evaluate "
                f"the module itself, or add an 'optimizer' section to train")
        self.units = build_units(model, config.units, num_parts=num_parts,
                                 part_index=collectives.rank if num_parts > 1 else 0,
                                 group_of=groups.group_of, include_frozen=stage == 3,
                                 inference=self.inference, device=collectives.device)
        trainable = [unit for unit in self.units if unit.trainable]
        zero = config.zero_optimization
        self.grad_dtype = self._grad_dtype()
        """Dtype of the reduced gradient partitions and of every sum of them."""
        self._reduce_collectives = collectives.separate_group() if stage == 3 else None
        """Stage 3's group of its own for gradient reductions (closed with the engine)."""
        self.placement, self.reducer = build_stage(
            stage, collectives, self.precision.dtype, backend, grad_dtype=self.grad_dtype,
            offload_params=zero.offload_param.device != "none",
            max_live_numel=zero.stage3_max_live_parameters,
            reduce_collectives=self._reduce_collectives)
        self._adopt_parameters()
        self.optimizer = ZeroOptimizer(backend, config.optimizer, collectives=collectives,
                                       scaler=self.precision.scaler,
                                       clip_norm=config.gradient_clipping,
                                       partitioned=num_parts > 1, groups=groups.hyper,
                                       unit_groups={unit.index: unit.group or 0
                                                    for unit in trainable},
                                       before_step=self._before_unit_step,
                                       speculative=zero.offload_optimizer.speculative_step,
                                       step_in_backward=zero.step_in_backward)
        self.lr_scheduler: LRSchedule | None = build_scheduler(self.optimizer, config.scheduler)
        self.prefetch = PrefetchPlanner(config.zero_optimization.stage3_prefetch_bucket_size,
                                        config.zero_optimization.stage3_max_live_parameters)
        self._forward_depth = 0
        self._pass_trains = False
        """The outermost forward running now builds a graph for a backward (see
        ``_post_forward``)."""
        self._in_backward = False
        """Forward hooks firing now are activation-checkpoint recomputes."""
        self.reduce_order = ReduceOrder(trainable)
        self._largest_numel = max((unit.padded_numel for unit in self.units), default=0)
        self._hold_limit_numel = max(0, zero.stage3_max_live_parameters
                                     - 2 * self._largest_numel)
        """Units are held gathered past their backward while everything gathered fits this
        many elements: ``stage3_max_live_parameters`` less room for the unit in use and
        the next one (prefetch always reaches one unit ahead)."""
        self.hooks = UnitHooks(self.units, on_grads_ready=self._on_grads_ready,
                               on_frozen_backward_done=self._hold_or_release)
        self.trace: GatherTrace | None = None
        self.external: ExternalParams | None = None
        """Stage 3: parameters used outside their unit's forward (``trainer.zero.external``)."""
        if isinstance(self.placement, Sharded):
            self.trace = GatherTrace(collectives, self.units)
            self.placement.full.before_gather = self.trace.before_gather
            full = self.placement.full
            self.external = ExternalParams(
                model, self.units, gather=self._gather_for_use, release=self.placement.release,
                is_ready=lambda unit: full.state(unit) is GatherState.READY)
            self.hooks.install_forward(pre_forward=self._pre_forward,
                                       post_forward=self._post_forward,
                                       pre_backward=self._pre_backward)

    # ----------------------------------------------------------------- setup

    def _adopt_parameters(self) -> None:
        """Rank 0's initial values everywhere, then hand units to backend and placement."""
        # zero.Init: meta parameters get storage unit by unit, from a pretrained checkpoint
        # (load_pretrained / from_pretrained under zero.Init) or else the model's own init.
        with agree(self.collectives, "matching the pretrained checkpoint to the model"):
            pretrained = self.state_io.pending_weights(self.module)
        materialise_untracked(self.module, self.units, self.collectives, pretrained)
        self._broadcast_untracked_state()
        specs = [UnitSpec(index=unit.index, part_numel=unit.part_numel,
                          param_dtype=self.precision.dtype, trainable=unit.trainable,
                          grad_dtype=self.grad_dtype) for unit in self.units]
        self.backend.plan(specs)
        next_id = 0
        for unit, spec in zip(self.units, specs, strict=True):
            materialise_unit(self.module, unit, self.collectives, pretrained)
            for slot in unit.slots:  # how zero.GatheredParameters and load_pretrained find us
                slot.param._zero_engine = weakref.ref(self)  # type: ignore[attr-defined]
                slot.param._zero_unit = unit  # type: ignore[attr-defined]
            if self.config.zero_optimization.stage == 3:
                next_id = unit.describe_sharded(next_id)
            flat = unit.flatten_params(self.precision.dtype)
            self.collectives.broadcast(flat)
            with agree(self.collectives, f"registering unit {unit.index} ({unit.name})"):
                self.backend.register(spec, unit.part_slice(flat).float())
                self.placement.setup(unit, flat)
            del flat  # gone before the next unit's is built (setup's device peak)
        self.state_io.forget_pending(self.module)
        release_kept_values()

    def _grad_dtype(self) -> torch.dtype:
        """The config's gradient dtype (``EngineConfig.grad_dtype_name``) at this run's
        accumulation (tests widen it to fp32 here)."""
        return DTYPES[self.config.grad_dtype_name(self.batch.gradient_accumulation_steps)]

    def _broadcast_untracked_state(self) -> None:
        """Buffers and frozen parameters outside units are replicated as-is from rank 0."""
        for buffer in self.module.buffers():
            self.collectives.broadcast(buffer.data)
        in_units = {id(slot.param) for unit in self.units for slot in unit.slots}
        for param in self.module.parameters():
            if not param.requires_grad and id(param) not in in_units:
                self.collectives.broadcast(param.data)

    # --------------------------------------------------------------- forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on (floating inputs cast to the training dtype)."""
        if self.closed:
            raise EngineClosedError("this engine was closed (engine.close(), or "
                                    "engine.destroy() as Accelerate's free_memory calls it): "
                                    "build a new one with trainer.initialize over the model")
        self._follow_dynamo()  # a unit compiled in place runs its hooks eagerly
        with outside_inference_mode():  # what begin_step allocates outlives this pass
            self.backend.begin_step()
        self._forward_depth = 0  # a forward that raised half-way must not skew the next one
        self.hooks.begin_pass(trains=torch.is_grad_enabled())
        if self.external is not None:
            self.external.begin_pass()
        if self.trace is not None:
            self.trace.begin("forward", training=self.module.training)
        output = self.module(*self.precision.cast_inputs(args),
                             **self.precision.cast_inputs(kwargs))
        if self.trace is not None:
            self.trace.end()
        return output

    def _pre_forward(self, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.visit(unit)
        if self._in_backward:
            # An activation-checkpoint recompute: not a pass to learn the order from; the
            # units needed next are the backward's.
            self.placement.gather(unit)
            self._enter_external(unit)
            self._prefetch_after(unit, backward=True)
            return
        if self._forward_depth == 0:
            self._pass_trains = torch.is_grad_enabled()
        self.prefetch.record(unit, first_of_pass=self._forward_depth == 0)
        self._forward_depth += 1
        self.placement.take(unit)
        self.placement.gather(unit)
        self._enter_external(unit)
        self._prefetch_after(unit, backward=False)

    def _follow_dynamo(self) -> None:
        """Keep the hooks and the watch on parameter reads out of dynamo's graphs."""
        self.hooks.follow_dynamo()
        if self.external is not None:
            self.external.follow_dynamo()

    def _enter_external(self, unit: Unit) -> None:
        if self.external is not None:
            self.external.enter(unit)

    def _gather_for_use(self, unit: Unit) -> None:
        """Gather ``unit`` for a use outside its own forward (``trainer.zero.external``)."""
        self.placement.take(unit)
        self.placement.gather(unit)

    def _post_forward(self, unit: Unit, signalled: bool = True) -> None:
        """After ``unit``'s forward; ``signalled`` False when its output hid its tensors
        from the hooks (``trainer.zero.hooks.PostForward``): it then stays gathered for its
        backward, which nothing would gather it for."""
        if self.external is not None:
            self.external.leave(unit, pass_ends_without_backward=not self._in_backward and (
                not self._pass_trains or self.inference))
        if self._in_backward:
            return  # the recomputed ops' backward reads these parameters next; grads free them
        self._forward_depth -= 1
        self.prefetch.record_end(unit)
        # The unit stays gathered for its backward (no second gather then) when a backward
        # follows and keeping it fits stage3_max_live_parameters, or a GPU sized by it
        # runs out of memory:
        # - while everything gathered stays within the room units are held in past their
        #   backward (``_hold_limit_numel``): the memory the backward commits to holding
        #   anyway, so a model that fits it is gathered once per step, however deep;
        # - or within the reuse distance (DeepSpeed's stage3_max_reuse_distance; unknown
        #   in the first pass): the unit and the units gathered before its backward must
        #   fit. The distance counts each of those twice (its forward and its backward
        #   use); in memory each is one buffer, live once at most, so half the distance
        #   bounds them.
        # Either way the unit in use next must still fit beside what is kept. Whether a
        # backward follows is the outermost forward's grad mode: reentrant activation
        # checkpointing (HF's default) runs its blocks under no_grad, then recomputes
        # them in the backward with the same parameters.
        zero = self.config.zero_optimization
        live = self.placement.live_numel
        distance = self.prefetch.reuse_distance(unit)
        near = (distance is not None and distance <= zero.stage3_max_reuse_distance
                and distance // 2 + unit.padded_numel <= zero.stage3_max_live_parameters)
        keep = (self._pass_trains and self.module.training
                and live + self._largest_numel <= zero.stage3_max_live_parameters
                and (live <= self._hold_limit_numel or near))
        if not keep and signalled and not (self.external is not None
                                           and self.external.in_use(unit)):
            self.placement.release(unit)

    def _pre_backward(self, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.visit(unit)
        self.placement.gather(unit)
        if self.external is not None:
            self.external.before_backward(unit, self._backward_done)
        self._prefetch_after(unit, backward=True)

    def _prefetch_after(self, unit: Unit, *, backward: bool) -> None:
        """Start the next units' all-gathers (and daemon reads) in execution order.

        In backward, units whose gradients are already final are passed over: a unit
        that shares its module with others (a root split by parameter groups, say the
        final norm's no-decay unit) sits early in the forward order yet finishes its
        backward first; gathering it again would read a partition its optimizer step is
        about to rewrite, only to be thrown away after the step.
        """
        upcoming = self.prefetch.following(unit, backward=backward)
        if upcoming:
            skip = self._backward_done if backward else self.placement.held
            self.placement.prefetch(upcoming, self.prefetch.budget_numel, skip)
            source = getattr(self.placement, "source", None)
            if source is not None:
                source.prefetch(self.prefetch.upcoming(unit, backward=backward, skip=skip))

    # -------------------------------------------------------------- backward

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window."""
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagate ``loss`` (scaled for accumulation and fp16) and reduce gradients.

        In eval mode too, as torch trains a model in eval mode (dropout off): the
        gradients are the eval-mode forward's, and stage 3 gathers what the forward
        released again in backward."""
        self._check_trains("backward")
        scale = self.precision.scaler.scale / self.batch.gradient_accumulation_steps
        self.hooks.start_backward(also_defer=self.external.owners() if self.external else ())
        self._backward_done.clear()
        self.reduce_order.start()
        if self.trace is not None:
            self.trace.begin("backward", training=self.module.training)
        self._in_backward = True
        try:
            (loss.float() * scale).backward()
        finally:
            self._in_backward = False
        if self.trace is not None:
            self.trace.end()
        self.hooks.finish_backward()
        for unit in self.units:
            if not unit.trainable:  # inputs that needed no grad: no post-backward signal
                self._hold_or_release(unit)
        assert self.reduce_order.complete
        self._drain_reductions(block=True)
        self.window_backwards += 1
        return loss

    def _on_grads_ready(self, unit: Unit) -> None:
        flat_grad = unit.flatten_grads(self.precision.dtype)
        self._backward_done.add(unit.index)
        self._hold_or_release(unit)
        for due_unit, due_grad in self.reduce_order.ready(unit, flat_grad):
            self._reduce(due_unit, due_grad)

    def _hold_or_release(self, unit: Unit) -> None:
        """After its backward, a unit's full parameters stay gathered for the next forward
        when they will still be current then: a frozen unit's never change, and a
        trainable unit's change only at the optimizer step, after the window's last
        micro-batch. Held within ``_hold_limit_numel`` (``FullParams.hold``)."""
        if unit.trainable and self.is_gradient_accumulation_boundary():
            self.placement.release(unit)
        else:
            self.placement.hold(unit, self._hold_limit_numel)

    def _reduce(self, unit: Unit, flat_grad: torch.Tensor) -> None:
        overlap = self.config.zero_optimization.overlap_comm
        reduced = self.reducer.reduce(unit, flat_grad,
                                      boundary=self.is_gradient_accumulation_boundary(),
                                      async_op=overlap)
        if reduced is not None:
            self._inflight.append((unit, reduced))
        self._drain_reductions(block=not overlap)

    def _drain_reductions(self, *, block: bool) -> None:
        """Hand finished reductions to the optimizer, in launch order."""
        boundary = self.is_gradient_accumulation_boundary()
        first = (not self.reducer.accumulates_partitions
                 or self.micro_steps % self.batch.gradient_accumulation_steps == 0)
        while self._inflight and (block or self._inflight[0][1].done()):
            unit, reduced = self._inflight.pop(0)
            self.optimizer.take_grad(unit.index, reduced.wait(), first=first, boundary=boundary)

    # ------------------------------------------------------------------ step

    def _before_unit_step(self, unit_index: int) -> None:
        """Called before the optimizer step of a unit starts.

        Hazard: the step rewrites the unit's parameter partition in place (the daemon
        takes a write lease on ``u{N}.param``) while an all-gather started earlier may
        still read it under a read lease; the gather is finished and its full parameters
        dropped first (they would be stale after the step anyway)."""
        self.placement.release(self.units[unit_index])

    def _check_trains(self, call: str) -> None:
        if self.inference:
            raise EngineInferenceError(
                f"{call}(): this engine has no optimizer (it was built for inference: "
                f"neither an optimizer object nor an 'optimizer' config section, as "
                f"DeepSpeed's inference engine); build one with an optimizer to train")

    def step(self) -> None:
        """End a micro-step; at an accumulation boundary, apply the optimizer step."""
        self._check_trains("step")
        if self.is_gradient_accumulation_boundary():
            applied = self.optimizer.step()
            for unit in self.units:
                if unit.trainable:  # a frozen unit's partition is never stepped
                    self.placement.after_step(unit)
            if applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.backend.end_window()
            self.window_backwards = 0
            self.global_steps += 1
            self.global_samples += self.batch.train_batch_size
        self.micro_steps += 1

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: drop every full parameter stage 3 holds gathered (kept for the next
        micro-batch or prefetched), so the device memory is free for something else (an
        evaluation or generation with another model); the next forward gathers again.
        Nothing to drop below stage 3. Refused inside a forward or backward, whose
        parameters are in use."""
        if self._in_backward or self._forward_depth > 0:
            raise RuntimeError("empty_partition_cache() inside a forward or backward: call "
                               "it between training steps or micro-batches")
        if isinstance(self.placement, Sharded):
            self.placement.full.free_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are consumed by each backward; kept for DeepSpeed API parity."""

    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None) -> None:
        """DeepSpeed's ``engine.compile`` (Accelerate calls it under ``--dynamo_backend``):
        ``torch.compile`` in place, region by region: each unit's module but the root
        (``module.compile()``, so its hooks stay on the call path and run eagerly,
        ``trainer.zero.hooks``), or the whole module where the root is the only unit.
        ``schedule`` (DeepSpeed's DeepCompile passes) is refused."""
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...): DeepSpeed's DeepCompile "
                             "schedules are not supported by offloadd; leave it None")
        regions = [unit.module for unit in self.units if unit.module is not self.module]
        for module in dict.fromkeys(regions) or [self.module]:  # units split by group: once
            module.compile(backend=backend, **(compile_kwargs or {}))
        self._follow_dynamo()
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._compiled

    # ------------------------------------------------------------- accessors

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last applied window's global gradient norm (unscaled), computed where a step
        needs it: with ``gradient_clipping`` or fp16's overflow check. None otherwise (each
        unit's step then starts in backward; DeepSpeed computes the norm anyway, which on
        the host path is one more pass over every gradient a step)."""
        return self.optimizer.last_grad_norm

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps

    # DeepSpeed's engine attributes its tutorials read (CIFAR-10: the device and the
    # dtype its inputs are moved to)
    @property
    def local_rank(self) -> int:
        return self.collectives.local_rank

    @property
    def global_rank(self) -> int:
        return self.collectives.rank

    @property
    def world_size(self) -> int:
        return self.collectives.world_size

    @property
    def device(self) -> torch.device:
        """The rank's compute device, where the engine wants its inputs."""
        return self.collectives.device

    def bfloat16_enabled(self) -> bool:
        return self.precision.dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.precision.dtype == torch.float16

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    @property
    def loss_scale(self) -> float:
        return self.precision.scaler.scale

    def offload_stats(self) -> dict[str, Any]:
        """The backend's counters (daemon client stats when offloading), and how many unit
        steps started before the global norm and how many of those were run again."""
        return {**self.backend.stats(), "speculated_units": self.optimizer.speculated_units,
                "reverted_units": self.optimizer.reverted_units}

    # ------------------------------------------------------------ checkpoint

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """DeepSpeed's: every rank's partition, the optimizer, scheduler and counters
        (``trainer.state.checkpoint``); ``exclude_frozen_parameters`` leaves frozen
        weights out (a PEFT run's base model)."""
        return self.state_io.save_checkpoint(
            self, save_dir, tag, client_state, save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False
                        ) -> tuple[str | None, dict[str, Any]]:
        """DeepSpeed's: everything by default; the options restore less, with DeepSpeed's
        meaning (``trainer.state.checkpoint.LoadOptions``)."""
        return self.state_io.load_checkpoint(self, load_dir, tag, {
            "load_module_strict": load_module_strict,
            "load_optimizer_states": load_optimizer_states,
            "load_lr_scheduler_states": load_lr_scheduler_states,
            "load_module_only": load_module_only})

    def save_16bit_model(self, save_dir: str | os.PathLike[str],
                         save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False, *,
                         max_shard_size: int | str = "5GB") -> bool:
        """An HF model directory ``from_pretrained`` loads (``trainer.state.export``); a
        ``save_filename`` ending in ``.bin`` writes torch.save files instead."""
        return self.state_io.save_16bit_model(self, save_dir, save_filename,
                                              exclude_frozen_parameters,
                                              max_shard_size=max_shard_size)

    def destroy(self, *, handover: bool = False) -> None:
        """DeepSpeed's ``engine.destroy()``: release the engine as ``close`` does, and leave
        its module whole, holding the trained weights (stage 3 writes them back from the
        fp32 masters, on the host), so a new engine can train it again: HF Trainer calls it
        (through Accelerate's ``free_memory``) at the start of each ``train()``, of every
        hyperparameter-search trial and of each ``auto_find_batch_size`` retry; ``close``
        leaves a stage-3 module's parameters empty. Collective: every rank calls it. A
        closed engine has nothing left to restore.

        ``handover``: a new engine over the module comes next (``initialize`` over a model
        an open engine trains): stage 3 writes the weights back on rank 0 only and turns
        the other ranks' parameters ``meta``, as ``zero.Init`` builds them; the new engine
        gives them storage unit by unit and broadcasts rank 0's values over them. A node
        then holds one copy of the model on the host at the handover, not one per rank."""
        if self.closed:
            return
        self.state_io.restore_module(self, handover=handover)
        self.close()

    def close(self) -> None:
        """Remove hooks and release the backend (daemon connection, private daemon) and
        stage 3's reduction group."""
        if self.closed:
            return
        self.closed = True
        self.hooks.remove()
        if self.external is not None:
            self.external.unwatch()
        self.backend.close()
        if self._reduce_collectives is not None:
            self._reduce_collectives.close()
