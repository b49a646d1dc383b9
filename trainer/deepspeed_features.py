"""DeepSpeed features offloadd does not have, named as such when a config asks for them.

A DeepSpeed config may carry keys of features this engine does not implement
(pipeline parallelism, ZeRO++, MiCS, MoE expert parallelism, ...). They are
neither typos nor no-ops, so ``trainer.config`` refuses them with
``UnsupportedFeatureError`` naming the feature, unless the value is the
feature's own "off" value: a config copied from DeepSpeed's documentation with
``"zero_quantized_weights": false`` runs unchanged.

Keys of features DeepSpeed has and this engine accepts without acting on them are
listed in ``IGNORED_KEYS``; ``report_ignored`` names, in one line at rank 0, those a
config set to something that will not happen here (``SILENT_KEYS`` never: they are
honoured in substance or cannot matter).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any


class UnsupportedFeatureError(ValueError):
    """The config asks for a DeepSpeed feature that offloadd does not implement."""


@dataclass(frozen=True, kw_only=True)
class Feature:
    """A DeepSpeed feature behind one config key."""

    name: str
    """What DeepSpeed calls it, for the error message."""
    off_values: tuple[Any, ...] = ()
    """Values of the key that leave the feature disabled (accepted, no effect)."""
    enabled_flag: bool = False
    """The key is a section that is off when it says ``"enabled": false``."""
    instead: str = ""
    """What to use instead, when offloadd has an equivalent."""

    def is_off(self, value: Any) -> bool:
        if self.enabled_flag and isinstance(value, dict):
            return value.get("enabled", False) is False
        return any(value is off or (type(value) is type(off) and value == off)
                   for off in self.off_values)

    def how_to_turn_off(self) -> str:
        if self.enabled_flag:
            return 'remove the section or set "enabled": false'
        if self.off_values:
            return f"remove the key or set it to {self.off_values[0]!r}"
        return "remove the key"


_ZERO = "zero_optimization."

UNSUPPORTED_FEATURES: dict[str, Feature] = {
    "pipeline": Feature(name="DeepSpeed pipeline parallelism (PipelineModule)"),
    "tensor_parallel": Feature(name="DeepSpeed AutoTP tensor parallelism"),
    "sequence_parallel_size": Feature(name="DeepSpeed Ulysses sequence parallelism",
                                      off_values=(1,)),
    "use_data_before_expert_parallelism": Feature(
        name="DeepSpeed Mixture-of-Experts expert parallelism", off_values=(False,)),
    "sparse_attention": Feature(name="DeepSpeed sparse attention"),
    "sparse_gradients": Feature(name="DeepSpeed CSR sparse gradients", off_values=(False,)),
    "amp": Feature(name="DeepSpeed's Apex AMP integration", enabled_flag=True,
                   instead="bf16 or fp16"),
    "compression_training": Feature(name="the DeepSpeed compression library"),
    "weight_quantization": Feature(name="DeepSpeed weight quantization"),
    "quantize_training": Feature(name="DeepSpeed MoQ quantized training", enabled_flag=True),
    "data_efficiency": Feature(name="DeepSpeed data efficiency (curriculum, random-LTD)",
                               enabled_flag=True),
    "curriculum_learning": Feature(name="DeepSpeed curriculum learning", enabled_flag=True),
    "progressive_layer_drop": Feature(name="DeepSpeed progressive layer drop",
                                      enabled_flag=True),
    "eigenvalue": Feature(name="DeepSpeed eigenvalue computation", enabled_flag=True),
    "elasticity": Feature(name="DeepSpeed elastic training", enabled_flag=True),
    "autotuning": Feature(name="the DeepSpeed autotuner", enabled_flag=True),
    "hybrid_engine": Feature(name="the DeepSpeed RLHF hybrid engine", enabled_flag=True),
    "nebula": Feature(name="DeepSpeed Nebula checkpointing", enabled_flag=True),
    "graph_harvesting": Feature(name="DeepSpeed CUDA graph harvesting", off_values=(False,)),
    "fp16.fp16_master_weights_and_grads": Feature(
        name="DeepSpeed fp16 master weights and gradients", off_values=(False,)),
    _ZERO + "zero_quantized_weights": Feature(
        name="DeepSpeed ZeRO++ quantized weights (qwZ)", off_values=(False,)),
    _ZERO + "zero_quantized_nontrainable_weights": Feature(
        name="DeepSpeed ZeRO++ quantized frozen weights", off_values=(False,)),
    _ZERO + "zero_quantized_gradients": Feature(
        name="DeepSpeed ZeRO++ quantized gradients (qgZ)", off_values=(False,)),
    _ZERO + "zero_hpz_partition_size": Feature(
        name="DeepSpeed ZeRO++ hierarchical partitioning (hpZ)", off_values=(1,)),
    _ZERO + "zeropp_loco_param": Feature(name="DeepSpeed LoCo-ZeRO++", off_values=(None,)),
    _ZERO + "mics_shard_size": Feature(name="DeepSpeed MiCS sharding", off_values=(-1,)),
    _ZERO + "mics_hierarchical_params_gather": Feature(
        name="DeepSpeed MiCS hierarchical gathering", off_values=(False,)),
    _ZERO + "zenflow": Feature(name="DeepSpeed ZenFlow", off_values=(None,)),
    "scheduler.params.last_batch_iteration": Feature(
        name="starting a DeepSpeed schedule part-way", off_values=(-1,),
        instead="engine.load_checkpoint, which restores the schedule with the rest"),
}
"""Dotted config key -> the DeepSpeed feature it turns on."""

UNSUPPORTED_OPTIMIZERS = ("Adagrad", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
                          "Lion", "Muon", "MuAdam", "MuAdamW", "MuSGD")
"""DeepSpeed optimizer types other than Adam/AdamW (the daemon's optimizer runs Adam)."""

UNSUPPORTED_SCHEDULERS = ("LRRangeTest",)
"""DeepSpeed schedule types offloadd does not implement."""


def check_unsupported(data: dict[str, Any], prefix: str) -> None:
    """Drop keys of ``data`` (at dotted ``prefix``) that leave an unsupported DeepSpeed
    feature off; raise ``UnsupportedFeatureError`` for one that turns it on."""
    for key in list(data):
        feature = UNSUPPORTED_FEATURES.get(prefix + key)
        if feature is None:
            continue
        if not feature.is_off(data[key]):
            instead = f" (use {feature.instead})" if feature.instead else ""
            raise UnsupportedFeatureError(
                f"config key {prefix}{key}={data[key]!r}: {feature.name} is not supported by "
                f"offloadd; {feature.how_to_turn_off()}{instead}")
        del data[key]


def unsupported_keys_under(prefix: str) -> list[str]:
    """The unsupported features' key names directly under ``prefix`` (typo suggestions)."""
    return [key[len(prefix):] for key in UNSUPPORTED_FEATURES
            if key.startswith(prefix) and "." not in key[len(prefix):]]


def check_type(section: str, value: Any) -> None:
    """Refuse a DeepSpeed optimizer/scheduler ``type`` that offloadd does not implement."""
    known = UNSUPPORTED_OPTIMIZERS if section == "optimizer" else UNSUPPORTED_SCHEDULERS
    if isinstance(value, str) and value.lower() in {name.lower() for name in known}:
        raise UnsupportedFeatureError(
            f"config key {section}.type={value!r}: DeepSpeed's {value} {section} is not "
            f"supported by offloadd; {_SUPPORTED_TYPES[section]}")


_SUPPORTED_TYPES = {
    "optimizer": "use Adam or AdamW (what the daemon's optimizer service runs)",
    "scheduler": "use WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle",
}


# Keys (dotted, relative to the config root) that DeepSpeed understands and this engine
# accepts without acting on them. Those in SILENT_KEYS are honoured in substance or cannot
# change what a run computes or produces (logging cadence, buffer and bucket tuning,
# "gather on save", which save_model always does); they pass silently. The others, when
# set to a value that turns something on, are named in one line at rank 0
# (``report_ignored``): the user asked for something that will not happen here.
IGNORED_KEYS: dict[str, str] = {
    "steps_per_print": "logging cadence is the caller's business",
    "wall_clock_breakdown": "use the daemon's Prometheus metrics instead",
    "dump_state": "no DeepSpeed state dump here",
    "memory_breakdown": "no DeepSpeed memory report here",
    "prescale_gradients": "gradients are always summed then scaled once in the step",
    "gradient_predivide_factor": "gradients are always summed then scaled once in the step",
    "communication_data_type": "gradients are reduced in the training dtype",
    "zero_allow_untested_optimizer": "only Adam/AdamW are supported",
    "zero_force_ds_cpu_optimizer": "the daemon always runs the CPU optimizer",
    "tensorboard": "monitoring backends are not built in",
    "wandb": "monitoring backends are not built in",
    "csv_monitor": "monitoring backends are not built in",
    "comms_logger": "monitoring backends are not built in",
    "flops_profiler": "no flops profiler here",
    "aio": "the daemon owns NVMe IO settings (block size, queue depth)",
    "fp16.auto_cast": "inputs are cast to the training dtype unconditionally",
    "zero_optimization.contiguous_gradients": "gradients are always contiguous flat buffers",
    "zero_optimization.reduce_scatter": "stage 2/3 always reduce-scatter",
    "zero_optimization.reduce_bucket_size": "gradients are reduced per unit, not per bucket",
    "zero_optimization.allgather_partitions": "partitions are always all-gathered",
    "zero_optimization.allgather_bucket_size": "parameters are gathered per unit",
    "zero_optimization.round_robin_gradients": "partitions are contiguous per unit",
    "zero_optimization.sub_group_size": "the optimizer steps per unit",
    "zero_optimization.stage3_param_persistence_threshold": "every unit is partitioned",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "save_model / save_16bit_model always gather the 16-bit weights, unit by unit"
    ),
    "zero_optimization.memory_efficient_linear": "no linear-layer rewrite here",
    "zero_optimization.ignore_unused_parameters": "unused parameters are always tolerated",
    "zero_optimization.elastic_checkpoint": "checkpoints need the same world size",
    "zero_optimization.load_from_fp32_weights": "checkpoints always hold fp32 masters",
    "zero_optimization.offload_optimizer.pin_memory": "the daemon arena is always pinned",
    "zero_optimization.offload_optimizer.buffer_count": "the daemon sizes its own buffers",
    "zero_optimization.offload_optimizer.fast_init": "shards are created from the model",
    "zero_optimization.offload_optimizer.pipeline_read": "the daemon always pipelines IO",
    "zero_optimization.offload_optimizer.pipeline_write": "the daemon always pipelines IO",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (
        "the daemon's optimizer_cpus setting places Adam's threads, node-wide"
    ),
    "zero_optimization.offload_param.pin_memory": "the daemon arena is always pinned",
    "zero_optimization.offload_param.buffer_count": "the daemon sizes its own buffers",
    "zero_optimization.offload_param.buffer_size": "the daemon sizes its own buffers",
    "zero_optimization.offload_param.max_in_cpu": "offloadd.arena_size bounds DRAM use",
}

