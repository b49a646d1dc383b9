"""An engine without an optimizer (``trainer.initialize(inference=True)``, what the DeepSpeed
facade builds when it is given no optimizer): the units a training engine would have, every
one frozen, so the backend holds the weights in the training dtype and no fp32 master or
moments; it evaluates as the plain model does, refuses to train, leaves ``requires_grad``
as it was, takes a training checkpoint's weights, and gives the module back whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import base_config, make_batch, make_model
from conftest import cap_twin_device

import trainer
from trainer.device import twin_memory
from trainer.state.hf_checkpoint import CheckpointError
from trainer.zero.engine import EngineInferenceError

pytestmark = pytest.mark.slow

OFFLOAD = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


def _frozen_input(seed: int) -> torch.nn.Module:
    """``make_model(seed)`` whose input layer is seed 0's and frozen (the base a fine-tune
    freezes, the same in every run)."""
    model = make_model(seed)
    model.inp.load_state_dict(make_model(0).inp.state_dict())
    model.inp.requires_grad_(False)
    return model


def _eval_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(model(*make_batch(7, 0, 0, 4)))


def test_an_inference_engine_holds_the_weights_only_and_loads_a_training_checkpoint(
        tmp_path: Path) -> None:
    training, _, _, _ = trainer.initialize(model=_frozen_input(0), config=base_config(
        zero_optimization=OFFLOAD))
    try:
        for step in range(2):
            training.backward(training(*make_batch(step, 0, 0, 4)))
            training.step()
        training.save_checkpoint(tmp_path, tag="t")
        training.save_checkpoint(tmp_path, tag="lora", exclude_frozen_parameters=True)
        trained_loss = _eval_loss(training)
        training_bytes = training.offload_stats()["shard_nbytes"]
    finally:
        training.destroy()

    model = _frozen_input(1)  # units as training's: the same parameters frozen
    flags = [param.requires_grad for param in model.parameters()]
    reference = _frozen_input(1)
    engine, _, _, _ = trainer.initialize(model=model, config=base_config(
        zero_optimization=OFFLOAD), inference=True)
    try:
        assert not any(unit.trainable for unit in engine.units)
        # the weights only, 4 bytes an element, where training also held the fp32 master,
        # both moments and the gradients
        held = engine.offload_stats()["shard_nbytes"]
        assert held == 4 * sum(unit.padded_numel for unit in engine.units)
        assert 4 * held <= training_bytes
        assert _eval_loss(engine) == _eval_loss(reference)
        loss = engine(*make_batch(0, 0, 0, 4))
        with pytest.raises(EngineInferenceError, match="no optimizer"):
            engine.backward(loss)
        with pytest.raises(EngineInferenceError, match="no optimizer"):
            engine.step()
        # without its frozen base: every unit is frozen here, yet the trained ones it
        # holds are read (by presence), the base kept
        engine.load_checkpoint(tmp_path, tag="lora", load_optimizer_states=False,
                               load_module_strict=False)
        assert _eval_loss(engine) == trained_loss
        engine.load_checkpoint(tmp_path, tag="t", load_optimizer_states=False)
        assert _eval_loss(engine) == trained_loss
    finally:
        engine.destroy()
    assert [param.requires_grad for param in model.parameters()] == flags
    trained = make_model(2)
    trained.load_state_dict(model.state_dict())  # whole again, the checkpoint's weights
    assert _eval_loss(trained) == trained_loss


def test_an_inference_engine_needs_stage_3() -> None:
    with pytest.raises(ValueError, match="needs ZeRO stage 3, got stage 2"):
        trainer.initialize(model=make_model(0), config=base_config(
            zero_optimization={"stage": 2}), inference=True)


@pytest.mark.usefixtures("strict_device_twin")
def test_a_model_larger_than_the_device_evaluates_on_the_strict_twin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's evaluation of a model whose weights alone exceed the device: on the strict
    twin capped below them, the inference engine gathers a unit or two at a time from the
    daemon and gives plain torch's loss on the host, its device peak under the cap."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    capacity = 1 << 20
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=6, n_embd=96, n_head=2, vocab_size=97, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    assert 4 * sum(param.numel() for param in model.parameters()) > 2 * capacity
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        expected = float(model(input_ids=ids, labels=ids).loss)
    cap_twin_device(monkeypatch, capacity)
    offload = {"device": "cpu"}
    engine, _, _, _ = trainer.initialize(model=model, inference=True, config={
        "train_micro_batch_size_per_gpu": 2, "units": {"module_classes": ["GPT2Block"]},
        "zero_optimization": {"stage": 3, "offload_param": offload,
                              "offload_optimizer": offload,
                              "stage3_prefetch_bucket_size": 120_000,
                              "stage3_max_live_parameters": 250_000}})
    try:
        assert str(engine.collectives.device) == "twin:0"
        engine.eval()
        with torch.no_grad():
            loss = float(engine(input_ids=ids.to(engine.collectives.device), labels=ids.to(
                engine.collectives.device)).loss)
        assert loss == pytest.approx(expected, rel=1e-6)
        assert 0 < twin_memory.max_memory_allocated() <= twin_memory.memory().capacity_nbytes
    finally:
        engine.destroy()


def test_an_inference_engines_checkpoint_gives_a_training_engine_its_weights(
        tmp_path: Path) -> None:
    """The other way round: what an engine without an optimizer saved holds no optimizer
    state, so a full load is refused, naming the option that takes the weights alone."""
    engine, _, _, _ = trainer.initialize(model=make_model(0), config=base_config(
        zero_optimization=OFFLOAD), inference=True)
    try:
        engine.save_checkpoint(tmp_path, tag="t")
        expected = _eval_loss(engine)
    finally:
        engine.close()
    training, _, _, _ = trainer.initialize(model=make_model(1), config=base_config(
        zero_optimization=OFFLOAD))
    try:
        with pytest.raises(CheckpointError, match="load_optimizer_states=False"):
            training.load_checkpoint(tmp_path, tag="t")
        training.load_checkpoint(tmp_path, tag="t", load_optimizer_states=False)
        assert _eval_loss(training) == expected
        training.backward(training(*make_batch(0, 0, 0, 4)))  # and it trains on from there
        training.step()
    finally:
        training.close()
