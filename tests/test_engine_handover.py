"""A model handed from one engine to the next (continual training, HF Trainer's
``auto_find_batch_size`` and hyperparameter search, Accelerate's ``free_memory``): on 2
gloo ranks, ``destroy`` leaves the module whole with its trained weights, a new
``initialize`` over a model an open engine still trains destroys that engine first, and
the new engine trains on exactly as a fresh engine over a model holding those weights
would. A stage-3 model whose engine was closed (its weights gone with the offload job) is
refused naming ``destroy``; a closed engine refuses to train. DeepSpeed fails these with
ZeRO-3's empty parameters (its issue 5602; transformers issue 35073)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model, run_ranks, shared_daemon, with_offload

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero.engine import EngineClosedError

pytestmark = pytest.mark.slow

CASES = [(3, "cpu"), (3, "none"), (2, "cpu"), (1, "none")]


def _config(stage: int, offload: str, socket_path: str, job: str) -> dict[str, Any]:
    config = base_config(zero_optimization={"stage": stage}, gradient_clipping=0.5)
    return with_offload(config, offload, socket_path, job)


def _train(engine: Any, rank: int, steps: range) -> None:
    for step in steps:
        engine.backward(engine(*make_batch(step, 0, rank, 4)))
        engine.step()


def handover(rank: int, world: int, stage: int, offload: str) -> dict[str, Any]:
    with shared_daemon(rank, enabled=offload != "none") as socket_path:
        model = make_model(0)
        first, _, _, _ = trainer.initialize(model=model,
                                            config=_config(stage, offload, socket_path, "a"))
        _train(first, rank, range(2))
        trained = consolidate_fp32_state_dict(first)
        # Not closed: the next initialize over the same model hands it over.
        second, _, _, _ = trainer.initialize(model=model,
                                             config=_config(stage, offload, socket_path, "b"))
        first_closed = first.closed
        taken_over = consolidate_fp32_state_dict(second)
        _train(second, rank, range(2, 4))
        continued = consolidate_fp32_state_dict(second)
        second.destroy()
        whole = {name: value.detach().clone() for name, value in model.state_dict().items()}
        # A fresh model holding the first engine's trained weights, trained the same way.
        fresh_model = make_model(1)
        if rank == 0:
            fresh_model.load_state_dict(trained)
        for value in fresh_model.state_dict().values():
            torch.distributed.broadcast(value, 0)
        fresh, _, _, _ = trainer.initialize(model=fresh_model,
                                            config=_config(stage, offload, socket_path, "c"))
        _train(fresh, rank, range(2, 4))
        reference = consolidate_fp32_state_dict(fresh)
        fresh.close()
        with pytest.raises(EngineClosedError, match="build a new one"):
            fresh(*make_batch(0, 0, rank, 4))
        return {"trained": trained, "taken_over": taken_over, "continued": continued,
                "reference": reference, "whole": whole, "first_closed": first_closed}


@pytest.mark.parametrize(("stage", "offload"), CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_a_model_handed_to_a_new_engine_trains_on_from_its_weights(stage: int,
                                                                   offload: str) -> None:
    result = run_ranks(handover, 2, stage, offload)[0]
    assert result["first_closed"]
    for name, value in result["trained"].items():
        assert torch.equal(result["taken_over"][name], value), name
        assert torch.equal(result["continued"][name], result["reference"][name]), name
        assert torch.equal(result["whole"][name], result["continued"][name]), name


def handover_copies(rank: int, world: int) -> dict[str, Any]:
    """A stage-3 handover: the weights come back whole on rank 0 only."""
    model = make_model(0)
    config = base_config(zero_optimization={"stage": 3})
    first, _, _, _ = trainer.initialize(model=model, config=config)
    _train(first, rank, range(2))
    trained = consolidate_fp32_state_dict(first)
    first.destroy(handover=True)
    meta = [param.is_meta for param in model.parameters()]
    second, _, _, _ = trainer.initialize(model=model, config=config)
    taken_over = consolidate_fp32_state_dict(second)
    second.destroy()
    return {"meta": meta, "trained": trained, "taken_over": taken_over,
            "whole": {name: value.detach().clone() for name, value in model.state_dict().items()}}


def test_a_handover_holds_one_copy_of_the_model_on_the_host() -> None:
    """``initialize`` over a model an open engine trains destroys it with ``handover``: the
    ranks other than 0 get ``meta`` parameters instead of a whole copy each, and the new
    engine still takes over the trained weights bit for bit (then ``destroy`` gives every
    rank the whole module)."""
    ranks = run_ranks(handover_copies, 2)
    assert ranks[0]["meta"] and not any(ranks[0]["meta"])
    assert all(ranks[1]["meta"])
    for name, value in ranks[0]["trained"].items():
        assert torch.equal(ranks[0]["taken_over"][name], value), name
        for rank in ranks:
            assert torch.equal(rank["whole"][name], value), name


def close_then_reuse(rank: int, world: int) -> str:
    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, config=base_config(
        zero_optimization={"stage": 3}))
    _train(engine, rank, range(1))
    engine.close()
    try:
        trainer.initialize(model=model, config=base_config(zero_optimization={"stage": 3}))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_stage3_model_whose_engine_was_closed_is_refused_naming_destroy() -> None:
    for message in run_ranks(close_then_reuse, 2):
        assert "is empty" in message and "engine.destroy()" in message, message


def test_hf_trainers_one_after_another_over_one_model(tmp_path: Path) -> None:
    """Continual training: a new HF Trainer per round over the same model (ZeRO-3, state
    offloaded). Each round starts where the last one left the model, so its loss on the
    training data falls round after round."""
    import json
    import subprocess
    import sys

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    script = Path(__file__).parent / "scripts" / "hf_continual_run.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    evals = [run["eval"] for run in runs]
    assert evals[0] > evals[1] > evals[2], runs
