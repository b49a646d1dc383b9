"""DeepSpeed-shaped scripts run with ``import trainer as deepspeed``: the config from a
JSON path, from ``args.deepspeed_config`` (``add_config_arguments``), Hugging Face style
``"auto"`` values, and ``deepspeed.comm``'s common calls. One process, no daemon."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import make_batch, make_model, run_ranks

import trainer as deepspeed
from trainer.config import parse_config

CONFIG: dict[str, Any] = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 1},
}


def train_two_steps(rank: int, world: int, how: str, tmp: str) -> list[float]:
    """Two steps on one batch (so the loss falls), the config given ``how``."""
    path = Path(tmp) / "ds_config.json"
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    model = make_model()
    if how == "path":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=str(path))
    else:
        args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
        engine, *_ = deepspeed.initialize(args=args, model=model,
                                          model_parameters=model.parameters())
    assert deepspeed.comm.get_rank() == rank and deepspeed.comm.get_world_size() == world
    losses = []
    for _step in range(2):
        loss = engine(*make_batch(0, 0, rank, engine.train_micro_batch_size_per_gpu()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def both_ways(rank: int, world: int, tmp: str) -> tuple[list[float], list[float]]:
    return train_two_steps(rank, world, "path", tmp), train_two_steps(rank, world, "args", tmp)


def test_a_json_path_and_args_deepspeed_config_train_alike(config_dir: Path) -> None:
    [(from_path, from_args)] = run_ranks(both_ways, 1, str(config_dir))
    assert from_path == from_args and from_path[1] < from_path[0]


def test_a_config_in_both_args_and_config_is_refused(config_dir: Path) -> None:
    args = argparse.Namespace(deepspeed_config=str(config_dir / "ds_config.json"))
    with pytest.raises(ValueError, match="only one"):
        deepspeed.initialize(args=args, model=make_model(), config=CONFIG)


def test_a_missing_deepspeed_config_file_names_the_attribute(tmp_path: Path) -> None:
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"args\.deepspeed_config"):
        deepspeed.initialize(args=args, model=make_model())
    with pytest.raises(ValueError, match="deepspeed_config attribute"):
        deepspeed.initialize(args=argparse.Namespace(), model=make_model())


def test_auto_batch_sizes_are_derived_like_unset_ones() -> None:
    config = parse_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                           "gradient_accumulation_steps": "auto",
                           "zero_optimization": {"stage": 3,
                                                 "stage3_prefetch_bucket_size": "auto"}})
    sizes = config.batch_sizes(world_size=2)
    assert (sizes.train_batch_size, sizes.gradient_accumulation_steps) == (4, 1)
    assert config.zero_optimization.stage3_prefetch_bucket_size == 50_000_000


@pytest.mark.parametrize(("section", "key"), [
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
    ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
])
def test_auto_that_cannot_be_derived_names_the_key(section: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"config key {key}='auto'.*set a value"):
        parse_config({"train_micro_batch_size_per_gpu": 2, **section})


def test_auto_in_both_batch_keys_says_what_to_set() -> None:
    config = parse_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu.*'auto'"):
        config.batch_sizes(world_size=1)


def test_comm_calls_answer_as_a_world_of_one() -> None:
    """With no group, or the world-of-one group an in-process ``initialize`` leaves behind.
    Multi-rank use is covered by tests/scripts/ds_train_gpt.py in test_multinode."""
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()) == (0, 1)
    total = torch.tensor([3.0])
    deepspeed.comm.all_reduce(total)
    gathered = [torch.zeros(1)]
    deepspeed.comm.all_gather(gathered, torch.tensor([5.0]))
    deepspeed.comm.broadcast(total, src=0)
    deepspeed.comm.barrier()
    assert (total.item(), gathered[0].item()) == (3.0, 5.0)


def test_load_checkpoint_takes_deepspeeds_options(tmp_path: Path) -> None:
    """By name or in DeepSpeed's order; what each restores is
    test_checkpoint_property's (``assert_partial_load``)."""
    engine, *_ = deepspeed.initialize(model=make_model(), config=CONFIG)
    try:
        engine.save_checkpoint(tmp_path, tag="t", save_latest=False)
        assert not (tmp_path / "latest").exists()
        assert engine.load_checkpoint(tmp_path) == (None, {})
        path, _ = engine.load_checkpoint(tmp_path, tag="t", load_optimizer_states=True,
                                         load_lr_scheduler_states=True,
                                         load_module_strict=True, load_module_only=False)
        assert path == str(tmp_path / "t")
        assert engine.load_checkpoint(tmp_path, "t", True, False, False, True)[0] == path
        with pytest.raises(TypeError, match="load_everything"):
            engine.load_checkpoint(tmp_path, tag="t", load_everything=True)
        with pytest.raises(TypeError, match="load_optimizer_states='no'"):
            engine.load_checkpoint(tmp_path, tag="t", load_optimizer_states="no")
    finally:
        engine.close()


