"""Checkpoint round trip on 2 gloo ranks: 5 steps, save, load into a fresh engine, 5 more
steps must equal 10 uninterrupted steps bit for bit (including offloaded state)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model, run_ranks, shared_daemon

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.state.hf_checkpoint import CheckpointError
from trainer.state.reshard import ReshardError

pytestmark = pytest.mark.slow


def _train(engine: Any, rank: int, steps: range) -> None:
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(*make_batch(step, micro, rank, 4)))
            engine.step()


def _summary(engine: Any) -> dict[str, Any]:
    return {"state": consolidate_fp32_state_dict(engine), "global_steps": engine.global_steps,
            "lr": engine.get_lr(), "loss_scale": engine.loss_scale,
            "adam_steps": engine.optimizer.step_count}


def _with_daemon(config: dict[str, Any], socket_path: str, job: str) -> dict[str, Any]:
    if config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") == "none":
        return config
    return {**config, "offloadd": {"socket": socket_path, "job": job, "arena_size": 16 << 20}}


def round_trip(rank: int, world: int, configs: list[dict[str, Any]], root: str) -> list[Any]:
    results = []
    with shared_daemon(rank, None) as socket_path:
        for index, config in enumerate(configs):
            save_dir = Path(root) / f"case{index}"
            engine, _, _, _ = trainer.initialize(
                model=make_model(0), config=_with_daemon(config, socket_path, f"a{index}"))
            _train(engine, rank, range(5))
            engine.save_checkpoint(save_dir, client_state={"epoch": 3})
            _train(engine, rank, range(5, 10))
            straight = _summary(engine)
            engine.close()
            fresh, _, _, _ = trainer.initialize(
                model=make_model(1), config=_with_daemon(config, socket_path, f"b{index}"))
            path, client_state = fresh.load_checkpoint(save_dir)
            assert path is not None and client_state == {"epoch": 3}
            _train(fresh, rank, range(5, 10))
            results.append((straight, _summary(fresh)))
            fresh.close()
    return results


CONFIGS = [
    base_config(zero_optimization={"stage": 3}, gradient_accumulation_steps=2,
                gradient_clipping=0.3,
                scheduler={"type": "WarmupDecayLR", "params": {
                    "warmup_max_lr": 0.01, "warmup_num_steps": 3, "total_num_steps": 12}}),
    base_config(zero_optimization={"stage": 1}, fp16={"enabled": True,
                                                      "initial_scale_power": 8}),
    base_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                gradient_clipping=0.3),
    base_config(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "cpu"}},
                bf16={"enabled": True}),
]


def test_checkpoint_round_trip_is_exact() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(round_trip, 2, CONFIGS, root)[0]
        assert (Path(root) / "case0" / "latest").read_text() == "global_step5"
        assert sorted(p.name for p in (Path(root) / "case0" / "global_step5").iterdir()) == [
            "meta.json", "rank_00000.pt", "rank_00001.pt"]
    for config, (straight, resumed) in zip(CONFIGS, results, strict=True):
        assert straight["global_steps"] == resumed["global_steps"] == 10, config
        for key in ("lr", "loss_scale", "adam_steps"):
            assert straight[key] == resumed[key], (key, config)
        for name, value in straight["state"].items():
            assert torch.equal(value, resumed["state"][name]), (name, config)


def test_load_at_other_world_size_needs_every_rank_file(tmp_path: Path) -> None:
    engine, _, _, _ = trainer.initialize(model=make_model(), config=base_config(
        zero_optimization={"stage": 2}))
    engine.save_checkpoint(tmp_path, tag="t")
    meta = tmp_path / "t" / "meta.json"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 4'))
    with pytest.raises(ReshardError, match=r"saved by 4 ranks but \['rank_00001.pt'"):
        engine.load_checkpoint(tmp_path, tag="t")
    meta.write_text(meta.read_text().replace('"stage": 2', '"stage": 1'))
    with pytest.raises(ValueError, match="stage=1"):
        engine.load_checkpoint(tmp_path, tag="t")
    assert engine.load_checkpoint(tmp_path / "missing") == (None, {})


def test_a_rank_file_missing_a_trained_unit_is_refused(tmp_path: Path) -> None:
    """Only frozen units of a checkpoint saved without its frozen parameters may be absent
    (``trainer.state.reshard.check_absent``); a trained unit missing from a rank file is a
    damaged checkpoint, not weights to keep."""
    engine, _, _, _ = trainer.initialize(model=make_model(), config=base_config(
        zero_optimization={"stage": 3}))
    try:
        engine.save_checkpoint(tmp_path, tag="t")
        rank_file = tmp_path / "t" / "rank_00000.pt"
        payload = torch.load(rank_file, weights_only=True)
        del payload["units"][1]
        torch.save(payload, rank_file)
        with pytest.raises(CheckpointError, match="no state for unit 1"):
            engine.load_checkpoint(tmp_path, tag="t")
    finally:
        engine.close()


def test_a_non_string_tag_names_its_directory_as_deepspeed_does(tmp_path: Path) -> None:
    """DeepSpeed's getting-started guide saves under ``ckpt_id = loss.item()`` and loads
    that tag back; a tag is its text, and only ever inside the save directory."""
    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=base_config())
    try:
        loss = engine(*make_batch(0, 0, 0, 4))
        engine.backward(loss)
        engine.step()
        ckpt_id = loss.item()
        engine.save_checkpoint(tmp_path, ckpt_id, client_state={"step": 1})
        assert (tmp_path / str(ckpt_id) / "meta.json").exists()
        assert (tmp_path / "latest").read_text().strip() == str(ckpt_id)
        trained = consolidate_fp32_state_dict(engine)
        _train(engine, 0, range(1, 3))
        path, client = engine.load_checkpoint(tmp_path, ckpt_id)
        assert path == str(tmp_path / str(ckpt_id)) and client == {"step": 1}
        restored = consolidate_fp32_state_dict(engine)
        assert all(torch.equal(restored[name], value) for name, value in trained.items())
        for outside in ("../elsewhere", str(tmp_path.parent / "abs")):
            with pytest.raises(CheckpointError, match="not inside"):
                engine.save_checkpoint(tmp_path, outside)
        assert not (tmp_path.parent / "elsewhere").exists()
    finally:
        engine.close()
