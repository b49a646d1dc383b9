"""Checkpoints that reshard (issue 19, items 5 and 10): saved at 2 gloo ranks after 3
steps, resumed at 1 rank and at 2 ranks; the next 3 steps match the uninterrupted 2-rank
run (parameters, fp32 master, both Adam moments, step counts, LR scheduler). The 1-rank
run's checkpoint loads back at 2 ranks as the same state.

At 1 rank the global batch is the same (2 accumulated micro-batches: rank 0's then rank
1's), so only the gradients' summation order differs from the 2-rank run; at 2 ranks the
resume is bit-exact. Stage 3 in-process and stage 2 with the optimizer in the daemon.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model, max_relative_error, run_ranks, shared_daemon

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.state.export import ExportError, export_checkpoint
from trainer.state.hf_checkpoint import CheckpointError

pytestmark = pytest.mark.slow

SAVE_AT, STEPS = 3, 6
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                                  "total_num_steps": 10}}
CONFIGS = {
    "stage3": base_config(zero_optimization={"stage": 3}, gradient_clipping=0.5,
                          scheduler=SCHEDULER),
    "stage2-daemon": base_config(zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "cpu"}}, scheduler=SCHEDULER),
}


def _with_daemon(config: dict[str, Any], socket_path: str, job: str) -> dict[str, Any]:
    """The shared daemon of a 2-rank run; alone, the engine starts a private one."""
    if "offload_optimizer" not in config["zero_optimization"] or not socket_path:
        return config
    return {**config, "offloadd": {"socket": socket_path, "job": job, "arena_size": 16 << 20}}


def _step(engine: Any, step: int, rank: int, world: int) -> float:
    """One optimizer step on the global batch of 2 ranks x 4 samples."""
    losses = []
    for micro in range(engine.gradient_accumulation_steps()):
        data_rank = rank if world == 2 else micro  # one rank plays both ranks' micro-batches
        loss = engine(*make_batch(step, 0, data_rank, 4))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def _state(engine: Any) -> dict[str, Any]:
    """Everything the next step depends on, gathered to rank 0 (fp32 master and moments)."""
    moments: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        state = engine.backend.get_state(unit.index)
        for kind in ("exp_avg", "exp_avg_sq"):
            full = torch.empty(unit.padded_numel) if unit.part_numel != unit.padded_numel \
                else None
            if full is not None:
                engine.collectives.all_gather(full, state[kind])
            moments[f"{unit.name}.{unit.index}.{kind}"] = (full if full is not None
                                                            else state[kind])[:unit.numel]
    return {"params": consolidate_fp32_state_dict(engine), "moments": moments,
            "global_steps": engine.global_steps, "adam_steps": engine.optimizer.step_count,
            "lr": engine.get_lr()}


def save_and_continue(rank: int, world: int, root: str) -> dict[str, Any]:
    results = {}
    with shared_daemon(rank, None) as socket_path:
        for name, config in CONFIGS.items():
            engine, _, _, _ = trainer.initialize(
                model=make_model(0), config=_with_daemon(config, socket_path, f"s{name}"))
            for step in range(SAVE_AT):
                _step(engine, step, rank, world)
            engine.save_checkpoint(Path(root) / name, client_state={"data_step": SAVE_AT})
            losses = [_step(engine, step, rank, world) for step in range(SAVE_AT, STEPS)]
            results[name] = {**_state(engine), "losses": losses}
            engine.close()
            results[f"{name}-resumed"] = resume(rank, world, root, name, socket_path)
    return results


def _engine(name: str, world: int, socket_path: str, job: str) -> Any:
    config = {**CONFIGS[name], "gradient_accumulation_steps": 2 // world}
    engine, _, _, _ = trainer.initialize(
        model=make_model(1), config=_with_daemon(config, socket_path, job))
    return engine


def resume(rank: int, world: int, root: str, name: str, socket_path: str) -> dict[str, Any]:
    engine = _engine(name, world, socket_path, f"r{name}{world}")
    try:
        _, client_state = engine.load_checkpoint(Path(root) / name)
        assert client_state == {"data_step": SAVE_AT}
        assert engine.global_steps == SAVE_AT and engine.optimizer.step_count == SAVE_AT
        losses = [_step(engine, step, rank, world) for step in range(SAVE_AT, STEPS)]
        if world == 1:  # for load_at_two: a checkpoint written by one rank
            engine.save_checkpoint(Path(root) / f"{name}-one")
        return {**_state(engine), "losses": losses}
    finally:
        engine.close()


def resume_alone(rank: int, world: int, root: str) -> dict[str, Any]:
    return {name: resume(rank, world, root, name, "") for name in CONFIGS}


def load_at_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """The 1-rank checkpoint loaded at 2 ranks, before any step."""
    results = {}
    with shared_daemon(rank, None) as socket_path:
        for name in CONFIGS:
            engine = _engine(name, world, socket_path, f"t{name}")
            engine.load_checkpoint(Path(root) / f"{name}-one")
            results[name] = _state(engine)
            engine.close()
    return results


def test_checkpoint_saved_at_two_ranks_resumes_at_one_and_two() -> None:
    with tempfile.TemporaryDirectory() as root:
        two = run_ranks(save_and_continue, 2, root)
        one = run_ranks(resume_alone, 1, root)[0]
        up = run_ranks(load_at_two, 2, root)[0]
    for name in CONFIGS:
        straight, again = two[0][name], two[0][f"{name}-resumed"]
        alone = one[name]
        # at 2 ranks: bit-exact
        for key in ("params", "moments"):
            for tensor_name, value in straight[key].items():
                assert torch.equal(value, again[key][tensor_name]), (name, tensor_name)
        assert straight["losses"] == again["losses"], name
        # at 1 rank: the same steps up to the gradients' summation order
        rank_mean = [(a + b) / 2 for a, b in zip(two[0][name]["losses"],
                                                 two[1][name]["losses"], strict=True)]
        assert max(abs(a - b) for a, b in zip(alone["losses"], rank_mean, strict=True)) < 1e-5
        assert max_relative_error(alone["params"], straight["params"]) < 1e-5, name
        assert max_relative_error(alone["moments"], straight["moments"]) < 1e-4, name
        for result in (again, alone):
            assert result["global_steps"] == straight["global_steps"] == STEPS, name
            assert result["adam_steps"] == straight["adam_steps"] == STEPS, name
            assert result["lr"] == straight["lr"], name
        # and back up: the 1-rank checkpoint at 2 ranks is the same state, bit for bit
        for key in ("params", "moments"):
            for tensor_name, value in alone[key].items():
                assert torch.equal(value, up[name][key][tensor_name]), (name, tensor_name)
        assert up[name]["global_steps"] == STEPS and up[name]["lr"] == alone["lr"], name


def _frozen_model(seed: int) -> torch.nn.Module:
    """``make_model(seed)`` whose input layer is seed 0's and frozen (a fine-tune's base)."""
    model = make_model(seed)
    model.inp.load_state_dict(make_model(0).inp.state_dict())
    model.inp.requires_grad_(False)
    return model


def save_without_frozen(rank: int, world: int, root: str) -> dict[str, Any]:
    engine, _, _, _ = trainer.initialize(model=_frozen_model(0), config=CONFIGS["stage3"])
    try:
        for step in range(SAVE_AT):
            _step(engine, step, rank, world)
        engine.save_checkpoint(root, exclude_frozen_parameters=True)
        losses = [_step(engine, step, rank, world) for step in range(SAVE_AT, STEPS)]
        return {"params": consolidate_fp32_state_dict(engine), "losses": losses}
    finally:
        engine.close()


def resume_without_frozen(rank: int, world: int, root: str) -> dict[str, Any]:
    engine, _, _, _ = trainer.initialize(model=_frozen_model(1), config={
        **CONFIGS["stage3"], "gradient_accumulation_steps": 2})
    try:
        with pytest.raises(CheckpointError, match="load_module_strict=False"):
            engine.load_checkpoint(root)
        engine.load_checkpoint(root, load_module_strict=False)
        loaded = consolidate_fp32_state_dict(engine)
        losses = [_step(engine, step, rank, world) for step in range(SAVE_AT, STEPS)]
        params = consolidate_fp32_state_dict(engine)
    finally:
        engine.close()
    # an engine without an optimizer (every unit frozen) reads the trained units the
    # checkpoint holds, resharded, and keeps the base for those it left out
    evaluator, _, _, _ = trainer.initialize(model=_frozen_model(2), config=CONFIGS["stage3"],
                                            inference=True)
    try:
        evaluator.load_checkpoint(root, load_module_strict=False, load_optimizer_states=False)
        evaluated = consolidate_fp32_state_dict(evaluator)
    finally:
        evaluator.close()
    return {"params": params, "losses": losses, "loaded": loaded, "evaluated": evaluated}


def test_a_checkpoint_without_its_frozen_parameters_resumes_at_another_world_size() -> None:
    """Saved at 2 ranks with ``exclude_frozen_parameters`` (what HF Trainer asks for a PEFT
    model), resumed at 1 rank over a model with the same frozen base: the frozen units are
    skipped in the reshard and keep the base values; a strict load and an export (not a
    whole model) are refused with what to do instead. An engine without an optimizer reads
    the same weights from it."""
    with tempfile.TemporaryDirectory() as root:
        two = run_ranks(save_without_frozen, 2, root)
        one = run_ranks(resume_without_frozen, 1, root)[0]
        with pytest.raises(ExportError, match="exclude_frozen_parameters=True"):
            export_checkpoint(root, Path(root) / "out.pt")
    rank_mean = [(a + b) / 2 for a, b in zip(two[0]["losses"], two[1]["losses"], strict=True)]
    assert max(abs(a - b) for a, b in zip(one["losses"], rank_mean, strict=True)) < 1e-5
    assert max_relative_error(one["params"], two[0]["params"]) < 1e-5
    assert set(one["evaluated"]) == set(one["loaded"])
    for name, value in one["loaded"].items():
        assert torch.equal(one["evaluated"][name], value), name
    frozen = make_model(0).inp.state_dict()
    for name, value in frozen.items():
        assert torch.equal(one["params"][f"inp.{name}"], value), name
