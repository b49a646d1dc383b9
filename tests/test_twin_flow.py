"""Twin-Flow (``zero_optimization.offload_optimizer.ratio``): the first units' optimizer
state and Adam on the compute device, the rest in the daemon.

2 gloo ranks against a real daemon. On the strict device twin (device memory is a tensor
kind of its own, so a host tensor where CUDA wants a device one fails), training at every
ratio matches torch's AdamW and ratio 1.0, the daemon holds exactly the offloaded units'
state and the device units' state is device tensors; checkpoints move across ratios.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import (
    TinyNet,
    base_config,
    make_batch,
    make_model,
    max_relative_error,
    reference_train,
    run_ranks,
    shared_daemon,
)

from offloadd import moment_codec
from trainer.config import parse_config
from trainer.offload.backend import UnitSpec

WORLD = 2
STEPS = 6
TOLERANCE = 1e-5
"""What tests/test_engine_parity.py holds every offload device to against torch."""

TINY_DEVICE_UNITS = {0.0: [0, 1, 2, 3], 0.3: [0, 1, 2], 0.5: [0, 1], 0.7: [0], 1.0: []}
"""``_dist.TinyNet`` on 2 ranks: unit 0 (the root: input projection and head) holds 87
elements per rank, units 1-3 (the blocks) 384 each, 1239 in all. Ratio 0.3 leaves 867
elements on the device: 87 + 384 + 384 = 855 fit, a third block does not."""


def _config(stage: int, ratio: float, **overrides: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage,
                            "offload_optimizer": {"device": "cpu", "ratio": ratio}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    return base_config(zero_optimization=zero, **overrides)


def _with_daemon(config: dict[str, Any], socket_path: str, job: str) -> dict[str, Any]:
    return {**config, "offloadd": {"socket": socket_path, "job": job, "arena_size": 16 << 20}}


def _train(engine: Any, rank: int, steps: range) -> None:
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps()):
            batch = make_batch(step, micro, rank, engine.train_micro_batch_size_per_gpu())
            loss = engine(*(t.to(engine.collectives.device) for t in batch))
            engine.backward(loss)
            engine.step()


def _placement(engine: Any) -> dict[str, Any]:
    """Where each unit's state is, asked of the daemon itself (this rank's shards) and of
    the device side."""
    from trainer.client import UnknownShardError

    backend = engine.backend
    backend.wait_steps()  # a daemon step in flight holds its unit's shards leased
    daemon = getattr(backend, "offloaded", backend)
    in_daemon = []
    for unit in engine.units:
        try:
            daemon.client.get(f"u{unit.index}.master")
        except UnknownShardError:
            continue
        in_daemon.append(unit.index)
    on_device = sorted(getattr(backend, "device_units", ()))
    state_devices = sorted({value.device.type for unit in on_device
                            for value in backend.on_device.get_state(unit).values()})
    lease_devices = []
    if engine.config.zero_optimization.stage == 3:
        for unit in on_device:
            part, release = backend.lease_params(unit)
            lease_devices.append(part.device.type)
            release()
    stats = engine.offload_stats()
    return {"backend": type(backend).__name__, "in_daemon": in_daemon, "on_device": on_device,
            "state_devices": state_devices, "lease_devices": sorted(set(lease_devices)),
            "stats_device_units": stats.get("device_units"),
            "stats_device_state_nbytes": stats.get("device_state_nbytes"),
            "compute_device": engine.collectives.device.type}


def _parity_cases() -> list[dict[str, Any]]:
    cases = [_config(stage, ratio, gradient_clipping=0.3)
             for stage in (2, 3) for ratio in (0.0, 0.3, 0.7, 1.0)]
    # Accumulation windows (the device side sums micro-batches) with eager steps.
    cases.append(_config(3, 0.5, gradient_accumulation_steps=2))
    return cases


def train_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    results = []
    with shared_daemon(rank) as socket_path:
        for index, config in enumerate(cases):
            model = make_model(0)
            engine, _, _, _ = trainer.initialize(
                model=model, model_parameters=model.parameters(),
                config=_with_daemon(config, socket_path, f"case{index}"))
            try:
                _train(engine, rank, range(STEPS))
                placement = _placement(engine)
                results.append((consolidate_fp32_state_dict(engine), placement))
            finally:
                engine.close()
    return results


@pytest.mark.slow
@pytest.mark.usefixtures("strict_device_twin")
def test_every_ratio_trains_as_torch_adamw_with_the_split_where_it_says() -> None:
    cases = _parity_cases()
    by_rank = run_ranks(train_cases, WORLD, cases)
    full_offload: dict[int, dict[str, torch.Tensor]] = {}
    for index, config in enumerate(cases):
        zero = config["zero_optimization"]
        ratio, stage = zero["offload_optimizer"]["ratio"], zero["stage"]
        state = by_rank[0][index][0]
        error = max_relative_error(state, reference_train(config, STEPS, WORLD))
        assert error < TOLERANCE, (stage, ratio, error)
        if ratio == 1.0:
            full_offload[stage] = state
        expected_device = TINY_DEVICE_UNITS[ratio]
        for rank in range(WORLD):
            placement = by_rank[rank][index][1]
            assert placement["compute_device"] == "twin"
            # The daemon holds exactly the offloaded units' state, and nothing else does.
            assert placement["on_device"] == expected_device, (stage, ratio, placement)
            assert placement["in_daemon"] == [u for u in range(4) if u not in expected_device]
            if ratio == 1.0:
                assert placement["backend"] == "DaemonBackend"  # exactly today's backend
                continue
            assert placement["state_devices"] == (["twin"] if expected_device else [])
            assert placement["stats_device_units"] == len(expected_device)
            per_rank_numel = sum(87 if unit == 0 else 384 for unit in expected_device)
            assert placement["stats_device_state_nbytes"] == 16 * per_rank_numel
            if stage == 3 and expected_device:
                assert placement["lease_devices"] == ["twin"]  # no host round trip
    for index, config in enumerate(cases):
        zero = config["zero_optimization"]
        if config.get("gradient_clipping"):
            error = max_relative_error(by_rank[0][index][0], full_offload[zero["stage"]])
            assert error < TOLERANCE, (zero, error)


def _state_then_train_on(engine: Any, rank: int) -> tuple[dict[int, Any], Any, Any]:
    """The per-unit optimizer state and the placement now; then steps 5-9 and the fp32
    weights they leave."""
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    state = {unit.index: engine.backend.get_state(unit.index) for unit in engine.units}
    placement = _placement(engine)
    _train(engine, rank, range(5, 10))
    return state, placement, consolidate_fp32_state_dict(engine)


def checkpoint_cases(rank: int, world: int, cases: list[tuple[dict[str, Any], dict[str, Any]]],
                     root: str) -> list[Any]:
    """Per case: train 5 steps under the first config, save, train 5 more (the straight
    run); a fresh engine under the second config loads the checkpoint and trains the same
    5 steps. Returns the straight and resumed states, both engines' placements and the
    per-unit optimizer state right before the save and right after the load."""
    import trainer

    results = []
    with shared_daemon(rank) as socket_path:
        for index, (saving, loading) in enumerate(cases):
            save_dir = Path(root) / f"case{index}"
            engine, _, _, _ = trainer.initialize(
                model=make_model(0), config=_with_daemon(saving, socket_path, f"s{index}"))
            try:
                _train(engine, rank, range(5))
                engine.save_checkpoint(save_dir)
                saved, saved_placement, straight = _state_then_train_on(engine, rank)
            finally:
                engine.close()
            fresh, _, _, _ = trainer.initialize(
                model=make_model(1), config=_with_daemon(loading, socket_path, f"l{index}"))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # same moment format: nothing to convert
                    path, _ = fresh.load_checkpoint(save_dir)
                assert path is not None
                loaded, loaded_placement, resumed = _state_then_train_on(fresh, rank)
            finally:
                fresh.close()
            results.append({"straight": straight, "resumed": resumed, "saved": saved,
                            "loaded": loaded, "saved_placement": saved_placement,
                            "loaded_placement": loaded_placement})
    return results


def _bf16_moments(config: dict[str, Any]) -> dict[str, Any]:
    config["zero_optimization"]["offload_optimizer"]["state_dtype"] = "bf16"
    return config


CHECKPOINT_CASES = [
    (_config(2, 0.5, gradient_clipping=0.3), _config(2, 1.0, gradient_clipping=0.3)),
    (_config(3, 1.0, gradient_clipping=0.3), _config(3, 0.5, gradient_clipping=0.3)),
    # Compact daemon moments: bf16 in the daemon, fp32 on the device, either way round.
    (_bf16_moments(_config(2, 1.0)), _bf16_moments(_config(2, 0.5))),
    (_bf16_moments(_config(2, 0.5)), _bf16_moments(_config(2, 1.0))),
]


def _as_fp32(value: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "master" or value.dtype == torch.float32:
        return value
    return moment_codec.decode(value, signed=kind == "exp_avg")


@pytest.mark.slow
@pytest.mark.usefixtures("strict_device_twin")
def test_checkpoints_move_units_across_ratios() -> None:
    with tempfile.TemporaryDirectory() as root:
        by_rank = run_ranks(checkpoint_cases, WORLD, CHECKPOINT_CASES, root)
    for index, (saving, loading) in enumerate(CHECKPOINT_CASES):
        compact = saving["zero_optimization"]["offload_optimizer"].get("state_dtype") == "bf16"
        for rank in range(WORLD):
            result = by_rank[rank][index]
            for placement, config in ((result["saved_placement"], saving),
                                      (result["loaded_placement"], loading)):
                expected = TINY_DEVICE_UNITS[config["zero_optimization"]["offload_optimizer"]
                                             ["ratio"]]
                assert placement["on_device"] == expected, (index, placement)
                assert placement["in_daemon"] == [u for u in range(4) if u not in expected]
            for unit, saved in result["saved"].items():
                loaded = result["loaded"][unit]
                assert set(loaded) == set(saved) == {"master", "exp_avg", "exp_avg_sq"}
                for kind in saved:
                    if not compact or saved[kind].dtype == loaded[kind].dtype:
                        assert torch.equal(loaded[kind], saved[kind]), (index, unit, kind)
                    elif loaded[kind].dtype == torch.float32:  # bf16 decoded on the device
                        assert torch.equal(loaded[kind], _as_fp32(saved[kind], kind))
                    else:  # fp32 device moments stored as bf16 by the daemon
                        assert torch.allclose(_as_fp32(loaded[kind], kind), saved[kind],
                                              rtol=1e-2, atol=0)
        straight, resumed = by_rank[0][index]["straight"], by_rank[0][index]["resumed"]
        # Compact cases: the units that changed sides kept fp32 moments on one side and
        # bf16 ones (stochastically rounded) on the other for the last 5 steps.
        bound = 1e-2 if compact else TOLERANCE
        assert max_relative_error(resumed, straight) < bound, index
        if not compact:
            reference = reference_train(loading, 10, WORLD)
            assert max_relative_error(resumed, reference) < TOLERANCE, index


# ---------------------------------------------------------------- the rule and the key


def _specs(sizes: list[int], frozen: frozenset[int] = frozenset()) -> list[UnitSpec]:
    return [UnitSpec(index=index, part_numel=numel, param_dtype=torch.float32,
                     trainable=index not in frozen) for index, numel in enumerate(sizes)]


def test_device_units_are_the_first_trainable_units_within_one_minus_ratio() -> None:
    from trainer.offload.split import device_units

    sizes = [87, 384, 384, 384]
    for ratio, expected in TINY_DEVICE_UNITS.items():
        assert device_units(_specs(sizes), ratio) == frozenset(expected), ratio
    # Taken in order while they fit: a small unit after the first misfit stays offloaded.
    assert device_units(_specs([10, 50, 5, 35]), 0.6) == frozenset({0})
    # Frozen units are neither counted nor placed on the device.
    assert device_units(_specs([100, 10, 100, 100], frozen=frozenset({1})), 0.0) == {0, 2, 3}
    assert device_units(_specs([100, 1000, 100, 100], frozen=frozenset({1})), 1 / 3) == {0, 2}


@pytest.mark.parametrize("ratio", [-0.1, 1.5, "half", float("nan"), True])
def test_a_bad_ratio_names_the_key(ratio: Any) -> None:
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 2,
                                    "offload_optimizer": {"device": "cpu", "ratio": ratio}}}
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.ratio"):
        parse_config(config)


def test_a_ratio_is_read_without_the_ignored_key_warning() -> None:
    for device in ("cpu", "none"):  # DeepSpeed users keep ratio when they turn offload off
        config = {"train_micro_batch_size_per_gpu": 1,
                  "zero_optimization": {"stage": 2,
                                        "offload_optimizer": {"device": device, "ratio": 0.4}}}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            parsed = parse_config(config)
        assert parsed.zero_optimization.offload_optimizer.ratio == 0.4


def test_a_split_past_the_device_memory_names_the_ratio_that_fits() -> None:
    from trainer.offload.split import check_device_room, device_state_nbytes, device_units

    specs = _specs([100, 1000, 1000, 1000])
    per_element = 16 + 4  # fp32 master, moments and grad; fp32 parameters (_specs)
    assert device_state_nbytes(specs[1]) == 1000 * per_element
    device = torch.device("cuda", 0)
    chosen = device_units(specs, 0.0)
    check_device_room(specs, chosen, 0.0, None, device)  # the host: unbounded
    check_device_room(specs, chosen, 0.0, 3100 * per_element, device)  # exactly fits
    with pytest.raises(ValueError, match=r"offload_optimizer\.ratio=0\.0 keeps .* cuda:0") as error:
        check_device_room(specs, chosen, 0.0, 2000 * per_element, device)
    suggested = float(str(error.value).split("at least ")[1].split(" ")[0])
    assert suggested == pytest.approx(0.68)  # within half the free memory: 1 - 1000/3100
    fitting = device_units(specs, suggested)
    check_device_room(specs, fitting, suggested, 2000 * per_element, device)
    assert fitting == {0}


def _init_split(rank: int, world: int, ratio: float) -> str | dict[str, Any]:
    """Initialize a wider TinyNet at ``ratio``: the refusal's message, or what stays on the
    device and how much the device had free."""
    import trainer
    from trainer.device import twin_memory
    from trainer.device.twin import twin_device
    from trainer.offload.split import device_state_nbytes

    twin_device()  # the twin takes its capacity from the environment as it starts

    with shared_daemon(rank) as socket_path:
        torch.manual_seed(0)
        model = TinyNet(width=48, depth=8)  # 9.5k parameters a block: 760 KB of state a rank
        free_before = twin_memory.mem_get_info()[0]
        try:
            engine, _, _, _ = trainer.initialize(
                model=model, model_parameters=model.parameters(),
                config=_with_daemon(_config(3, ratio), socket_path, f"room{ratio}"))
        except ValueError as error:
            return str(error)
        try:
            backend = engine.backend
            kept = sum(device_state_nbytes(spec) for spec in backend._planned_specs
                       if spec.index in backend.device_units)
            return {"device_units": sorted(backend.device_units), "kept_nbytes": kept,
                    "free_before_nbytes": free_before}
        finally:
            engine.close()


@pytest.mark.slow
@pytest.mark.usefixtures("strict_device_twin")
def test_a_split_past_the_capped_twin_is_refused_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a twin with 512 KiB of device memory, all of the optimizer state on the device
    (ratio 0.0: 760 KB a rank) does not fit: every rank's initialize names the ratio
    that keeps it within half the free memory, and that ratio initializes. (A state that
    fits the free memory but leaves too little for the step is not refused: it runs out
    of memory in the step, as on a GPU.)"""
    monkeypatch.setenv("OFFLOADD_TWIN_MEMORY", str(512 << 10))
    refused = run_ranks(_init_split, WORLD, 0.0)
    assert all(isinstance(message, str) and "offload_optimizer.ratio=0.0" in message
               for message in refused), refused
    suggested = float(refused[0].split("at least ")[1].split(" ")[0])
    assert 0.0 < suggested < 1.0
    placed = run_ranks(_init_split, WORLD, suggested)
    assert placed[0] == placed[1] or placed[0]["device_units"] == placed[1]["device_units"]
    assert placed[0]["device_units"]  # some state stays on the device
    assert placed[0]["kept_nbytes"] <= placed[0]["free_before_nbytes"] // 2
