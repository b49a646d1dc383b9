"""Stage 3 holds gathered parameters past their backward when the next forward can use them.

Within an accumulation window a unit's partition does not change, and a frozen unit's never
does: gathering them again for the next micro-batch only moves the same bytes over PCIe (on
a model larger than the GPU, most of each step's H2D). On the same budget a unit stays
gathered from its forward to its backward, however far apart they are. The checks, in one
process with the real engine: each unit is gathered once per optimizer step, not once per
micro-batch, whatever the reuse distance; the weights are bit-identical to a run whose live
budget leaves no room to hold (every micro-batch gathers again) and match single-process
torch AdamW; a frozen unit is gathered once in all; a budget with room for only some units
holds the ones the next forward needs first and keeps everything gathered within it; a step
never reads a held unit's old values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import (
    CheckpointedNet,
    base_config,
    make_batch,
    make_model,
    max_relative_error,
    reference_train,
)

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero.gather import GatherState

ACCUMULATION = 4
STEPS = 3
NO_ROOM = 1
"""A ``stage3_max_live_parameters`` that leaves no room to hold anything."""


def _config(max_live: int | None = None, **zero: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": 3, **zero}
    if max_live is not None:
        section["stage3_max_live_parameters"] = max_live
    return base_config(zero_optimization=section, gradient_accumulation_steps=ACCUMULATION)


def _micro_step(engine: Any, step: int, micro: int) -> None:
    loss = engine(*make_batch(step, micro, 0, engine.train_micro_batch_size_per_gpu()))
    engine.backward(loss)
    engine.step()


def _train(config: dict[str, Any], *, freeze_first_block: bool = False
           ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Train STEPS steps; the fp32 weights and the gathers of each optimizer step."""
    model = make_model()
    if freeze_first_block:
        model.blocks[0].requires_grad_(False)
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    gathers = []
    try:
        for step in range(STEPS):
            before = engine.placement.full.num_gathers
            for micro in range(ACCUMULATION):
                _micro_step(engine, step, micro)
            gathers.append(engine.placement.full.num_gathers - before)
        return consolidate_fp32_state_dict(engine), gathers
    finally:
        engine.close()


@pytest.mark.parametrize(("offload", "reuse_distance"),
                         [("none", None), ("cpu", None), ("cpu", 0)])
def test_each_unit_is_gathered_once_per_step_and_training_is_unchanged(
        offload: str, reuse_distance: int | None) -> None:
    """A reuse distance of 0 is what a model far deeper than the default 1e9 elements
    looks like to every unit but the last: the live budget, not the distance, decides
    whether a unit stays gathered from its forward to its backward."""
    zero: dict[str, Any] = {"offload_param": {"device": offload},
                            "offload_optimizer": {"device": offload}}
    if reuse_distance is not None:
        zero["stage3_max_reuse_distance"] = reuse_distance
    held, held_gathers = _train(_config(**zero))
    regathered, regathered_gathers = _train(_config(NO_ROOM, **zero))
    units = len(make_model().blocks) + 1  # the blocks and the root (inp and head)
    # The first pass too: the budget holds the model, so no unit is freed after its
    # forward while the reuse distances are learnt.
    assert held_gathers == [units] * STEPS
    # With no room every micro-batch gathers every unit, twice for those whose backward
    # is too far from their forward.
    assert all(count >= ACCUMULATION * units for count in regathered_gathers)
    for name, value in regathered.items():
        assert torch.equal(held[name], value), name
    expected = reference_train(_config(), STEPS, world_size=1)
    assert max_relative_error(held, expected) < 1e-5


def test_empty_partition_cache_drops_what_is_held_and_training_is_unchanged() -> None:
    """DeepSpeed's ``engine.empty_partition_cache()`` between micro-batches and after each
    step: nothing stays gathered, the next forward gathers again, and the weights are
    those of a run that never called it."""
    held, _ = _train(_config())
    model = make_model()
    engine, _, _, _ = trainer.initialize(model=model, config=_config())
    try:
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                _micro_step(engine, step, micro)
                kept = engine.placement.live_numel
                engine.empty_partition_cache()
                assert engine.placement.live_numel == 0
                assert kept > 0 or micro == ACCUMULATION - 1  # within a window, units are held
        emptied = consolidate_fp32_state_dict(engine)
    finally:
        engine.close()
    for name, value in emptied.items():
        assert torch.equal(held[name], value), name


def test_a_frozen_unit_is_gathered_once_and_stays_current() -> None:
    held, gathers = _train(_config(), freeze_first_block=True)
    units = len(make_model().blocks) + 1
    # The first step gathers every unit once; later steps every unit but the frozen one.
    assert gathers == [units] + [units - 1] * (STEPS - 1)
    regathered, _ = _train(_config(NO_ROOM), freeze_first_block=True)
    for name, value in regathered.items():
        assert torch.equal(held[name], value), name
    initial = make_model().blocks[0].state_dict()
    for name, value in initial.items():
        assert torch.equal(held[f"blocks.0.{name}"], value), name


