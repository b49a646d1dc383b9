"""Speculative optimizer steps: started before the global gradient norm is known, undone
exactly where clipping fires, a step overflows or the LR changed meanwhile.

Every case trains the same model twice in the same 2 gloo ranks against a real daemon,
with ``speculative_step`` on and off, and asserts the two leave the same bytes: every
unit's master, moments and parameter partition, the skipped steps and the losses. The
counters show that the speculative run really speculated and really reverted. The
protocol cases drive ``optimizer_step``'s ``undo`` parts straight from a client and
compare with the kernel run on copies.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model, run_ranks
from test_nvme_recovery import kill_daemon, stopped_cleanly

from offloadd.compute import adam
from offloadd.errors import InvalidRequestError, UnknownShardError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient
from trainer.config import OptimizerConfig
from trainer.dist.collectives import Collectives
from trainer.offload.backend import InProcessBackend, UnitSpec
from trainer.zero.optimizer import ZeroOptimizer
from trainer.zero.precision import LossScaler

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

WORLD = 2
LOSS_FACTORS = (0.01, 100.0, 100.0, 100.0, 100.0, 100.0, 0.01, 0.01, 0.01, 0.01, 0.01)
"""Per step, what the loss is multiplied by before backward: at 0.01 the gradient norm
stays under the clip (1.0) and speculation stands; at 100 clipping fires and every
speculated unit is run again. Reverts in a row pause speculation 1, then 2 steps:
step 0 stands, 1 reverts, 2 waits, 3 reverts, 4-5 wait, 6-10 stand."""
SPECULATED_STEPS = 8
REVERTED_STEPS = 2


def _offload(device: str, stage: int, **optimizer: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage,
                            "offload_optimizer": {"device": device, **optimizer}}
    if stage == 3:
        zero["offload_param"] = {"device": device}
    if device == "nvme":
        swap_dir = tempfile.mkdtemp(prefix="offloadd-spec-")
        for key in ("offload_optimizer", "offload_param"):
            if key in zero:
                zero[key]["nvme_path"] = swap_dir
    return zero


def _train(rank: int, config: dict[str, Any], *, change_lr: bool) -> dict[str, Any]:
    import trainer

    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
    losses = []
    try:
        for step, factor in enumerate(LOSS_FACTORS):
            batch = make_batch(step, 0, rank, engine.train_micro_batch_size_per_gpu())
            loss = engine(*(t.to(engine.collectives.device) for t in batch))
            engine.backward(loss * factor)
            if change_lr:  # a hand-written schedule between backward and step, every step
                for group in engine.optimizer.param_groups:
                    group["lr"] *= 0.5 if step % 2 == 0 else 2.0
            engine.step()
            losses.append(loss.item())
        engine.backend.wait_steps()
        units = [unit for unit in engine.units if unit.trainable]
        state = {unit.index: {kind: tensor.clone() for kind, tensor in
                              engine.backend.get_state(unit.index).items()} for unit in units}
        params = {unit.index: engine.backend.host_params(unit.index) for unit in units}
        stats = engine.offload_stats()
        return {"state": state, "params": params, "losses": losses,
                "skipped": engine.optimizer.skipped_steps, "units": len(units),
                "speculated": stats["speculated_units"], "reverted": stats["reverted_units"]}
    finally:
        engine.close()


def _both_ways(rank: int, world: int, config: dict[str, Any],
               change_lr: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank body: the same training with speculation on, then off (its own job each)."""
    runs = []
    for speculative in (True, False):
        case = {**config, "zero_optimization": {**config["zero_optimization"]}}
        zero = case["zero_optimization"]
        zero["offload_optimizer"] = {**zero["offload_optimizer"],
                                     "speculative_step": speculative}
        case["offloadd"] = {"job": f"speculative-{int(speculative)}"}
        runs.append(_train(rank, case, change_lr=change_lr))
    return runs[0], runs[1]


def _assert_same_bytes(speculative: dict[str, Any], waited: dict[str, Any]) -> None:
    assert speculative["losses"] == waited["losses"]
    assert speculative["skipped"] == waited["skipped"]
    for unit, state in waited["state"].items():
        for kind, tensor in state.items():
            assert torch.equal(speculative["state"][unit][kind], tensor), (unit, kind)
        assert torch.equal(speculative["params"][unit], waited["params"][unit]), unit
    assert waited["speculated"] == 0 and waited["reverted"] == 0


def _check(config: dict[str, Any], *, change_lr: bool = False) -> list[dict[str, Any]]:
    results = run_ranks(_both_ways, WORLD, config, change_lr)
    for speculative, waited in results:
        _assert_same_bytes(speculative, waited)
    return [speculative for speculative, _waited in results]