def test_a_scheduler_built_by_callable_steps_without_torchs_order_warning() -> None:
    """HF Trainer with a config optimizer and no scheduler section passes
    ``lr_scheduler=`` a callable that builds a torch scheduler over the optimizer it is
    given (the engine's ``OptimizerView``). The engine steps, never the view: torch's
    first ``scheduler.step()`` warned that it ran before ``optimizer.step()``. Now none,
    and the learning rates follow torch's own LambdaLR over a stepped AdamW."""
    import warnings

    from trainer.integrations.ds_facade import initialize

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    model = make_model()
    engine, _view, _, scheduler = initialize(model=model, model_parameters=model.parameters(),
                                             config=CONFIG, lr_scheduler=schedule)
    reference_optimizer = torch.optim.AdamW(make_model().parameters(), lr=1e-2)
    reference = schedule(reference_optimizer)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _step in range(2):
                loss = engine(*make_batch(0, 0, 0, 4))
                engine.backward(loss)
                engine.step()
                reference_optimizer.step()
                reference.step()
                assert scheduler.get_last_lr() == reference.get_last_lr()
    finally:
        engine.close()
    assert not [w for w in caught if "optimizer.step()" in str(w.message)], \
        [str(w.message) for w in caught]


def free_memory_then_prepare_again(rank: int, world: int) -> list[bool]:
    """Accelerate's ``free_memory`` calls ``engine.destroy()`` (DeepSpeed's), then a new
    ``prepare`` takes the same model: the weights it left are the trained ones."""
    import trainer.hf  # noqa: F401  - the line an Accelerate script adds, first

    # isort: split
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    from trainer.state.checkpoint import consolidate_fp32_state_dict

    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    PartialState(cpu=True)  # gloo first, as accelerate_run.py does on a CPU-only machine
    model = make_model()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(engine(*make_batch(0, 0, rank, 4)))
    optimizer.step()
    trained = consolidate_fp32_state_dict(engine.engine)
    accelerator.free_memory()
    engine, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    taken = consolidate_fp32_state_dict(engine.engine)
    return [torch.equal(taken[name], value) for name, value in trained.items()]


def test_accelerate_free_memory_destroys_the_engine_and_keeps_the_weights() -> None:
    pytest.importorskip("accelerate", reason="the hf extra is not installed")
    same = run_ranks(free_memory_then_prepare_again, 2)[0]
    assert same and all(same), same


def test_the_engine_answers_deepspeeds_step_and_config_accessors() -> None:
    """What training loops read from DeepSpeed's engine besides ``global_steps``
    (Megatron-DeepSpeed's ``global_samples``, loggers' ``skipped_steps`` and ``get_mom``,
    ``was_step_applied``, ``training_dataloader``, the ``zero_*``/batch getters): each
    answers from the run, in fp16 where one step overflows. Before: AttributeError."""
    from trainer.integrations.ds_facade import initialize

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.95]}},
              "fp16": {"enabled": True, "initial_scale_power": 4},
              "gradient_clipping": 0.5, "steps_per_print": 7,
              "zero_optimization": {"stage": 2}}
    data = [make_batch(0, index, 0, 1) for index in range(16)]
    model = make_model()
    engine, _, loader, _ = initialize(model=model, model_parameters=model.parameters(),
                                      config=config, training_data=data)
    applied = []
    try:
        assert engine.training_dataloader is loader
        for step in range(3):
            for micro in range(2):
                loss = engine(*make_batch(step, micro, 0, 4))
                if step == 1:
                    loss = loss * float("inf")  # the window's gradients overflow
                engine.backward(loss)
                engine.step()
                applied.append(engine.was_step_applied())
        assert applied == [False, True, False, False, False, True]
        assert (engine.global_steps, engine.skipped_steps, engine.global_samples) == (3, 1, 24)
        assert engine.get_mom() == [(0.8, 0.95)]
        assert engine.get_batch_info() == (8, 4, 2) and engine.gradient_clipping() == 0.5
        assert engine.steps_per_print() == 7 and not engine.wall_clock_breakdown()
        assert (engine.dp_world_size, engine.mp_world_size) == (1, 1)
        assert not (engine.zero_offload_optimizer() or engine.zero_offload_param()
                    or engine.zero_cpu_offload() or engine.zero_optimization_partition_weights())
        with pytest.raises(AttributeError, match="DeepSpeedEngine has no attribute 'no_such'"):
            engine.no_such  # noqa: B018
    finally:
        engine.close()


