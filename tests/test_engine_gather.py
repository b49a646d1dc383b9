"""Stage-3 gather bookkeeping in one process: reuse distance, buffer states, prefetch order."""

from __future__ import annotations

from typing import Any

import torch
from _dist import base_config, make_batch, make_model

import trainer
from trainer.zero.gather import GatherState


def _stage3_engine(**zero: Any) -> Any:
    model = make_model()
    config = base_config(zero_optimization={"stage": 3, **zero})
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    return engine


def _states(engine: Any) -> list[GatherState]:
    return [engine.placement.full.state(unit) for unit in engine.units]


def _train_step(engine: Any, step: int) -> torch.Tensor:
    loss = engine(*make_batch(step, 0, 0, 4))
    engine.backward(loss)
    engine.step()
    return loss


def test_reuse_distance_counts_units_after_the_forward() -> None:
    engine = _stage3_engine()
    try:
        _train_step(engine, 0)
        engine(*make_batch(1, 0, 0, 4))  # the second forward freezes the first pass
        root, *blocks = engine.units
        block_numel = [unit.padded_numel for unit in blocks]
        # The root's forward ends last: its backward is next.
        assert engine.prefetch.reuse_distance(root) == 0
        for index, unit in enumerate(blocks):
            assert engine.prefetch.reuse_distance(unit) == 2 * sum(block_numel[index + 1:])
    finally:
        engine.close()


def test_units_stay_gathered_until_their_backward_within_reuse_distance() -> None:
    """The default budget (1e9 elements) holds the whole model: nothing is freed before
    its backward, and the boundary's backward frees everything."""
    engine = _stage3_engine()
    try:
        for step in range(2):
            _train_step(engine, step)
        loss = engine(*make_batch(2, 0, 0, 4))
        assert _states(engine) == [GatherState.READY] * len(engine.units)
        engine.backward(loss)
        assert _states(engine) == [GatherState.FREE] * len(engine.units)
        assert all(slot.param.numel() == 0 for unit in engine.units for slot in unit.slots)
        engine.step()
    finally:
        engine.close()


def test_reuse_distance_zero_frees_after_forward_and_prefetches_backward() -> None:
    probe = _stage3_engine()
    largest = max(unit.padded_numel for unit in probe.units)
    probe.close()
    # A live budget of three units leaves room to hold one past its backward: too little
    # to keep a unit from its forward on that account, so the distance alone decides.
    engine = _stage3_engine(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=10**6,
                            stage3_max_live_parameters=3 * largest)
    try:
        for step in range(2):
            _train_step(engine, step)
        gathers_before = engine.placement.full.num_gathers
        prefetched_before = engine.placement.full.num_prefetched
        loss = engine(*make_batch(2, 0, 0, 4))
        # Distance 0 means "used again right away": the root (its forward spans the
        # others) and the last block stay; the earlier blocks are freed.
        blocks = len(engine.units) - 1
        expected = [GatherState.READY] + [GatherState.FREE] * (blocks - 1) + [GatherState.READY]
        assert _states(engine) == expected
        engine.backward(loss)
        engine.step()
        # forward: root + every block; backward: every block but the last again
        assert engine.placement.full.num_gathers - gathers_before == 2 * blocks
        assert engine.placement.full.num_prefetched - prefetched_before >= blocks
    finally:
        engine.close()