@pytest.mark.parametrize("stage", [2, 3])
def test_clipping_that_fires_on_some_steps_leaves_the_bytes_of_waiting_for_the_norm(
        stage: int) -> None:
    runs = _check(base_config(zero_optimization=_offload("cpu", stage),
                              gradient_clipping=1.0))
    for run in runs:
        # A loaded host may find the daemon behind and pause more than the clip does: the
        # exact counts are pinned by the policy test below.
        assert 0 < run["reverted"] < run["speculated"] <= SPECULATED_STEPS * run["units"]


def test_an_lr_changed_between_backward_and_step_is_applied_exactly() -> None:
    runs = _check(base_config(zero_optimization=_offload("cpu", 2), gradient_clipping=1e6),
                  change_lr=True)
    # The LR changes after every backward, so every unit stepped on speculation took a
    # second pass, however many a loaded host left to wait for the norm instead (it may
    # find the daemon behind and pause speculation; the suite once saw a rank speculate
    # only on the steps that kept their LR, when it changed on every fourth, 2026-11-29).
    assert any(run["speculated"] for run in runs)
    assert all(run["reverted"] == run["speculated"] for run in runs)


def test_fp16_overflow_skips_the_step_and_reverts_what_speculation_did() -> None:
    config = base_config(zero_optimization=_offload("cpu", 2),
                         fp16={"enabled": True, "initial_scale_power": 40, "hysteresis": 1})
    runs = _check(config)
    for run in runs:
        assert run["skipped"] > 0  # the early steps overflow at a scale of 2**40
        assert run["reverted"] > 0


def test_swap_tier_and_bf16_moments_stay_exact_under_speculation() -> None:
    zero = _offload("nvme", 3, state_dtype="bf16")
    runs = _check(base_config(zero_optimization=zero, gradient_clipping=1.0,
                              bf16={"enabled": True}))
    assert all(run["speculated"] > 0 and run["reverted"] > 0 for run in runs)


# -- the policy, on the in-process state -------------------------------------------------


class _OffRankInProcess(InProcessBackend):
    """The rank's own torch state presented as steps that run off the rank (as the
    daemon's do), with ``behind`` of them still queued whenever asked."""

    undo_budget_nbytes = 1 << 40

    def __init__(self, behind: int) -> None:
        super().__init__()
        self.behind = behind

    def step_runs_async(self, unit: int) -> bool:
        return True

    def steps_behind(self, units: list[int]) -> int:
        return min(self.behind, len(units))


UNIT_NUMELS = (33, 1, 700)


def _policy_run(*, speculative: bool, behind: int = 0) -> tuple[ZeroOptimizer, list[Any]]:
    backend = _OffRankInProcess(behind)
    generator = torch.Generator().manual_seed(5)
    for index, numel in enumerate(UNIT_NUMELS):
        backend.register(UnitSpec(index=index, part_numel=numel, param_dtype=torch.float32),
                         torch.randn(numel, generator=generator))
    optimizer = ZeroOptimizer(backend, OptimizerConfig(), collectives=Collectives(),
                              scaler=LossScaler(), clip_norm=1.0, partitioned=False,
                              speculative=speculative)
    history = []
    for factor in LOSS_FACTORS:
        for index in reversed(range(len(UNIT_NUMELS))):  # backward order
            grad = torch.randn(UNIT_NUMELS[index], generator=generator) * factor / 10
            optimizer.take_grad(index, grad, first=True, boundary=True)
        optimizer.step()
        history.append((optimizer.speculated_units, optimizer.reverted_units))
    return optimizer, [backend.get_state(index) for index in range(len(UNIT_NUMELS))]


def test_the_pause_doubles_after_reverts_in_a_row_and_the_bytes_never_change() -> None:
    waited, expected = _policy_run(speculative=False)
    speculated, state = _policy_run(speculative=True)
    for ours, theirs in zip(state, expected, strict=True):
        for kind, tensor in theirs.items():
            assert torch.equal(ours[kind], tensor), kind
    assert waited.speculated_units == 0
    assert speculated.speculated_units == SPECULATED_STEPS * len(UNIT_NUMELS)
    assert speculated.reverted_units == REVERTED_STEPS * len(UNIT_NUMELS)


def test_a_cpu_that_is_behind_pauses_speculation_without_a_revert() -> None:
    # Every window finds its speculative steps queued: speculate at steps 0, 2, 5 and 10
    # only (pauses of 1, 2 and 4 steps); 2 and 5 clip speculated, 1, 3 and 4 while paused.
    optimizer, state = _policy_run(speculative=True, behind=len(UNIT_NUMELS))
    _waited, expected = _policy_run(speculative=False)
    assert optimizer.speculated_units == 4 * len(UNIT_NUMELS)
    assert optimizer.reverted_units == 2 * len(UNIT_NUMELS)
    for ours, theirs in zip(state, expected, strict=True):
        for kind, tensor in theirs.items():
            assert torch.equal(ours[kind], tensor), kind