SILENT_KEYS = frozenset({
    "steps_per_print",  # Accelerate's keyword DeepSpeedPlugin writes it for the user
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "prescale_gradients",
    "gradient_predivide_factor",
    "aio",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_scatter",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.allgather_partitions",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.sub_group_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.memory_efficient_linear",
    "zero_optimization.ignore_unused_parameters",
    "zero_optimization.load_from_fp32_weights",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.fast_init",
    "zero_optimization.offload_optimizer.pipeline_read",
    "zero_optimization.offload_optimizer.pipeline_write",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu",
})
"""Keys of IGNORED_KEYS accepted without a word (see the comment above IGNORED_KEYS)."""


def turns_on(value: Any) -> bool:
    """Whether an ignored key's value asks for its feature: ``false``, ``null`` and a
    section that says ``"enabled": false`` or sets nothing on ask for nothing, so they
    cannot matter."""
    if isinstance(value, dict):
        if "enabled" in value:
            return value["enabled"] not in (False, None)
        return any(turns_on(item) for item in value.values())
    return value not in (False, None, 0, "")


def report_ignored(keys: list[str]) -> None:
    """One warning at rank 0 naming the ignored keys that asked for something, with why."""
    if not keys or _rank() != 0:
        return
    listed = "; ".join(f"{key} ({IGNORED_KEYS[key]})" for key in keys)
    warnings.warn(f"offloadd accepts but ignores these DeepSpeed config keys: {listed}",
                  UserWarning, stacklevel=3)


def _rank() -> int:
    """This process's rank: the launcher's ``RANK`` (the config is parsed before the
    process group exists), else torch.distributed's, else 0."""
    if os.environ.get("RANK"):
        return int(os.environ["RANK"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
