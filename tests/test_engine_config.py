"""Engine unit tests in one process (world of one): config, schedules, scaling, units, errors."""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from _dist import (
    Block,
    TinyNet,
    base_config,
    make_batch,
    make_model,
    max_relative_error,
    reference_train,
)

import trainer
from trainer.config import parse_config
from trainer.zero.partition import build_units
from trainer.zero.precision import DynamicLossScaler
from trainer.zero.scheduler import build_scheduler

# ----------------------------------------------------------------------------- config


def test_parse_deepspeed_config_round_trip(tmp_path: Path) -> None:
    source = base_config(
        gradient_clipping=1.0,
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 10,
                                                        "total_num_steps": 100}},
        zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme",
                                                             "nvme_path": "/tmp/x"},
                           "offload_param": {"device": "cpu"},
                           "stage3_prefetch_bucket_size": 5e7},
        bf16={"enabled": True},
        offloadd={"socket": "/run/offloadd.sock", "arena_size": 1 << 30},
    )
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(source))
    config = parse_config(str(path))
    assert config.zero_optimization.stage == 3
    assert config.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert config.zero_optimization.offload_optimizer.nvme_path == "/tmp/x"
    assert config.optimizer.betas == (0.9, 0.99)
    assert config.scheduler is not None and config.scheduler.total_num_steps == 100
    assert config.dtype_name == "bfloat16"
    assert config.offloadd.arena_size == 1 << 30


def test_offloaded_parameters_without_an_offloaded_optimizer_only_without_training() -> None:
    """An engine that trains needs the optimizer offloaded where the parameters are (its
    step writes them); one without an optimizer (ZeRO-Inference configs set only
    ``offload_param``) gets its parameters through the daemon all the same."""
    config = parse_config(base_config(zero_optimization={
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/swap"},
        "stage3_prefetch_bucket_size": 0.9 * 1000 * 1000 + 0.5}))
    assert config.zero_optimization.stage3_prefetch_bucket_size == 900_000  # rounded down
    with pytest.raises(ValueError, match=r"unless offload_optimizer.device is cpu or nvme"):
        config.zero_optimization.check_trains()
    inference = config.zero_optimization.for_inference()
    assert inference.offloaded and inference.offload_optimizer.device == "nvme"
    assert inference.offload_optimizer.nvme_path == "/swap"
    with pytest.raises(ValueError, match=r"stage3_max_live_parameters=-1\.5"):
        parse_config(base_config(zero_optimization={"stage3_max_live_parameters": -1.5}))


def test_deepspeeds_deprecated_keys_are_read_as_deepspeed_reads_them() -> None:
    """Configs from DeepSpeed's tutorials carry old names it still takes (CIFAR-10's
    ``"cpu_offload": false``): read the same way, each with a warning naming the new key."""
    with pytest.warns(UserWarning) as caught:
        config = parse_config(base_config(
            bfloat16={"enabled": True},
            zero_optimization={"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                               "cpu_offload_use_pin_memory": True,
                               "stage3_gather_fp16_weights_on_model_save": False}))
    assert config.dtype_name == "bfloat16"
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert config.zero_optimization.offload_param.device == "cpu"
    said = " | ".join(str(warning.message) for warning in caught)
    for old in ("bfloat16", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory",
                "stage3_gather_fp16_weights_on_model_save"):
        assert f"{old} is DeepSpeed's deprecated name" in said, old
    with pytest.warns(UserWarning, match="read as no zero_optimization.offload_optimizer"):
        off = parse_config(base_config(zero_optimization={"stage": 2, "cpu_offload": False}))
    assert off.zero_optimization.offload_optimizer.device == "none"