# -- the protocol, from one client -------------------------------------------------------

NUMEL = 4099
HYPER = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
KINDS = ("master", "exp_avg", "exp_avg_sq", "grad")


def _unit_state(numel: int = NUMEL) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    state = {kind: torch.rand(numel, generator=generator) for kind in KINDS}
    state["exp_avg"] -= 0.5
    return state


def _stepped(state: dict[str, torch.Tensor], grad_scale: float) -> dict[str, torch.Tensor]:
    copies = {kind: tensor.clone() for kind, tensor in state.items()}
    param = torch.empty(state["master"].numel(), dtype=torch.bfloat16)
    adam.adam_step(copies["master"], copies["exp_avg"], copies["exp_avg_sq"], copies["grad"],
                   step=1, grad_scale=grad_scale, param_out=param, **HYPER)
    return {**copies, "param": param}


def _load(client: Any, state: dict[str, torch.Tensor]) -> None:
    client.put_many({f"u.{kind}": tensor for kind, tensor in state.items()})
    client.put("u.param", state["master"].to(torch.bfloat16))
    client.alloc([f"u.next.{kind}" for kind in KINDS[:3]], [state["master"].nbytes] * 3,
                 ["float32"] * 3)


def _read(client: Any) -> dict[str, torch.Tensor]:
    read = {kind: torch.frombuffer(bytearray(client.get(f"u.{kind}")), dtype=torch.float32)
            for kind in KINDS}
    read["param"] = torch.frombuffer(bytearray(client.get("u.param")), dtype=torch.bfloat16)
    return read


