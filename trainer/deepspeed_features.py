"""DeepSpeed features offloadd does not have, named as such when a config asks for them.

A DeepSpeed config may carry keys of features this engine does not implement
(pipeline parallelism, ZeRO++, MiCS, MoE expert parallelism, ...). They are
neither typos nor no-ops, so ``trainer.config`` refuses them with
``UnsupportedFeatureError`` naming the feature, unless the value is the
feature's own "off" value: a config copied from DeepSpeed's documentation with
``"zero_quantized_weights": false`` runs unchanged.
"""

from __future__ import annotations

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