@pytest.mark.parametrize(("patch", "message"), [
    ({"zero_optimization": {"stgae": 2}}, "did you mean zero_optimization.stage"),
    ({"train_batch_szie": 8}, "did you mean train_batch_size"),
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.cpu_offload and zero_optimization.offload_optimizer are both set"),
    ({"zero_optimization": {"cpu_offload": "yes"}}, "zero_optimization.cpu_offload='yes'"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
    ({"optimizer": {"type": "SGD", "params": {}}}, "optimizer.type='SGD'"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, "betas"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "device='gpu'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "'none' unless zero_optimization.stage is 3"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps"),
    ({"zero_optimization": {"stage": "3"}}, "an integer"),
    ({"bf16": {"enabled": "yes"}}, "true or false"),
])
def test_invalid_config_names_the_key(patch: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(base_config(**patch))


def test_ignored_deepspeed_keys_that_ask_for_something_warn_in_one_line() -> None:
    with pytest.warns(UserWarning, match="ignores these DeepSpeed config keys") as caught:
        parse_config(base_config(steps_per_print=10, wall_clock_breakdown=True,
                                 flops_profiler={"enabled": True}))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "wall_clock_breakdown" in message and "flops_profiler" in message
    assert "steps_per_print" not in message  # cannot matter: accepted silently


@pytest.mark.parametrize(("keys", "world", "expected"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_batch_size": 16}, 4, (16, 4, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),
])
def test_batch_sizes_derived_like_deepspeed(keys: dict[str, int], world: int,
                                            expected: tuple[int, int, int]) -> None:
    sizes = parse_config(keys).batch_sizes(world)
    assert (sizes.train_batch_size, sizes.micro_batch_size,
            sizes.gradient_accumulation_steps) == expected


@pytest.mark.parametrize(("keys", "message"), [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "not divisible"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2}, "must equal"),
    ({}, "train_batch_size or train_micro_batch_size_per_gpu"),
])
def test_inconsistent_batch_sizes_raise(keys: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(keys).batch_sizes(2)


# ------------------------------------------------------------------ schedules, scaling


class _Groups:
    def __init__(self) -> None:
        self.param_groups = [{"lr": 123.0}]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_schedule_matches_deepspeed_formula(warmup_type: str) -> None:
    config = parse_config(base_config(scheduler={"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5,
        "warmup_type": warmup_type, "total_num_steps": 15}}))
    groups = _Groups()
    schedule = build_scheduler(groups, config.scheduler)
    assert schedule is not None and groups.param_groups[0]["lr"] == 0.001
    seen = []
    for _ in range(16):
        schedule.step()
        seen.append(groups.param_groups[0]["lr"])
    it = 2
    gamma = math.log(it + 1) / math.log(5) if warmup_type == "log" else it / 5
    assert seen[it] == pytest.approx(0.001 + 0.009 * gamma)
    assert seen[5] == pytest.approx(0.001 + 0.009 * (15 - 5) / 10)
    assert seen[15] == pytest.approx(0.001)


def test_dynamic_loss_scaler_hysteresis_and_growth() -> None:
    config = parse_config(base_config(fp16={"enabled": True, "initial_scale_power": 4,
                                            "hysteresis": 2, "loss_scale_window": 3}))
    scaler = DynamicLossScaler(config.fp16)
    assert scaler.scale == 16
    scaler.update(True)
    assert scaler.scale == 16  # first overflow eaten by hysteresis
    scaler.update(True)
    assert scaler.scale == 8
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 16


# --------------------------------------------------------------------------- units


def test_units_by_class_and_by_size() -> None:
    model = TinyNet()
    by_class = build_units(model, parse_config(base_config()).units, num_parts=2, part_index=1)
    assert [unit.name for unit in by_class] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert all(unit.padded_numel % 2 == 0 for unit in by_class)
    assert sum(unit.numel for unit in by_class) == sum(p.numel() for p in model.parameters())
    sized = build_units(TinyNet(), parse_config({"units": {"min_num_params": 700}}).units,
                        num_parts=3, part_index=0)
    assert len(sized) == 4 and all(unit.padded_numel % 3 == 0 for unit in sized)


def test_tied_parameter_belongs_to_root() -> None:
    model = TinyNet(width=5, classes=5)
    first, second = model.blocks[0], model.blocks[1]
    assert isinstance(first, Block) and isinstance(second, Block)
    second.fc1.weight = first.fc1.weight  # share across two units
    second.fc1.bias = first.fc1.bias
    units = build_units(model, parse_config(base_config()).units, num_parts=1, part_index=0)
    root_names = [slot.name for slot in units[0].slots]
    assert "blocks.0.fc1.weight" in root_names
    assert all(slot.param is not first.fc1.weight
               for unit in units[1:] for slot in unit.slots)