def _assert_state(read: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for kind, tensor in expected.items():
        assert torch.equal(read[kind], tensor), kind


def _step(client: Any, undo: str, grad_scale: float = 1.0) -> None:
    client.optimizer_step_async("u", step=1, grad_scale=grad_scale, undo=undo,
                                **HYPER).wait()


@pytest.mark.parametrize(("second", "grad_scale"),
                         [("commit", 1.0), ("redo", 0.25), ("revert", 1.0)])
def test_keep_then_commit_redo_or_revert_in_the_daemon(connect, second: str,
                                                        grad_scale: float) -> None:
    client = connect(arena_nbytes=16 << 20)
    state = _unit_state()
    _load(client, state)
    first = client.optimizer_step_async("u", step=1, undo="keep", **HYPER)
    # Sent without waiting for the kept step: the daemon runs a unit's parts in order.
    client.optimizer_step_async("u", step=1, grad_scale=grad_scale, undo=second,
                                **HYPER).wait()
    first.wait()
    if second == "revert":
        expected = {**state, "param": state["master"].to(torch.bfloat16)}
    else:
        expected = _stepped(state, grad_scale)
    _assert_state(_read(client), expected)
    assert torch.equal(_read(client)["grad"], state["grad"])  # never scaled in place
    with pytest.raises(UnknownShardError):  # the step's copy is gone once resolved
        client.get("u.next.master")


def _offset(client: Any, shard_id: str) -> int:
    lease = client.acquire(shard_id, "r")
    try:
        return lease.offset
    finally:
        lease.release()


def test_a_kept_step_leaves_the_state_and_its_commit_adopts_the_copy_in_place(connect) -> None:
    client = connect(arena_nbytes=16 << 20)
    state = _unit_state()
    _load(client, state)
    _step(client, "keep")
    stepped = _stepped(state, 1.0)
    # Out of place: the state is as it was, the stepped one is in u.next.*, the param new.
    _assert_state(_read_state_only(client), state)
    for kind in KINDS[:3]:
        written = torch.frombuffer(bytearray(client.get(f"u.next.{kind}")), dtype=torch.float32)
        assert torch.equal(written, stepped[kind]), kind
    assert torch.equal(_read(client)["param"], stepped["param"])
    where = {kind: _offset(client, f"u.next.{kind}") for kind in KINDS[:3]}
    _step(client, "commit")
    # The commit copies nothing: each state shard now lives where its stepped copy was.
    assert {kind: _offset(client, f"u.{kind}") for kind in KINDS[:3]} == where
    _assert_state(_read(client), stepped)
    # And the next step starts from the committed state, with the arena's room back.
    client.alloc([f"u.next.{kind}" for kind in KINDS[:3]], [NUMEL * 4] * 3, ["float32"] * 3)
    _step(client, "keep")
    _step(client, "revert")
    _assert_state(_read(client), {**stepped, "param": stepped["master"].to(torch.bfloat16)})


def test_a_commit_adopts_what_the_swap_tier_moved_since_the_step(tmp_path: Path) -> None:
    """A 16 MiB arena swapping to disk: between the kept step and its commit, 14 MiB of
    other shards leased at once push the unit's state and its stepped copy (dirty) out
    to swap. The commit reads the copy back and hands it over; the adopted bytes are
    what later evictions write back and reads return, and what a flush makes durable
    through a kill -9 and ``--recover``."""

    def start(name: str, *extra: str) -> PrivateDaemon:
        return PrivateDaemon.start(tmp_path / name, arena_size=16 << 20,
                                   swap_dirs=[str(tmp_path / "nvme0")],
                                   extra_args=["--arena-hugepages", "off", *extra])

    def connect(daemon: PrivateDaemon) -> OffloadClient:
        return OffloadClient.connect(daemon.socket_path, job="adopt", arena_nbytes=16 << 20,
                                     timeout_s=60)

    state, stepped = _unit_state(1 << 18), None  # 1 MiB a shard
    first = start("run1")
    try:
        with connect(first) as client:
            _load(client, state)
            _step(client, "keep")
            filler = bytes(range(256)) * (1 << 12)  # 1 MiB
            for index in range(40):
                client.put(f"filler{index}", filler)
            with client.acquire_many([f"filler{index}" for index in range(14)], "r"):
                swapped = client.stats()["residency"]
            _step(client, "commit")
            stepped = _stepped(state, 1.0)
            _assert_state(_read(client), stepped)
            client.flush("after-commit")
            for index in range(40):  # out again: what is read back is what was written back
                assert client.get(f"filler{index}") == filler
            _assert_state(_read(client), stepped)
        assert swapped.get("nvme", 0) > 0, swapped
    except BaseException:  # a failure before the kill leaves no daemon behind
        first.stop()
        raise
    kill_daemon(first)
    with stopped_cleanly(start("run2", "--recover")) as second, connect(second) as client:
        _assert_state(_read(client), stepped)


def test_undo_parts_with_missing_or_mismatched_next_shards_are_refused(connect) -> None:
    client = connect(arena_nbytes=16 << 20)
    state = _unit_state()
    client.put_many({f"u.{kind}": tensor for kind, tensor in state.items()})
    with pytest.raises(UnknownShardError, match="next"):
        _step(client, "keep")
    client.alloc([f"u.next.{kind}" for kind in KINDS[:3]], [NUMEL * 4, NUMEL * 4, NUMEL * 2],
                 ["float32", "float32", "bfloat16"])
    with pytest.raises(InvalidRequestError, match=r"u\.next\.exp_avg_sq"):
        _step(client, "keep")
    client.drop([f"u.next.{kind}" for kind in KINDS[:3]])
    client.alloc([f"u.next.{kind}" for kind in KINDS[:3]], [NUMEL * 4] * 3, ["float32"] * 3)
    with pytest.raises(InvalidRequestError, match="never written"):  # no kept step before
        _step(client, "commit")
    _assert_state(_read_state_only(client), state)  # nothing ran
    _step(client, "none")  # the connection and the daemon still serve
    _assert_state(_read_state_only(client), {k: v for k, v in _stepped(state, 1.0).items()
                                             if k != "param"})


def _read_state_only(client: Any) -> dict[str, torch.Tensor]:
    return {kind: torch.frombuffer(bytearray(client.get(f"u.{kind}")), dtype=torch.float32)
            for kind in KINDS}


def test_poll_replies_tells_a_finished_step_without_waiting_for_it(connect) -> None:
    client = connect(arena_nbytes=16 << 20)
    _load(client, _unit_state())
    handle = client.optimizer_step_async("u", step=1, **HYPER)
    deadline = time.monotonic() + 60
    while not handle.done():  # what the optimizer's "is the CPU behind" question reads
        assert time.monotonic() < deadline, "the step's reply never showed"
        client.poll_replies()
        time.sleep(0.001)
    handle.wait()  # its reply was parked, not lost
    client.poll_replies()  # nothing pending: returns at once
    assert client.get("u.master") != _unit_state()["master"].numpy().tobytes()


@pytest.mark.parametrize("super_offload", [True, False])
def test_deepspeeds_superoffload_config_is_read(super_offload: bool) -> None:
    """DeepSpeed's SuperOffload tutorial config: ``super_offload`` decides speculation,
    ``ratio`` is Twin-Flow's, ``cpuadam_cores_perc`` is accepted with a word."""
    from trainer.config import parse_config

    section = {"device": "cpu", "pin_memory": True, "ratio": 0.9,
               "super_offload": super_offload, "cpuadam_cores_perc": 0.9}
    with pytest.warns(UserWarning, match="cpuadam_cores_perc"):
        config = parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_optimizer": section}})
    offload = config.zero_optimization.offload_optimizer
    assert (offload.speculative_step, offload.ratio) == (super_offload, 0.9)