def test_a_budget_for_some_units_holds_those_the_next_forward_needs_first() -> None:
    probe, _, _, _ = trainer.initialize(model=make_model(), config=_config())
    root, *blocks = probe.units  # forward: root (spanning), blocks 0..2; backward reversed
    probe.close()
    block = blocks[0].padded_numel
    # Room for exactly the root and one block beyond the reserve (two of the largest
    # unit): the backward ends with block 0 then the root, which the next forward needs
    # first; blocks 1 and 2, finished earlier, are not held.
    room = root.padded_numel + block
    max_live = room + 2 * block
    engine, _, _, _ = trainer.initialize(model=make_model(), config=_config(max_live))
    try:
        full = engine.placement.full
        gathers = full.num_gathers
        for micro in range(ACCUMULATION - 1):
            _micro_step(engine, 0, micro)
            assert list(full.held) == [blocks[0].index, root.index]
            assert full.live_numel == room
            assert [full.state(unit) for unit in engine.units] == [
                GatherState.READY, GatherState.READY, GatherState.FREE, GatherState.FREE]
            # the next forward gathers only what was not held
            if micro:
                assert full.num_gathers - gathers >= len(blocks) - 1
            gathers = full.num_gathers
        # The window's last micro-batch frees everything before the optimizer step.
        _micro_step(engine, 0, ACCUMULATION - 1)
        assert not list(full.held)
        assert all(full.state(unit) is GatherState.FREE for unit in engine.units)
    finally:
        engine.close()


def test_a_held_unit_never_outlives_the_step_that_rewrites_it() -> None:
    """The forward after a step reads the stepped values: the loss of a held engine and a
    regathering one agree at every micro-batch of every step, bit for bit."""
    losses: dict[str, list[float]] = {}
    for name, config in (("held", _config()), ("regathered", _config(NO_ROOM))):
        model = make_model()
        engine, _, _, _ = trainer.initialize(model=model, config=config)
        try:
            losses[name] = []
            for step in range(STEPS):
                for micro in range(ACCUMULATION):
                    loss = engine(*make_batch(step, micro, 0, 4))
                    engine.backward(loss)
                    engine.step()
                    losses[name].append(loss.item())
        finally:
            engine.close()
    assert losses["held"] == losses["regathered"]
    assert losses["held"][0] != losses["held"][ACCUMULATION]  # the step changed the weights


def test_kept_past_the_forward_within_the_live_budget_only(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """With a reuse distance that keeps nothing and a budget for some units: the first
    units stay gathered from their forward to their backward (and are held across the
    window), the rest are gathered again for their backward, and everything gathered
    never exceeds ``stage3_max_live_parameters``."""
    from trainer.zero.gather import FullParams

    probe, _, _, _ = trainer.initialize(model=make_model(), config=_config())
    root, *blocks = probe.units
    probe.close()
    block = blocks[0].padded_numel
    max_live = root.padded_numel + block + 2 * block
    peak = [0]
    start = FullParams._start

    def counting_start(self: FullParams, buffer: Any) -> None:
        start(self, buffer)
        peak[0] = max(peak[0], self.live_numel)

    monkeypatch.setattr(FullParams, "_start", counting_start)
    kept, kept_gathers = _train(_config(max_live, stage3_max_reuse_distance=0))
    assert 0 < peak[0] <= max_live
    regathered, regathered_gathers = _train(_config(NO_ROOM, stage3_max_reuse_distance=0))
    # The root and block 0 are gathered once per step; blocks 1 and 2 twice per micro-batch
    # at most (the last block, used again right away, may stay by its distance).
    assert kept_gathers[-1] < regathered_gathers[-1]
    assert kept_gathers[-1] <= 2 + 2 * ACCUMULATION * (len(blocks) - 1)
    for name, value in regathered.items():
        assert torch.equal(kept[name], value), name


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_recomputed_blocks_are_gathered_once_per_step(use_reentrant: bool) -> None:
    """Reentrant checkpointing (HF's default) runs each block's forward under no_grad; the
    backward that follows recomputes it with the same parameters, so the blocks stay
    gathered as they do without checkpointing (they were gathered again at every
    micro-batch's recompute)."""
    results = {}
    for name, max_live in (("held", None), ("regathered", NO_ROOM)):
        torch.manual_seed(0)
        engine, _, _, _ = trainer.initialize(model=CheckpointedNet(use_reentrant),
                                             config=_config(max_live))
        try:
            gathers = []
            for step in range(STEPS):
                before = engine.placement.full.num_gathers
                for micro in range(ACCUMULATION):
                    _micro_step(engine, step, micro)
                gathers.append(engine.placement.full.num_gathers - before)
            results[name] = (consolidate_fp32_state_dict(engine), gathers)
        finally:
            engine.close()
    held, gathers = results["held"]
    assert gathers == [len(make_model().blocks) + 1] * STEPS
    for name, value in results["regathered"][0].items():
        assert torch.equal(held[name], value), name
    expected = reference_train(_config(), STEPS, world_size=1)
    assert max_relative_error(held, expected) < 1e-5