def test_unknown_unit_class_lists_present_classes() -> None:
    with pytest.raises(ValueError, match=r"units.module_classes.*Block"):
        build_units(TinyNet(), parse_config({"units": {"module_classes": ["GPT2Block"]}}).units,
                    num_parts=1, part_index=0)


# ---------------------------------------------------------------- single process


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_single_process_matches_torch_adamw(stage: int) -> None:
    config = base_config(zero_optimization={"stage": stage}, gradient_accumulation_steps=2,
                         gradient_clipping=0.3)
    reference = reference_train(config, steps=4, world_size=1)
    model = make_model()
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    for step in range(4):
        for micro in range(2):
            engine.backward(engine(*make_batch(step, micro, 0, 4)))
            engine.step()
    assert engine.global_steps == 4 and engine.micro_steps == 8
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    assert max_relative_error(consolidate_fp32_state_dict(engine), reference) < 1e-5


def test_accumulation_boundary_and_lr() -> None:
    config = base_config(gradient_accumulation_steps=3,
                         scheduler={"type": "WarmupLR", "params": {
                             "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                             "warmup_type": "linear"}})
    engine, optimizer, _, schedule = trainer.initialize(model=make_model(), config=config)
    assert schedule is not None and engine.get_lr() == [0.0]
    boundaries = []
    for micro in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(*make_batch(0, micro, 0, 4)))
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and optimizer.step_count == 2
    assert engine.get_lr() == [pytest.approx(0.01 * 1 / 4)]


def test_fp16_overflow_skips_step_and_lowers_scale() -> None:
    config = base_config(fp16={"enabled": True, "initial_scale_power": 40, "hysteresis": 1})
    engine, optimizer, _, _ = trainer.initialize(model=make_model(), config=config)
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(*make_batch(0, 0, 0, 4)))
    engine.step()
    assert optimizer.skipped_steps == 1 and engine.loss_scale == 2.0**39
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))


def test_bf16_single_process_trains() -> None:
    engine, _, _, _ = trainer.initialize(model=make_model(),
                                         config=base_config(bf16={"enabled": True}))
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    losses = []
    for step in range(30):
        loss = engine(*make_batch(step % 2, 0, 0, 16))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5])


# ------------------------------------------------------------------------ bad input


def test_model_without_parameters_is_rejected() -> None:
    with pytest.raises(ValueError, match="has no parameters"):
        trainer.initialize(model=torch.nn.ReLU(), config=base_config())


def test_frozen_model_is_rejected() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="no trainable parameters"):
        trainer.initialize(model=model, model_parameters=[], config=base_config())


def test_optimizer_object_is_rejected() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="through the config"):
        trainer.initialize(model=model, config=base_config(),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_unreachable_daemon_names_the_socket_key(tmp_path: Path) -> None:
    config = base_config(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}},
                         offloadd={"socket": str(tmp_path / "nobody.sock"),
                                   "connect_timeout_s": 2})
    with pytest.raises(RuntimeError, match=r"offloadd\.socket"):
        trainer.initialize(model=make_model(), config=config)


def test_world_size_one_needs_no_process_group() -> None:
    assert "WORLD_SIZE" not in os.environ or os.environ["WORLD_SIZE"] == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine, _, _, _ = trainer.initialize(model=make_model(), config=base_config())
    assert engine.collectives.world_size == 1


def test_nvme_without_path_defaults_to_temp_dir_with_warning() -> None:
    from trainer.offload.daemon_connect import _swap_dirs

    config = parse_config(base_config(zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}))
    existed = (Path(tempfile.gettempdir()) / "offloadd-swap-jobx").exists()
    with pytest.warns(UserWarning, match="without nvme_path: swapping to .*offloadd-swap-jobx"):
        paths = _swap_dirs(config, "jobx")
    ((path, made),) = paths.items()
    assert path.endswith("offloadd-swap-jobx")
    assert made == ([] if existed else [path])  # the daemon removes what it made
    os.rmdir(path)
