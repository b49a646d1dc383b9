"""``data_types.grad_accum_dtype`` (DeepSpeed's key): with "bf16", gradients are summed in
bf16 wherever the sum runs, and each rank's gradient partition takes 2 B per element.

Under bf16 training the gradient partition is then bf16 at every stage and accumulation
count (the daemon's ``u{N}.grad`` half the size), and every sum rounds to bf16: the arena's
running sum (the zero-copy CPU path), the per-micro-batch read-add-write and the device
running sums (the twin copy engine), the daemon's copies, the in-rank backend's sum, and
stages 0-1's local sum and all-reduce.

The reference is plain torch: for each accumulation window, the bf16 gradients of the
engine's weights at the window's start (its fp32 master rounded to bf16, as the daemon
writes the parameters) on every rank's micro-batches, reduced over ranks and summed over
micro-batches in bf16, in the engine's order (stages 2-3 reduce each micro-batch, then
sum; stages 0-1 sum each rank's, then reduce). Every element of every window's gradient
must equal it bit for bit. The same gradients summed in fp32 and rounded once differ from
it in some elements, so an fp32 sum behind a bf16 shard would fail here; the default
(key unset) must equal the fp32 sums bit for bit, as before the key existed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model, run_ranks, shared_daemon

from trainer.config import parse_config

WORLD = 2
MICRO = 3
"""Micro-batches per window: with two, a bf16 sum of bf16 terms is the fp32 sum rounded
once (two bf16 values add exactly in fp32), so bf16 and fp32 accumulation would agree."""
MICRO_BATCH = base_config()["train_micro_batch_size_per_gpu"]
"""Samples per micro-batch on one rank (``tests/_dist.py``'s config)."""
WINDOWS = 2
"""Optimizer steps of the runs that check every window: the second window's gradients are
taken at weights the daemon stepped."""

# ------------------------------------------------------------------------- config


def _bf16(**overrides: Any) -> dict[str, Any]:
    return base_config(bf16={"enabled": True}, **overrides)


@pytest.mark.parametrize(("spelling", "meant"), [
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"),
    ("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"), ("torch.float32", "fp32"),
])
def test_deepspeeds_spellings_of_the_dtype_are_accepted(spelling: str, meant: str) -> None:
    config = parse_config(_bf16(data_types={"grad_accum_dtype": spelling}))
    assert config.data_types.grad_accum_dtype == meant
    assert parse_config(_bf16()).data_types.grad_accum_dtype == "fp32"  # unset


@pytest.mark.parametrize("spelling", ["fp16", "float16", "half", "torch.float16"])
def test_fp16_accumulation_is_refused_saying_why_and_what_to_set(spelling: str) -> None:
    for training in ({"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}):
        with pytest.raises(ValueError) as refused:
            parse_config(base_config(data_types={"grad_accum_dtype": spelling}, **training))
        message = str(refused.value)
        assert f"data_types.grad_accum_dtype={spelling!r}" in message
        assert "no fp16 gradient" in message and "'fp32'" in message


@pytest.mark.parametrize("training", [{}, {"fp16": {"enabled": True}},
                                      {"bf16": {"enabled": False}}])
def test_bf16_accumulation_without_bf16_training_is_refused(training: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"data_types\.grad_accum_dtype='bf16'.*bf16\.enabled"):
        parse_config(base_config(data_types={"grad_accum_dtype": "bf16"}, **training))


@pytest.mark.parametrize(("section", "message"), [
    ({"grad_accum_dtyp": "bf16"}, "did you mean data_types.grad_accum_dtype"),
    ({"grad_accum_dtype": "int8"}, "accepted one of 'fp32', 'bf16'"),
    ({"grad_accum_dtype": None}, "accepted one of 'fp32', 'bf16'"),
])
def test_the_section_is_parsed_strictly(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(_bf16(data_types=section))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_the_gradient_dtype_follows_the_key_the_stage_and_accumulation(
        stage: int, accumulation: int) -> None:
    zero = {"zero_optimization": {"stage": stage}}
    default = parse_config(_bf16(**zero)).grad_dtype_name(accumulation)
    # Unset: bf16 only where the bf16 reduce-scatter is taken once per step (as before).
    assert default == ("bfloat16" if stage >= 2 and accumulation == 1 else "float32")
    for training in ({}, {"fp16": {"enabled": True}}):  # the daemon takes no fp16 grads
        assert parse_config(base_config(**zero, **training)).grad_dtype_name(
            accumulation) == "float32"
    asked = parse_config(_bf16(**zero, data_types={"grad_accum_dtype": "bf16"}))
    assert asked.grad_dtype_name(accumulation) == "bfloat16"


# ---------------------------------------------------------------------- the ranks


def _config(stage: int, *, accum_dtype: str | None = "bf16", offload: bool = True,
            offloadd: dict[str, Any] | None = None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    config = _bf16(zero_optimization=zero, gradient_clipping=0.5,
                   gradient_accumulation_steps=MICRO, offloadd=offloadd or {})
    if accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": accum_dtype}
    return config


def _grad_partition(engine: Any, unit: int) -> torch.Tensor:
    """The unit's gradient partition as the backend holds it (the daemon's shard)."""
    client = getattr(engine.backend, "client", None)
    if client is None:  # the in-rank backend (offload none)
        return engine.backend._units[unit].grad.clone()
    lease = client.acquire(f"u{unit}.grad", "r")
    try:
        assert lease.nbytes == lease.tensor().nbytes  # the whole shard, as allocated
        return lease.tensor().clone()
    finally:
        lease.release()


def _layout(engine: Any) -> dict[int, list[tuple[str, int, int]]]:
    """Each trainable unit's parameters: name, offset and numel in its flat buffer."""
    names = {id(param): name for name, param in engine.module.named_parameters()}
    return {unit.index: [(names[id(slot.param)], slot.offset, slot.numel)
                         for slot in unit.slots] for unit in engine.units if unit.trainable}


def _held_sums(engine: Any) -> list[str]:
    """The dtypes of the running sums the backend keeps on the compute device now."""
    return [str(total.dtype) for total in getattr(engine.backend, "_device_sums", {}).values()]


def _train(rank: int, config: dict[str, Any], *, windows: int,
           room: Callable[[Any], int] | None = None) -> dict[str, Any]:
    """Train ``windows`` accumulation windows; per window the weights it started from
    (rank 0), each micro-batch's device sums and the gradient partitions it ended with."""
    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
    try:
        if room is not None:
            engine.backend.device_sum_room_nbytes = room(engine)
        taken = []
        for step in range(windows):
            masters = consolidate_fp32_state_dict(engine)
            held = []
            for micro in range(MICRO):
                batch = make_batch(step, micro, rank, engine.train_micro_batch_size_per_gpu())
                loss = engine(*(t.to(engine.collectives.device) for t in batch))
                engine.backward(loss)
                held.append(_held_sums(engine))
                engine.step()
            engine.backend.wait_steps()
            taken.append({"masters": masters, "held": held,
                          "grads": {unit: _grad_partition(engine, unit)
                                    for unit in _layout(engine)}})
        return {"windows": taken, "layout": _layout(engine),
                "part_numel": {unit.index: unit.part_numel for unit in engine.units},
                "grad_dtype": engine.grad_dtype, "state": consolidate_fp32_state_dict(engine),
                "copy_engine": engine.offload_stats().get("rank_copy_engine"),
                "device_copies": engine.offload_stats().get("rank_device_copies")}
    finally:
        engine.close()


def _bf16_sums_room(engine: Any) -> int:
    """Exactly the room every unit's bf16 running sum takes: fp32 sums (twice the bytes)
    would leave about half of the units to the per-micro-batch path."""
    return sum(2 * unit.part_numel for unit in engine.units if unit.trainable)


def _zero_copy_cases(rank: int, world: int) -> dict[str, dict[str, Any]]:
    with shared_daemon(rank) as socket_path:
        def daemon(job: str) -> dict[str, Any]:
            return {"socket": socket_path, "job": job}

        return {
            "stage3": _train(rank, _config(3, offloadd=daemon("z3")), windows=WINDOWS),
            "stage1": _train(rank, _config(1, offloadd=daemon("z1")), windows=1),
            "default": _train(rank, _config(3, accum_dtype=None, offloadd=daemon("zd")),
                              windows=1),
            "in_rank": _train(rank, _config(2, offload=False), windows=1),
        }


def _twin_cases(rank: int, world: int) -> dict[str, dict[str, Any]]:
    with shared_daemon(rank) as socket_path:
        def daemon(job: str, **more: Any) -> dict[str, Any]:
            return {"socket": socket_path, "job": job, **more}

        return {
            "device_sums": _train(rank, _config(3, offloadd=daemon("t3")), windows=WINDOWS,
                                  room=_bf16_sums_room),
            "per_micro_batch": _train(rank, _config(3, offloadd=daemon("t3p")),
                                      windows=WINDOWS, room=lambda engine: 0),
            "daemon_copies": _train(rank, _config(3, offloadd=daemon(
                "t3d", device_copies="daemon", staging_slots=3)), windows=1,
                room=lambda engine: 0),
        }


@pytest.fixture(scope="module")
def zero_copy() -> list[dict[str, dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFLOADD_COPY_ENGINE", "inline")  # lease views, no device copies
        return run_ranks(_zero_copy_cases, WORLD)


@pytest.fixture(scope="module")
def twin() -> list[dict[str, dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as patch:
        # The strict twin: device tensors of their own, as on a GPU (the daemon's copies
        # need it: with host compute they fall back to the rank's).
        patch.setenv("OFFLOADD_COPY_ENGINE", "twin")
        patch.setenv("OFFLOADD_TWIN_DEVICE", "strict")
        return run_ranks(_twin_cases, WORLD)


# -------------------------------------------------------------------- the reference


def _rank_grads(model: torch.nn.Module, step: int, micro: int, rank: int
                ) -> dict[str, torch.Tensor]:
    """One rank's bf16 gradients of one micro-batch, scaled for accumulation as the
    engine's backward scales them (``Engine.backward``)."""
    model.zero_grad(set_to_none=True)
    features, labels = make_batch(step, micro, rank, MICRO_BATCH)
    (model(features.to(torch.bfloat16), labels).float() * (1.0 / MICRO)).backward()
    return {name: param.grad.detach().clone() for name, param in model.named_parameters()}


def _summed(terms: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``terms[0] + terms[1] + ...`` in ``dtype``, left to right, rounding after each add."""
    total = terms[0].to(dtype, copy=True)
    for term in terms[1:]:
        total.add_(term)
    return total


def reference_window(masters: dict[str, torch.Tensor], step: int, *, stage: int,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain torch: each parameter's gradient of one window at weights ``masters`` (bf16
    training), reduced over ranks and summed over micro-batches in ``dtype`` in the
    engine's order (the reduce-scatter of stages 2-3 is in bf16, the training dtype)."""
    model = make_model(0).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(masters[name])  # round to nearest even, as the daemon writes params
    grads = [[_rank_grads(model, step, micro, rank) for rank in range(WORLD)]
             for micro in range(MICRO)]
    names = [name for name, _ in model.named_parameters()]
    if stage >= 2:
        return {name: _summed([_summed([grads[micro][rank][name] for rank in range(WORLD)],
                                       torch.bfloat16) for micro in range(MICRO)], dtype)
                for name in names}
    return {name: _summed([_summed([grads[micro][rank][name] for micro in range(MICRO)], dtype)
                           for rank in range(WORLD)], dtype)
            for name in names}


def ours_window(by_rank: list[dict[str, Any]], window: int) -> dict[str, torch.Tensor]:
    """Each parameter's gradient from the ranks' partitions of every unit's flat gradient."""
    ours = {}
    for unit, slots in by_rank[0]["layout"].items():
        flat = torch.cat([result["windows"][window]["grads"][unit] for result in by_rank])
        for name, offset, numel in slots:
            ours[name] = flat.narrow(0, offset, numel)
    return ours


def assert_window_equals(by_rank: list[dict[str, Any]], window: int, *, stage: int,
                         dtype: torch.dtype) -> None:
    masters = by_rank[0]["windows"][window]["masters"]
    expected = reference_window(masters, window, stage=stage, dtype=dtype)
    ours = ours_window(by_rank, window)
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert ours[name].dtype == dtype, name
        assert torch.equal(ours[name], value.reshape(-1)), (window, name)
    # The check can tell the sums apart: in bf16 they differ from fp32 sums rounded once.
    if dtype == torch.bfloat16:
        exact = reference_window(masters, window, stage=stage, dtype=torch.float32)
        assert any(not torch.equal(exact[name].to(dtype), value)
                   for name, value in expected.items())


def _assert_bf16_shards(by_rank: list[dict[str, Any]]) -> None:
    """Every gradient partition is bf16 (2 B per element), accumulation notwithstanding."""
    for result in by_rank:
        assert result["grad_dtype"] == torch.bfloat16
        for window in result["windows"]:
            for unit, grad in window["grads"].items():
                assert grad.dtype == torch.bfloat16
                assert grad.nbytes == 2 * result["part_numel"][unit]


# ------------------------------------------------------------------------ the tests


@pytest.mark.slow
def test_zero_copy_path_sums_in_bf16_every_window(zero_copy) -> None:
    """Stage 3, the arena's running sum on the host (lease views): two windows."""
    by_rank = [result["stage3"] for result in zero_copy]
    assert by_rank[0]["copy_engine"] == "inline"
    _assert_bf16_shards(by_rank)
    for window in range(WINDOWS):
        assert_window_equals(by_rank, window, stage=3, dtype=torch.bfloat16)


@pytest.mark.slow
def test_stages_0_1_sum_locally_and_all_reduce_in_bf16(zero_copy) -> None:
    by_rank = [result["stage1"] for result in zero_copy]
    _assert_bf16_shards(by_rank)
    assert_window_equals(by_rank, 0, stage=1, dtype=torch.bfloat16)


@pytest.mark.slow
def test_the_in_rank_backend_sums_in_bf16(zero_copy) -> None:
    by_rank = [result["in_rank"] for result in zero_copy]
    assert by_rank[0]["copy_engine"] is None  # no daemon: the in-rank optimizer
    _assert_bf16_shards(by_rank)
    assert_window_equals(by_rank, 0, stage=2, dtype=torch.bfloat16)


@pytest.mark.slow
def test_unset_the_sums_stay_fp32_as_before(zero_copy) -> None:
    by_rank = [result["default"] for result in zero_copy]
    for result in by_rank:
        assert result["grad_dtype"] == torch.float32
        for unit, grad in result["windows"][0]["grads"].items():
            assert grad.dtype == torch.float32 and grad.nbytes == 4 * result["part_numel"][unit]
    assert_window_equals(by_rank, 0, stage=3, dtype=torch.float32)


@pytest.mark.slow
def test_device_sums_are_bf16_and_fit_twice_as_many_units(twin) -> None:
    """The twin copy engine with room for exactly every unit's bf16 running sum: all of
    them stay on the device for the whole window (fp32 sums would not all fit), in bf16,
    and the sums equal plain torch's bf16 sums."""
    by_rank = [result["device_sums"] for result in twin]
    assert by_rank[0]["copy_engine"] == "twin"
    _assert_bf16_shards(by_rank)
    units = len(by_rank[0]["layout"])
    for result in by_rank:
        for window in result["windows"]:
            # held after each micro-batch's backward but the last (which writes them out)
            assert [len(held) for held in window["held"]] == [units] * (MICRO - 1) + [0]
            assert {dtype for held in window["held"] for dtype in held} == {"torch.bfloat16"}
    for window in range(WINDOWS):
        assert_window_equals(by_rank, window, stage=3, dtype=torch.bfloat16)


@pytest.mark.slow
def test_per_micro_batch_read_add_write_sums_in_bf16(twin) -> None:
    """No device room: each micro-batch reads the arena's bf16 sum back, adds, writes."""
    by_rank = [result["per_micro_batch"] for result in twin]
    _assert_bf16_shards(by_rank)
    assert all(not held for result in by_rank for window in result["windows"]
               for held in window["held"])
    for window in range(WINDOWS):
        assert_window_equals(by_rank, window, stage=3, dtype=torch.bfloat16)


@pytest.mark.slow
def test_daemon_copies_sum_in_bf16(twin) -> None:
    by_rank = [result["daemon_copies"] for result in twin]
    assert by_rank[0]["device_copies"] == "daemon"
    _assert_bf16_shards(by_rank)
    assert_window_equals(by_rank, 0, stage=3, dtype=torch.bfloat16)


@pytest.mark.slow
def test_every_path_trains_to_the_same_bytes(zero_copy, twin) -> None:
    """Two steps of bf16 accumulation end in the same fp32 masters on the zero-copy path,
    with device sums and with per-micro-batch sums."""
    reference = zero_copy[0]["stage3"]["state"]
    for path in ("device_sums", "per_micro_batch"):
        state = twin[0][path]["state"]
        assert state.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(state[name], value), (path, name)
