"""DeepSpeed config keys offloadd does not implement are named as DeepSpeed features, apart
from typos (issue 19, items 6 and 11); keys keep the path the user wrote."""

from __future__ import annotations

import re
from typing import Any

import pytest

from trainer.config import parse_config
from trainer.deepspeed_features import UNSUPPORTED_FEATURES, UnsupportedFeatureError


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nest(rest, value) if rest else value}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = (_merge(merged[key], value) if isinstance(value, dict)
                       and isinstance(merged.get(key), dict) else value)
    return merged


BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "scheduler": {"type": "WarmupLR", "params": {}}}


def _on_value(key: str) -> Any:
    feature = UNSUPPORTED_FEATURES[key]
    if feature.enabled_flag:
        return {"enabled": True}
    if feature.off_values and isinstance(feature.off_values[0], bool):
        return True
    if feature.off_values and isinstance(feature.off_values[0], int):
        return 8
    return {"stages": 2} if key == "pipeline" else {"some": "setting"}


@pytest.mark.parametrize("key", sorted(UNSUPPORTED_FEATURES))
def test_every_unsupported_feature_is_named_with_its_key(key: str) -> None:
    value = _on_value(key)
    with pytest.raises(UnsupportedFeatureError) as raised:
        parse_config(_merge(BASE, _nest(key, value)))
    message = str(raised.value)
    assert message.startswith(f"config key {key}={value!r}: ")
    assert UNSUPPORTED_FEATURES[key].name in message
    assert "is not supported by offloadd" in message
    assert "did you mean" not in message and "unknown" not in message


def test_zero_plus_plus_wording() -> None:
    with pytest.raises(UnsupportedFeatureError, match=re.escape(
            "config key zero_optimization.zero_quantized_weights=True: DeepSpeed ZeRO++ "
            "quantized weights (qwZ) is not supported by offloadd; remove the key or set it "
            "to False")):
        parse_config(_merge(BASE, {"zero_optimization": {"zero_quantized_weights": True}}))


@pytest.mark.parametrize(("key", "off"), [
    ("zero_optimization.zero_quantized_weights", False),
    ("zero_optimization.zero_quantized_gradients", False),
    ("zero_optimization.zero_hpz_partition_size", 1),
    ("zero_optimization.mics_shard_size", -1),
    ("amp", {"enabled": False}),
    ("progressive_layer_drop", {"enabled": False, "theta": 0.5}),
    ("sequence_parallel_size", 1),
    ("scheduler.params.last_batch_iteration", -1),
])
def test_a_feature_left_off_is_accepted(key: str, off: Any) -> None:
    config = parse_config(_merge(BASE, _nest(key, off)))
    assert config.zero_optimization.stage == 3


@pytest.mark.parametrize(("patch", "message"), [
    # a typo of a supported key
    ({"zero_optimization": {"stage3_prefech_bucket_size": 3}},
     "unknown config keys in zero_optimization: zero_optimization.stage3_prefech_bucket_size "
     "(did you mean zero_optimization.stage3_prefetch_bucket_size?)"),
    # a typo of an unsupported feature's key: a typo, with the feature named as unsupported
    ({"zero_optimization": {"zero_quantised_weights": True}},
     "unknown config keys in zero_optimization: zero_optimization.zero_quantised_weights "
     "(did you mean zero_optimization.zero_quantized_weights, a DeepSpeed feature offloadd "
     "does not support?)"),
    ({"pipline": {}}, "unknown config keys in the top level: pipline (did you mean pipeline, "
                      "a DeepSpeed feature offloadd does not support?)"),
])
def test_typos_are_told_apart_from_missing_features(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        parse_config(_merge(BASE, patch))
    assert not isinstance(raised.value, UnsupportedFeatureError)


@pytest.mark.parametrize(("section", "kind"), [("optimizer", "Lamb"), ("optimizer", "OneBitAdam"),
                                               ("optimizer", "lion"),
                                               ("scheduler", "LRRangeTest")])
def test_deepspeed_types_offloadd_lacks_are_named(section: str, kind: str) -> None:
    with pytest.raises(UnsupportedFeatureError,
                       match=re.escape(f"config key {section}.type={kind!r}: DeepSpeed's {kind} "
                                       f"{section} is not supported by offloadd; use ")):
        parse_config(_merge(BASE, {section: {"type": kind, "params": {}}}))


@pytest.mark.parametrize(("scheduler", "message"), [
    # the key path is the one in the file: scheduler.params.<key>
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_mn_mom": 0.8}},
     "unknown config keys in scheduler.params: scheduler.params.cycle_mn_mom (did you mean "
     "scheduler.params.cycle_min_mom?)"),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 1.0}},
     "config key scheduler.params.cycle_min_lr=None is invalid: accepted a number >= 0 "
     "(required by OneCycle)"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_first_step_size": "ten"}},
     "config key scheduler.params.cycle_first_step_size='ten' is invalid: accepted an integer"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_max_mom": 1.2}},
     "config key scheduler.params.cycle_max_mom=1.2 is invalid: accepted [0, 1)"),
    ({"type": "WarmupLR", "params": {"cycle_min_lr": 0.1}},
     "config key scheduler.params.cycle_min_lr belongs to OneCycle, but scheduler.type is "
     "WarmupLR"),
    ({"type": "WarmupCosineLR", "params": {"warmup_max_lr": 0.1, "total_num_steps": 10}},
     "config key scheduler.params.warmup_max_lr belongs to WarmupLR / WarmupDecayLR, but "
     "scheduler.type is WarmupCosineLR"),
    ({"type": "WarmupCosineLR", "params": {}},
     "config key scheduler.params.total_num_steps=None is invalid: accepted an int >= 1 "
     "(required by WarmupCosineLR)"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}},
     "config key scheduler.params.cos_min_ratio=2.0 is invalid: accepted [0, 1]"),
    ({"type": "WarmupCosine", "params": {}},
     "config key scheduler.type='WarmupCosine' is invalid (did you mean WarmupCosineLR?)"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
     "config key scheduler.params.warmup_max_lr='auto' cannot be derived"),
])
def test_scheduler_errors_name_the_key_as_written(scheduler: dict[str, Any],
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config({**BASE, "scheduler": scheduler})


def test_optimizer_typo_names_params_path() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "unknown config keys in optimizer.params: optimizer.params.weight_decy (did you "
            "mean optimizer.params.weight_decay?)")):
        parse_config({**BASE, "optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}})
