"""What training a model needs, and where, before it runs: per GPU the model states on
the device, per node the daemon's DRAM arena and the host memory ``initialize`` builds the
model in, and the NVMe swap, for a given config and cluster shape.

The figures come from the engine's own sizing, not from a rule of thumb: the daemon's
bytes per element are ``rank_state_nbytes`` and the arena ``arena_with_slack``
(``trainer.offload.daemon_connect``, which sizes the real arena), and the units are the
ones ``trainer.zero.partition`` would build. Device figures count what the engine keeps
on the device: replicated parameters (stages 0-2), the stage-3 working set of gathered
units (``stage3_max_live_parameters``, or the two largest units), resident partitions
(``offload_param`` none), the optimizer state (``offload_optimizer`` none), stages 0-1's
full gradient sums and the largest unit's gradients in flight. Activations and the
running gradient sums the engine keeps only in free device memory (``SumRoom``) are
not counted. ``tests/test_memory_estimate.py`` holds them against what a run takes.

DeepSpeed's estimators (``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_
mem_needs_all_live`` and kin, which HF's DeepSpeed guide runs first) print these
figures under their names through the facade: one row per offload choice, for bf16
training with fp32 Adam moments and gradients accumulated in fp32, as DeepSpeed's
assume. Their ``additional_buffer_factor`` is accepted and not applied: the arena's own
slack is in the figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from trainer.config import EngineConfig, UnitsConfig, parse_config
from trainer.offload.daemon_connect import (
    DTYPE_ITEMSIZES,
    NVME_ARENA_FLOOR_NBYTES,
    arena_with_slack,
    rank_state_nbytes,
    round_arena,
)
from trainer.zero.partition import assign_params, find_unit_modules

_UNBOUNDED = 1 << 62


@dataclass(frozen=True, kw_only=True)
class ModelCounts:
    """A model's elements as the engine splits them."""

    trainable: int
    frozen: int
    largest_unit: int
    """Elements of the largest unit (a stage-3 gather, a gradient flattened at once)."""

    @classmethod
    def of(cls, model: nn.Module, units: UnitsConfig | None = None) -> ModelCounts:
        """Counted on the model as it is, ``meta`` parameters (``zero.Init``) included;
        a parameter shared between modules counts once."""
        unique = {id(param): param for param in model.parameters()}.values()
        owned = assign_params(model, find_unit_modules(model, units or UnitsConfig()),
                              include_frozen=True)
        return cls(trainable=sum(param.numel() for param in unique if param.requires_grad),
                   frozen=sum(param.numel() for param in unique if not param.requires_grad),
                   largest_unit=max((sum(param.numel() for _, param in params)
                                     for params in owned), default=0))


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one run needs: per GPU on the device, per node in DRAM and on NVMe."""

    device_nbytes: int
    """Model states on each GPU (activations not counted)."""
    arena_nbytes: int
    """The daemon's DRAM arena on each node (0 without offload)."""
    build_nbytes: int
    """Host memory each node's ranks hold while ``initialize`` builds the model: the model
    whole in fp32 per rank, or one unit per rank under ``zero.Init``."""
    nvme_nbytes: int
    """The training state on each node's NVMe (``offload_*.device`` nvme)."""

    @property
    def host_nbytes(self) -> int:
        """DRAM each node needs: the arena and, during ``initialize``, the build."""
        return self.arena_nbytes + self.build_nbytes


def estimate(counts: ModelCounts, config: EngineConfig | dict[str, Any], *,
             gpus_per_node: int = 1, nodes: int = 1, zero_init: bool = True) -> MemoryEstimate:
    """The memory ``config`` needs for a model of ``counts`` on ``nodes`` nodes of
    ``gpus_per_node`` ranks each (``zero_init``: built under ``trainer.zero.Init``)."""
    config = parse_config(config)
    zero = config.zero_optimization
    world = gpus_per_node * nodes
    node_nbytes = gpus_per_node * rank_state_nbytes(
        counts.trainable, counts.frozen, config, world,
        accumulation=config.gradient_accumulation_steps or 1)
    arena = nvme = 0
    if zero.offloaded and zero.offload_optimizer.device == "nvme":
        nvme, arena = node_nbytes, NVME_ARENA_FLOOR_NBYTES
    elif zero.offloaded:
        arena = round_arena(arena_with_slack(node_nbytes, _UNBOUNDED))
    built = counts.largest_unit if zero_init else counts.trainable + counts.frozen
    return MemoryEstimate(device_nbytes=_device_nbytes(counts, config, world),
                          arena_nbytes=arena, build_nbytes=4 * built * gpus_per_node,
                          nvme_nbytes=nvme)


