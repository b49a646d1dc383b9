"""False alarms: what a DeepSpeed config from the upstream guides prints here.

The transformers DeepSpeed guide's ZeRO-3 NVMe config (every key as the guide writes it)
parses without a word: its tuning keys cannot change what the run computes, and
``stage3_gather_16bit_weights_on_model_save`` is honoured (``save_model`` gathers).
Keys that ask for something that will not happen here are named in one warning, at rank
0 only. Accelerate's keyword ``DeepSpeedPlugin`` writes keys the user never did
(``steps_per_print``, ``stage3_gather_16bit_weights_on_model_save``): no warning about
those (tests/test_accelerate.py runs that plugin end to end).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from trainer.config import parse_config

GUIDE_ZERO3_NVME: dict[str, Any] = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
            "single_submit": False, "overlap_events": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
"""The guide's config with "auto" values as the HF Trainer fills them."""


def filled(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every "auto" replaced, as ``TrainingArguments`` does."""
    fills = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
             "warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10,
             "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6,
             "stage3_param_persistence_threshold": 1e4, "gradient_accumulation_steps": 1,
             "gradient_clipping": 1.0, "train_batch_size": 2,
             "train_micro_batch_size_per_gpu": 1, "enabled": False}

    def fill(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {inner: fill(item, inner) for inner, item in value.items()}
        return fills[key] if value == "auto" else value

    result: dict[str, Any] = fill(config, "")
    return result


def test_the_transformers_guides_zero3_nvme_config_parses_silently(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parsed = parse_config(filled(GUIDE_ZERO3_NVME))
    assert parsed.zero_optimization.offload_param.device == "nvme"


def test_keys_that_ask_for_something_are_named_once_at_rank_0(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = {**filled(GUIDE_ZERO3_NVME), "wall_clock_breakdown": True,
              "tensorboard": {"enabled": True, "output_path": "logs"},
              "flops_profiler": {"enabled": True},
              "activation_checkpointing": {"partition_activations": True}}
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning) as caught:
        parse_config(config)
    assert len(caught) == 1
    line = str(caught[0].message)
    for key in ("wall_clock_breakdown", "tensorboard", "flops_profiler"):
        assert key in line
    # honoured (trainer.zero.checkpointing), or meaningless here and silent
    for key in ("activation_checkpointing", "steps_per_print",
                "stage3_gather_16bit_weights_on_model_save", "aio"):
        assert key not in line
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_config(config)
