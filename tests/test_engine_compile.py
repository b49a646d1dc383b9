"""``engine.compile`` (DeepSpeed's; Accelerate calls it under ``--dynamo_backend``) and
regional ``module.compile()`` (Accelerate's ``compile_regions_deepspeed``) on offloadd:
the compiled units train as plain torch does, stages 2 and 3 with the optimizer in the
daemon. Under stage 3 the units' gather hooks run inside the compiled ``_call_impl``;
traced, the graph ran on the released parameters (inductor's size assertion failed on
a 1-D empty weight). CPU compute: inductor compiles C++ here.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_external_params as external_case
import torch
from _dist import base_config, make_batch, make_model, run_ranks

pytestmark = pytest.mark.slow

STEPS = 3


def _train(rank: int, world: int, stage: int) -> list[float]:
    import trainer
    from trainer.integrations.ds_facade import DeepSpeedEngine

    torch.manual_seed(0)
    model = make_model(0)
    config: dict[str, Any] = base_config(zero_optimization={
        "stage": stage, "offload_optimizer": {"device": "cpu"},
        **({"offload_param": {"device": "cpu"}} if stage == 3 else {})})
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
    facade = DeepSpeedEngine(engine, config, None)  # type: ignore[arg-type]
    facade.compile(backend="inductor", compile_kwargs={"dynamic": False})
    assert facade.is_compiled
    losses = []
    try:
        for step in range(STEPS):
            loss = engine(*make_batch(step, 0, rank, 4))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses
    finally:
        engine.close()


def _reference() -> list[float]:
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                  weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(*make_batch(step, 0, 0, 4))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_compiled_units_train_as_plain_torch() -> None:
    """Stage 3 through engine.compile (each unit's ``module.compile()``, as Accelerate's
    regional compilation does it). Inductor: aot_eager ran the lost swap without a word;
    inductor's generated code checks its inputs' sizes. ~25 s of compiling on 2 cores."""
    losses = run_ranks(_train, 1, 3, timeout_s=400)[0]
    assert losses == pytest.approx(_reference(), rel=1e-4)


def _train_external(rank: int, world: int) -> tuple[list[float], int]:
    import trainer

    model = external_case.ExternalNet(None, recompute=False)
    engine, *_ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                    config=external_case._config("none", ""))
    engine.compile(backend="inductor", compile_kwargs={"dynamic": False})
    losses = []
    try:
        for step in range(STEPS):
            for micro in range(external_case.ACCUMULATION):
                loss = engine(*(t.to(engine.device)
                                for t in external_case._batch(step, micro, rank)))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        assert engine.external is not None
        return losses, engine.external.num_found
    finally:
        engine.close()


def test_compiled_units_read_other_units_parameters_as_plain_torch() -> None:
    """Stage 3, every unit released after its forward, compiled units reading other
    units' parameters (``tests/test_external_params.py``'s model, nothing declared): dynamo
    traced the watch on those reads, so the on-demand gather became part of a graph that
    then ran on the released shape (inductor's size check failed). The losses of both
    ranks match torch's, and the reads are found on the first pass only."""
    ranks = run_ranks(_train_external, 2, timeout_s=400)
    model = external_case.ExternalNet(None, recompute=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                  weight_decay=0.01)
    reference: list[list[float]] = [[], []]
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(external_case.ACCUMULATION):
            for rank in range(2):
                loss = model(*external_case._batch(step, micro, rank))
                (loss / (2 * external_case.ACCUMULATION)).backward()
                reference[rank].append(loss.item())
        optimizer.step()
    for rank, (losses, found) in enumerate(ranks):
        assert losses == pytest.approx(reference[rank], rel=1e-4)
        assert found == external_case.FOUND_ON_DEMAND + 2  # + the two uses declared there


def test_deepcompile_schedules_are_refused() -> None:
    import trainer

    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=base_config())
    try:
        with pytest.raises(ValueError, match="DeepCompile"):
            engine.compile(schedule=[(0, ["prefetch"])])
        assert not engine.is_compiled
    finally:
        engine.close()
