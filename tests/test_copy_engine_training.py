"""Training through the CPU twin copy engine: every parameter H2D and gradient D2H goes
through late, threaded copies with events, and the result is bit-identical to the
synchronous (inline) path. Single process, real private daemon."""

from __future__ import annotations

import pytest
import torch
from _dist import base_config, engine_train

import trainer
from trainer.device.copy_engine import TwinCopyEngine

pytestmark = pytest.mark.usefixtures("strict_device_twin")

def _config(stage: int) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    return base_config(zero_optimization=zero, gradient_accumulation_steps=2)


@pytest.mark.parametrize("stage", [2, 3])
def test_twin_and_inline_copies_train_identically(monkeypatch, stage: int) -> None:
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "inline")
    inline_state, inline_losses = engine_train(0, 1, _config(stage), steps=3)
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    twin_state, twin_losses = engine_train(0, 1, _config(stage), steps=3)
    assert twin_losses == inline_losses
    for name, value in inline_state.items():
        assert torch.equal(twin_state[name], value), name


def test_the_engine_defers_lease_releases_behind_copy_events(monkeypatch) -> None:
    from _dist import make_batch, make_model

    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, config=_config(3))
    try:
        for micro in range(2):
            batch = make_batch(0, micro, 0, engine.train_micro_batch_size_per_gpu())
            loss = engine(*(t.to(engine.collectives.device) for t in batch))
            engine.backward(loss)
            engine.step()
        stats = engine.offload_stats()
        assert isinstance(engine.backend.copies, TwinCopyEngine)
        assert stats["rank_copy_engine"] == "twin"
        assert stats["rank_releases_deferred"] > 0
        assert stats["rank_arena_pinned"] == "pinned"
        assert len(engine.backend.copies.registered) == 1
        assert engine.backend.copies.late_releases_caught == 0
        engine.backend.wait_steps()
        assert len(engine.backend.releases) == 0
    finally:
        engine.close()
    assert engine.backend.copies.registered == {}, "arena unregistered before unmap"


def test_gradient_windows_are_summed_on_the_device_and_cross_once(monkeypatch) -> None:
    """With a device copy engine the running sum of an accumulation window stays on the
    device and reaches the arena once, at the window's end: the same training as the
    per-micro-batch path (D2H, H2D, add for each micro-batch), with fewer bytes moved."""
    from _dist import make_batch, make_model

    from trainer.state.checkpoint import consolidate_fp32_state_dict

    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"}}
    runs = {}
    for room in ("default", "none"):
        engine, _, _, _ = trainer.initialize(model=make_model(0), config=base_config(
            zero_optimization=zero, gradient_accumulation_steps=3))
        if room == "none":
            engine.backend.device_sum_room_nbytes = 0
        try:
            losses = []
            for step in range(2):
                for micro in range(3):
                    batch = make_batch(step, micro, 0, engine.train_micro_batch_size_per_gpu())
                    loss = engine(*(t.to(engine.collectives.device) for t in batch))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
            runs[room] = (losses, consolidate_fp32_state_dict(engine),
                          engine.backend.moved_nbytes)
        finally:
            engine.close()
    assert runs["default"][0] == runs["none"][0]
    for name, value in runs["none"][1].items():
        assert torch.equal(runs["default"][1][name], value), name
    assert runs["default"][2] < runs["none"][2]