def _device_nbytes(counts: ModelCounts, config: EngineConfig, world: int) -> int:
    zero = config.zero_optimization
    param_size = DTYPE_ITEMSIZES[config.dtype_name]
    accumulation = config.gradient_accumulation_steps or 1
    grad_size = DTYPE_ITEMSIZES[config.grad_dtype_name(accumulation)]
    total = counts.trainable + counts.frozen
    # The largest unit's gradients in flight: as autograd leaves them, flattened for the
    # reduction, and in the gradient dtype on their way to the sum, where the copy of the
    # unit before may still be under way.
    nbytes = counts.largest_unit * 2 * (param_size + grad_size)
    if zero.stage == 3:
        live = max(zero.stage3_max_live_parameters, 2 * counts.largest_unit)
        nbytes += min(total, live) * param_size
        if zero.offload_param.device == "none":
            nbytes += -(-total // world) * param_size
    else:
        nbytes += total * param_size
        if zero.stage <= 1:  # each rank sums its full gradients over the window
            nbytes += counts.trainable * 4
    if not zero.offloaded:  # the optimizer in the rank: master, fp32 moments, gradient sum
        parts = world if zero.stage >= 1 else 1
        nbytes += -(-counts.trainable // parts) * (4 + 8 + grad_size)
        nbytes += counts.largest_unit * 4  # a step's scaled fp32 gradient
        if zero.stage == 3:  # frozen partitions, kept beside the trainable ones
            nbytes += -(-counts.frozen // world) * param_size
    return nbytes


# ----------------------------------------------------------- DeepSpeed's estimators

_DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
    "bf16": {"enabled": True}}
"""What DeepSpeed's tables assume: 16-bit training, fp32 Adam state and gradients summed
in fp32 (accumulation)."""


def _row_config(stage: int, offload_optimizer: bool, offload_param: bool) -> EngineConfig:
    section: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        section["offload_param"] = {"device": "cpu"}
    return parse_config({**_DEEPSPEED_DEFAULTS, "zero_optimization": section})


_ROWS = {3: [(True, True, True), (True, True, False), (True, False, True),
             (True, False, False), (False, False, True), (False, False, False)],
         2: [(True, False, False), (False, False, False)]}
"""Per stage, the rows of DeepSpeed's table: (offload_optimizer, offload_param,
zero_init)."""


def _print_table(counts: ModelCounts, stage: int, gpus_per_node: int, nodes: int) -> None:
    total = counts.trainable + counts.frozen
    lines = [
        "Estimated memory needed for params, optim states and gradients (offloadd) for a:",
        f"HW: Setup with {nodes} node{'s' * (nodes > 1)}, {gpus_per_node} "
        f"GPU{'s' * (gpus_per_node > 1)} per node.",
        f"SW: Model with {total // 10**6}M total params, {counts.largest_unit // 10**6}M "
        "largest layer params.",
        "  per CPU  |  per GPU |   Options"]
    for offload_optimizer, offload_param, zero_init in _ROWS[stage]:
        figures = estimate(counts, _row_config(stage, offload_optimizer, offload_param),
                           gpus_per_node=gpus_per_node, nodes=nodes, zero_init=zero_init)
        options = [f"offload_optimizer={'cpu ' if offload_optimizer else 'none'}"]
        if stage == 3:
            options = [f"offload_param={'cpu ' if offload_param else 'none'}", *options,
                       f"zero_init={int(zero_init)}"]
        lines.append(f" {figures.host_nbytes / 2**30:7.2f}GB | "
                     f"{figures.device_nbytes / 2**30:6.2f}GB | {', '.join(options)}")
    print("\n".join(lines))


def estimate_zero3_model_states_mem_needs_all_cold(
        total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
        num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's ZeRO-3 table for a model of ``total_params`` (all trainable) whose
    largest unit has ``largest_layer_params``, in offloadd's figures."""
    del additional_buffer_factor  # the arena's own slack is in the figures
    counts = ModelCounts(trainable=int(total_params), frozen=0,
                         largest_unit=int(largest_layer_params))
    _print_table(counts, 3, num_gpus_per_node, num_nodes)


def estimate_zero3_model_states_mem_needs_all_live(
        model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
        additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's ZeRO-3 table for ``model`` (its units as the engine builds them; frozen
    parameters take no optimizer state), in offloadd's figures."""
    del additional_buffer_factor
    _print_table(ModelCounts.of(model), 3, num_gpus_per_node, num_nodes)


def estimate_zero2_model_states_mem_needs_all_cold(
        total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
        additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's ZeRO-2 table for a model of ``total_params`` (all trainable; its
    gradients flattened a whole model at a time, the worst case), in offloadd's figures."""
    del additional_buffer_factor
    counts = ModelCounts(trainable=int(total_params), frozen=0, largest_unit=int(total_params))
    _print_table(counts, 2, num_gpus_per_node, num_nodes)


def estimate_zero2_model_states_mem_needs_all_live(
        model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
        additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's ZeRO-2 table for ``model``, in offloadd's figures."""
    del additional_buffer_factor
    _print_table(ModelCounts.of(model), 2, num_gpus_per_node, num_nodes)


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """DeepSpeed's ``(total_params, largest_layer_params)``, the layer being the unit."""
    counts = ModelCounts.of(model)
    return counts.trainable + counts.frozen, counts.largest_unit


ZERO3_NAMES = ("estimate_zero3_model_states_mem_needs_all_live",
               "estimate_zero3_model_states_mem_needs_all_cold", "model_to_params")
"""``deepspeed.runtime.zero.stage3``'s estimators (the facade registers them there)."""
ZERO2_NAMES = ("estimate_zero2_model_states_mem_needs_all_live",
               "estimate_zero2_model_states_mem_needs_all_cold")
"""``deepspeed.runtime.zero.stage_1_and_2``'s."""