def test_trl_reference_model_config_with_dotted_keys() -> None:
    """TRL's ``prepare_deepspeed`` (its DPO/GRPO reference model under ZeRO-3) copies the
    Accelerate plugin's config and adds ``"zero_optimization.reduce_bucket_size"``-style
    top-level keys, then ``deepspeed.initialize(model=model, config=config_kwargs)`` with no
    optimizer. Before: unknown top-level keys. Now each is read at its path where the
    section leaves it unset; where the section sets it, the section's value stands (all
    DeepSpeed reads) with a warning; a dotted key naming no config key is still refused.
    The reference model's forward then equals the plain model's."""
    import warnings

    from trainer.integrations.ds_facade import initialize

    hidden = 13
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000},
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
        "zero_optimization.stage3_max_live_parameters": 2_000_000,
        "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden * hidden,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = parse_config(config)
    assert parsed.zero_optimization.stage3_max_live_parameters == 2_000_000
    assert parsed.zero_optimization.stage3_prefetch_bucket_size == 1000
    assert [str(w.message) for w in caught if "stage3_prefetch_bucket_size" in str(w.message)]
    assert "zero_optimization.reduce_bucket_size" in config  # the caller's dict is unchanged
    with pytest.raises(ValueError, match="no_such_key"), pytest.warns(UserWarning):
        parse_config({**config, "zero_optimization.no_such_key": 1})

    model = make_model()
    expected = model(*make_batch(0, 0, 0, 4)).item()
    with pytest.warns(UserWarning, match="both set"):
        engine, *_ = initialize(model=model, config=config)
    try:
        engine.eval()
        with torch.no_grad():
            assert engine(*make_batch(0, 0, 0, 4)).item() == pytest.approx(expected, rel=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_model_without_an_optimizer_below_stage_3_is_the_module_on_the_device(
        stage: int) -> None:
    """TRL's reference model when the policy is not on ZeRO-3 (``prepare_deepspeed``: stage 0,
    the user's config otherwise, no optimizer), or Accelerate's ``prepare(model)`` alone:
    DeepSpeed wraps the module on the device in the training dtype, with no optimizer.
    Before: a training engine with a default AdamW, its optimizer state offloaded (a private
    daemon started for it). Now the module itself in bf16 (its outputs are the bf16
    module's), no optimizer, and a training call is refused."""
    from trainer.integrations.ds_facade import DeepSpeedEngine, initialize
    from trainer.zero.engine import EngineInferenceError

    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    features, labels = make_batch(0, 0, 0, 4)
    expected = make_model().bfloat16()(features.bfloat16(), labels)
    engine, optimizer, _, scheduler = initialize(model=make_model(), config=config)
    try:
        assert isinstance(engine, DeepSpeedEngine) and optimizer is None and scheduler is None
        assert engine.zero_optimization_stage() == stage and engine.bfloat16_enabled()
        assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
        assert engine.head is engine.module.head  # the model's names, through the engine
        engine.eval()
        with torch.no_grad():
            loss = engine(features.bfloat16().to(engine.device), labels.to(engine.device))
        assert torch.equal(loss.cpu(), expected.detach())
        with pytest.raises(EngineInferenceError, match="no optimizer"):
            engine.backward(loss)
        with pytest.raises(AttributeError, match="given no optimizer"):
            engine.get_lr()
    finally:
        engine.close()
