"""Twin-Flow with ``offload_optimizer.ratio: "auto"``: every unit starts offloaded, and
after the first accumulation window the first units, in forward order, whose state fits
the device memory that window left free (beyond the running sums' room) move to the
device, their state as it was.

2 gloo ranks against a real daemon on the strict twin, its device memory capped
(``OFFLOADD_TWIN_MEMORY``) as a GPU's is: the ranks agree on one split, the daemon then
holds exactly the other units, the device stays under its capacity, and training matches
torch's AdamW as every fixed ratio does (``tests/test_twin_flow.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from _dist import (
    base_config,
    make_batch,
    make_model,
    max_relative_error,
    reference_train,
    run_ranks,
    shared_daemon,
)
from conftest import cap_twin_device
from test_twin_flow import TOLERANCE

from trainer.config import parse_config
from trainer.device import twin_memory

WORLD = 2
STEPS = 5


def _config(socket_path: str, job: str) -> dict[str, Any]:
    return {**base_config(
        gradient_accumulation_steps=2, gradient_clipping=0.3,
        zero_optimization={"stage": 3, "offload_param": {"device": "cpu"},
                           "offload_optimizer": {"device": "cpu", "ratio": "auto"}}),
        "offloadd": {"socket": socket_path, "job": job, "arena_size": 16 << 20}}


def _in_daemon(engine: Any) -> list[int]:
    """The units whose master the daemon holds for this rank, asked of the daemon."""
    from trainer.client import UnknownShardError

    found = []
    for unit in engine.units:
        try:
            engine.backend.offloaded.client.get(f"u{unit.index}.master")
        except UnknownShardError:
            continue
        found.append(unit.index)
    return found


def train_auto(rank: int, world: int) -> dict[str, Any]:
    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    with shared_daemon(rank) as socket_path:
        model = make_model(0)
        engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                             config=_config(socket_path, "auto"))
        try:
            device_units = []
            for step in range(STEPS):
                for micro in range(engine.gradient_accumulation_steps()):
                    batch = make_batch(step, micro, rank, engine.train_micro_batch_size_per_gpu())
                    engine.backward(engine(*(t.to(engine.collectives.device) for t in batch)))
                    engine.step()
                device_units.append(sorted(engine.backend.device_units))
            engine.backend.wait_steps()
            stats = engine.offload_stats()
            return {"device_units": device_units, "in_daemon": _in_daemon(engine),
                    "units": [unit.index for unit in engine.units if unit.trainable],
                    "device_state_nbytes": stats["device_state_nbytes"],
                    "state": consolidate_fp32_state_dict(engine),
                    "peak": twin_memory.max_memory_allocated(),
                    "capacity": twin_memory.memory().capacity_nbytes}
        finally:
            engine.close()


def _run(monkeypatch: pytest.MonkeyPatch, capacity: str | None) -> list[dict[str, Any]]:
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    monkeypatch.setenv("OFFLOADD_TWIN_DEVICE", "strict")
    if capacity is None:
        monkeypatch.delenv(twin_memory.TWIN_MEMORY_ENV, raising=False)
    else:
        monkeypatch.setenv(twin_memory.TWIN_MEMORY_ENV, capacity)
    return run_ranks(train_auto, WORLD)


def _assert_trains_as_torch(by_rank: list[dict[str, Any]]) -> None:
    expected = reference_train(_config("unused", "unused"), STEPS, WORLD)
    assert max_relative_error(by_rank[0]["state"], expected) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("capacity, moved", [("48KiB", "some"), ("4MiB", "all")])
def test_auto_moves_the_first_units_that_fit_what_the_first_window_left(
        monkeypatch: pytest.MonkeyPatch, capacity: str, moved: str) -> None:
    by_rank = _run(monkeypatch, capacity)
    for result in by_rank:
        assert result["device_units"] == by_rank[0]["device_units"], "the ranks agree"
        units = result["units"]
        # the first window stepped everything in the daemon; the split comes after it
        # and stays
        chosen = result["device_units"][0]
        assert all(step == chosen for step in result["device_units"])
        assert chosen == units[:len(chosen)], "a prefix of the forward order"
        if moved == "all":
            assert chosen == units
        else:
            assert 0 < len(chosen) < len(units)
        assert result["in_daemon"] == [unit for unit in units if unit not in chosen]
        assert 0 < result["peak"] <= result["capacity"]
    _assert_trains_as_torch(by_rank)


@pytest.mark.slow
def test_auto_on_an_unbounded_device_offloads_everything(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing measures the room of a device without a capacity: nothing moves."""
    by_rank = _run(monkeypatch, None)
    for result in by_rank:
        assert result["device_units"] == [[]] * STEPS
        assert result["in_daemon"] == result["units"]
        assert result["device_state_nbytes"] == 0
    _assert_trains_as_torch(by_rank)


def _split_in_process(monkeypatch: pytest.MonkeyPatch, accumulation: int,
                      capacity: int) -> dict[str, Any]:
    """One rank, one window: the split, then the sums' room and the other units' sums."""
    import trainer

    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    cap_twin_device(monkeypatch, capacity)
    config = base_config(gradient_accumulation_steps=accumulation, zero_optimization={
        "stage": 3, "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu", "ratio": "auto"}})
    engine, _, _, _ = trainer.initialize(model=make_model(0), config=config)
    try:
        for micro in range(accumulation):
            batch = make_batch(0, micro, 0, engine.train_micro_batch_size_per_gpu())
            engine.backward(engine(*(t.to(engine.collectives.device) for t in batch)))
            engine.step()  # the first window's end: the split
        return {"device_units": sorted(engine.backend.device_units),
                "room": engine.backend.offloaded.device_sum_room_nbytes,
                "sums": sum(4 * unit.part_numel for unit in engine.units
                            if unit.index not in engine.backend.device_units)}
    finally:
        engine.close()


@pytest.mark.usefixtures("strict_device_twin")
def test_without_accumulation_the_sums_room_goes_to_the_device_units(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With one micro-batch per window no running sum is ever kept, so the sums' share of
    the measured room goes to the device units too: in 46 KB, the root unit and a block
    (15 KB of state each block) where accumulation keeps every other unit's sum's room
    and moves the root alone."""
    alone = _split_in_process(monkeypatch, 1, 46_000)
    accumulated = _split_in_process(monkeypatch, 2, 46_000)
    assert accumulated["device_units"] == [0] and alone["device_units"] == [0, 1]
    assert accumulated["room"] >= accumulated["sums"], "every offloaded unit's sum fits"


def test_auto_is_a_ratio_and_other_words_are_not() -> None:
    section = {"device": "cpu", "ratio": "auto"}
    config = parse_config({"train_micro_batch_size_per_gpu": 1,
                           "zero_optimization": {"stage": 2, "offload_optimizer": section}})
    assert config.zero_optimization.offload_optimizer.ratio == "auto"
    section["ratio"] = "most"
    with pytest.raises(ValueError, match=r"offload_optimizer\.ratio='most'.*'auto'"):
        parse_config({"train_micro_batch_size_per_gpu": 1,
                      "zero_optimization": {"stage": 2, "offload_optimizer": section}})
