"""Reduced gradients cross into the arena in the training dtype (bf16), not widened to fp32.

Under bf16 ZeRO-2/3 the reduce-scatter already rounds the gradient partition to bf16,
so an fp32 shard would hold no more information, only twice the bytes (and twice the
D2H on a GPU). The check: the same 2-rank bf16 stage-3 run with the gradient shards in
bf16 and with them widened to fp32 (the layout before) ends in bit-identical weights,
while the daemon's gradient shards are half the size. With accumulation the sum stays
in fp32, unless ``data_types.grad_accum_dtype`` asks for bf16 sums
(tests/test_grad_accum_dtype.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model, run_ranks

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 6


def _config(accumulation: int) -> dict[str, Any]:
    offload = {"device": "cpu"}
    return base_config(zero_optimization={"stage": 3, "offload_optimizer": offload,
                                          "offload_param": offload},
                       bf16={"enabled": True}, gradient_clipping=0.5,
                       gradient_accumulation_steps=accumulation)


def _train(rank: int, accumulation: int) -> dict[str, Any]:
    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=_config(accumulation))
    try:
        for step in range(STEPS):
            for micro in range(accumulation):
                loss = engine(*make_batch(step, micro, rank,
                                          engine.train_micro_batch_size_per_gpu()))
                engine.backward(loss)
                engine.step()
        engine.backend.wait_steps()
        lease = engine.backend.client.acquire("u0.grad", "r")
        grad = {"dtype": lease.dtype, "nbytes": lease.nbytes,
                "numel": engine.backend.part_numel(0)}
        lease.release()
        return {"state": consolidate_fp32_state_dict(engine), "grad": grad}
    finally:
        engine.close()


def _cases(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """One launch (spawning ranks is the slow part): ours, accumulated, then widened."""
    from trainer.zero.engine import Engine

    ours, accumulated = _train(rank, 1), _train(rank, 2)
    Engine._grad_dtype = lambda self: torch.float32  # type: ignore[method-assign]
    return {"ours": ours, "accumulated": accumulated, "widened": _train(rank, 1)}


@pytest.fixture(scope="module")
def cases() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_cases, WORLD)


def test_bf16_gradients_cross_in_bf16_and_train_exactly_as_fp32_ones(cases) -> None:
    for rank in range(WORLD):
        grad = cases[rank]["ours"]["grad"]
        assert grad["dtype"] == "bfloat16" and grad["nbytes"] == 2 * grad["numel"]
        assert cases[rank]["widened"]["grad"]["dtype"] == "float32"
    state, reference = cases[0]["ours"]["state"], cases[0]["widened"]["state"]
    assert state.keys() == reference.keys()
    for name in state:
        assert torch.equal(state[name], reference[name]), name


def test_accumulated_gradients_stay_fp32(cases) -> None:
    for rank in range(WORLD):
        grad = cases[rank]["accumulated"]["grad"]
        assert grad["dtype"] == "float32" and grad["nbytes"] == 4 * grad["numel"]
