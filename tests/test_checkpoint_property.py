"""Property test: a checkpoint resumes exactly, over the config space users combine.

Each example draws ZeRO stage 0-3 x offload none / cpu / nvme x Twin-Flow's ``ratio`` x
the moments' ``state_dtype`` x speculative steps x fp32 / bf16 / fp16 (with an initial
loss scale that overflows, or not) x gradient accumulation 1 / 2 x clipping x an LR
schedule x a job arena that holds the state or one that forces swapping x the step the
checkpoint is saved at x frozen parameters (left out of the checkpoint, as HF Trainer
saves a PEFT run's) x what is loaded (DeepSpeed's ``load_checkpoint`` options). On 2 gloo
ranks (one pair of long-lived rank processes, one shared daemon) an engine trains
``STEPS`` steps and saves a checkpoint after ``save_at`` of them; a fresh engine (another
model's initial weights, the same frozen base; another daemon job) loads it and trains the
rest. A full load must equal the uninterrupted run bit for bit: every loss after the save,
the fp32 master weights, the Adam moments, the step counts, the learning rate and the loss
scale. A partial load (``load_optimizer_states=False``, ``load_module_only=True``) must
give the checkpoint's weights and keep the fresh engine's own optimizer state, compared
with both engines' checkpoint files.

CI runs a fixed, seeded sample (``derandomize``) of ``OFFLOADD_PROPERTY_EXAMPLES``
examples (default 5) plus the explicit ``@example`` cases; set the variable higher for a
larger sample.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import STRICT_TWIN, Block, SharedDaemon, TinyNet, make_batch, rank_pools

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("OFFLOADD_PROPERTY_EXAMPLES", "5"))
STEPS = 4
WIDTH = 160
"""TinyNet's width: ~0.3 M parameters, ~4 MB of fp32 master and moments, so the tight
arena below cannot hold a job's state and the swap tier pages it."""
ROOMY_ARENA = 64 << 20
TIGHT_ARENA = 2 << 20


@dataclass(frozen=True)
class Case:
    stage: int
    offload: str
    ratio: float
    state_dtype: str
    speculative: bool
    precision: str
    overflow: bool
    accumulation: int
    clip: bool
    schedule: bool
    tight_arena: bool
    save_at: int
    frozen: bool = False
    """The input layer and first block are frozen and left out of the checkpoint
    (``exclude_frozen_parameters``); the checkpoint loads with ``load_module_strict=False``."""
    load: str = "full"
    """full | weights (``load_optimizer_states=False``) | module (``load_module_only``)."""
    resume_offload: str = ""
    """Where the resumed engine offloads ("": where the saving one did). A checkpoint holds
    fp32 master weights and moments whatever the device, so DeepSpeed users move a run
    between offload devices at a restart; then only the optimizer's rounding may differ
    (the daemon's native Adam against torch's), so the run is held to ``CLOSE``."""

    def resumed(self) -> Case:
        """The case the resumed engine is configured by."""
        if not self.resume_offload or self.resume_offload == self.offload:
            return self
        return replace(self, offload=self.resume_offload, resume_offload="",
                       ratio=self.ratio if self.resume_offload != "none" else 1.0,
                       speculative=self.speculative or self.resume_offload == "none",
                       tight_arena=False)


CLOSE = 1e-5
"""Largest difference, relative to each tensor's largest value, between a run resumed on
another offload device and the uninterrupted one (a few fp32 ulps per step)."""
HALF_CLOSE = 1e-2
"""The same for bf16 / fp16 training: the devices may reduce the half-precision gradients
in another order or dtype, and the optimizers' fp32 rounding moves a master weight across
a bf16 rounding boundary now and then, so a gradient may land a half-precision ulp or two
(4e-3 of it in bf16) away, and the moments with it: ``exp_avg_sq``, a square, twice as
far, so ``assert_same`` compares its square root (a found case: bf16, stage 2, two
micro-batches, saved without offload and resumed on cpu; the uninterrupted runs on
either device differ as much: ``exp_avg_sq`` 1.27e-2, its root 7.2e-3, ``exp_avg``
6.7e-3). A restore that lost the moments or the step count is off by far more."""


@st.composite
def cases(draw: Any) -> Case:
    stage = draw(st.integers(0, 3))
    offload = draw(st.sampled_from(["none", "cpu", "nvme"])) if stage else "none"
    offloaded = offload != "none"
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    state_dtype = draw(st.sampled_from(["fp32", "bf16", "8bit"])) if offloaded else "fp32"
    return Case(stage=stage, offload=offload,
                ratio=draw(st.sampled_from([1.0, 0.5])) if offloaded else 1.0,
                state_dtype=state_dtype,
                speculative=draw(st.booleans()) if offloaded else True,
                precision=precision,
                overflow=precision == "fp16" and draw(st.booleans()),
                accumulation=draw(st.sampled_from([1, 2])), clip=draw(st.booleans()),
                schedule=draw(st.booleans()),
                tight_arena=offload == "nvme" and draw(st.booleans()),
                save_at=draw(st.integers(1, STEPS - 1)),
                frozen=draw(st.booleans()), load=draw(st.sampled_from(list(LOADS))),
                resume_offload=draw(st.sampled_from(["", "none", "cpu", "nvme"]))
                if stage and state_dtype == "fp32" else "")


LOADS: dict[str, dict[str, bool]] = {
    "full": {}, "weights": {"load_optimizer_states": False},
    "module": {"load_module_only": True}}


def make_model(seed: int, case: Case) -> TinyNet:
    """TinyNet from ``seed``; with ``case.frozen`` its input layer and first block are seed
    0's and frozen (the base model every run of a fine-tune shares)."""
    torch.manual_seed(seed)
    model = TinyNet(width=WIDTH)
    if case.frozen:
        torch.manual_seed(0)
        base = TinyNet(width=WIDTH)
        for name in ("inp", "blocks.0"):
            part, base_part = model.get_submodule(name), base.get_submodule(name)
            part.load_state_dict(base_part.state_dict())
            part.requires_grad_(False)
    return model


def ds_config(case: Case, swap_dir: str, socket_path: str, job: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case.stage}
    if case.offload != "none":
        zero["offload_optimizer"] = {"device": case.offload, "nvme_path": swap_dir,
                                     "ratio": case.ratio, "state_dtype": case.state_dtype,
                                     "speculative_step": case.speculative}
        if case.stage == 3:
            zero["offload_param"] = {"device": case.offload, "nvme_path": swap_dir}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case.accumulation,
        "gradient_clipping": 0.05 if case.clip else 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99],
                                                  "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "units": {"module_classes": [Block.__name__]},
    }
    if case.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if case.precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16 if case.overflow else 8,
                          "loss_scale_window": 2}
    if case.schedule:
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_max_lr": 3e-3, "warmup_num_steps": 2, "total_num_steps": STEPS + 2}}
    if case.offload != "none":
        config["offloadd"] = {"socket": socket_path, "job": job,
                              "arena_size": TIGHT_ARENA if case.tight_arena else ROOMY_ARENA}
    return config


# ------------------------------------------------------------------ rank side


def _train(engine: Any, rank: int, steps: range) -> list[float]:
    assert engine.collectives.device.type == "twin", engine.collectives.device
    losses = []
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps()):
            batch = make_batch(step, micro, rank, engine.train_micro_batch_size_per_gpu())
            loss = engine(*[part.to(engine.collectives.device) for part in batch])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _summary(engine: Any, rank: int, losses: list[float], save_dir: Path) -> dict[str, Any]:
    """What the run ended with: losses, counters, and this rank's whole checkpoint file
    (fp32 master, Adam moments in their stored format, loss scaler, scheduler)."""
    return {"losses": losses, "global_steps": engine.global_steps, "lr": engine.get_lr(),
            "loss_scale": engine.loss_scale, "adam_steps": engine.optimizer.step_count,
            "checkpoint": _rank_file(engine, rank, save_dir)}


def _rank_file(engine: Any, rank: int, save_dir: Path) -> dict[str, Any]:
    """This rank's file of a whole checkpoint the engine writes now (frozen units in)."""
    engine.save_checkpoint(save_dir, tag="t")
    return dict(torch.load(save_dir / "t" / f"rank_{rank:05d}.pt", weights_only=False))


def round_trip(rank: int, world: int, shared: SharedDaemon, case_fields: dict[str, Any]
               ) -> dict[str, Any]:
    import trainer

    case = Case(**case_fields)
    shared.examples += 1
    save_dir = Path(shared.shared_dir) / f"ckpt{shared.examples}"
    config = ds_config(case, shared.shared_dir, shared.socket_path, f"s{shared.examples}")
    engine, _, _, _ = trainer.initialize(model=make_model(0, case), config=config)
    try:
        _train(engine, rank, range(case.save_at))
        engine.save_checkpoint(save_dir, client_state={"at": case.save_at},
                               exclude_frozen_parameters=case.frozen)
        straight = _summary(engine, rank, _train(engine, rank, range(case.save_at, STEPS)),
                            save_dir / "straight")
        stats = engine.offload_stats() if case.offload != "none" else {}
    finally:
        engine.close()
    config = ds_config(case.resumed(), shared.shared_dir, shared.socket_path,
                       f"r{shared.examples}")
    fresh, _, _, _ = trainer.initialize(model=make_model(1, case), config=config)
    loaded: dict[str, Any] = {}
    try:
        if case.load != "full":
            loaded["before"] = _rank_file(fresh, rank, save_dir / "before")
            loaded["saved"] = torch.load(save_dir / f"global_step{case.save_at}"
                                         / f"rank_{rank:05d}.pt", weights_only=False)
        path, client_state = fresh.load_checkpoint(save_dir, load_module_strict=not case.frozen,
                                                   **LOADS[case.load])
        assert path is not None and client_state == {"at": case.save_at}
        if case.load != "full":
            loaded["after"] = _rank_file(fresh, rank, save_dir / "after")
        resumed = _summary(fresh, rank, _train(fresh, rank, range(case.save_at, STEPS)),
                           save_dir / "resumed")
    finally:
        fresh.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    swapped = {key: value for key, value in stats.items()
               if "swap" in key or "nvme" in key or "evict" in key}
    return {"straight": straight, "resumed": resumed, "swapped": swapped, "loaded": loaded}


# ------------------------------------------------------------------ parent side


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    with rank_pools(2, SharedDaemon, STRICT_TWIN) as get:  # the ranks on the strict twin
        yield get


def assert_same(straight: Any, resumed: Any, where: str, close: float = 0.0) -> None:
    """``resumed`` equals ``straight`` (nested dicts, lists, tensors, numbers); with
    ``close`` > 0, floats and float tensors may differ by ``close`` relative to the largest
    value (half-precision tensors by two of their ulps, if more)."""
    if isinstance(straight, torch.Tensor):
        assert isinstance(resumed, torch.Tensor) and straight.dtype == resumed.dtype, where
        if not close or not straight.is_floating_point():
            assert torch.equal(straight, resumed), (
                f"{where}: {(straight.float() - resumed.float()).abs().max().item()} apart")
            return
        tolerance = max(close, 2 * torch.finfo(straight.dtype).eps)
        straight, resumed = straight.float(), resumed.float()
        if where.endswith(".exp_avg_sq"):
            # A second moment moves by twice its gradients' relative difference: its
            # square root (their RMS) is held to the gradients' tolerance.
            straight, resumed = straight.sqrt(), resumed.sqrt()
        scale = straight.abs().max().item()
        apart = (straight - resumed).abs().max().item()
        assert apart <= tolerance * scale, f"{where}: {apart} apart (scale {scale})"
    elif isinstance(straight, dict):
        assert isinstance(resumed, dict) and sorted(map(str, straight)) == sorted(
            map(str, resumed)), f"{where}: keys {list(straight)} vs {list(resumed)}"
        for key in straight:
            assert_same(straight[key], resumed[key], f"{where}.{key}", close)
    elif isinstance(straight, (list, tuple)):
        assert len(straight) == len(resumed), where
        for index, (a, b) in enumerate(zip(straight, resumed, strict=True)):
            assert_same(a, b, f"{where}[{index}]", close)
    elif close and isinstance(straight, float):
        assert math.isclose(straight, resumed, rel_tol=close, abs_tol=close), (
            f"{where}: {straight!r} vs {resumed!r}")
    else:
        assert straight == resumed, f"{where}: {straight!r} vs {resumed!r}"


def assert_partial_load(loaded: dict[str, Any], case: Case, where: str) -> None:
    """After a partial load the weights are the checkpoint's (``saved``) and the rest the
    fresh engine's own (``before``), as DeepSpeed's options say (``LoadOptions``)."""
    before, saved, after = loaded["before"], loaded["saved"], loaded["after"]
    assert sorted(after["units"]) == sorted(before["units"]), where
    for index, state in after["units"].items():
        source = saved["units"].get(index)
        assert source is not None or case.frozen, f"{where}: unit {index} not saved"
        for kind, value in state.items():
            weight = kind in ("param", "master") and source is not None
            expected = source[kind] if weight else before["units"][index][kind]
            assert_same(expected, value, f"{where}: unit {index} {kind}")
    assert_same({**before["untracked"], **saved["untracked"]}, after["untracked"],
                f"{where}: untracked")
    counters = ("global_steps", "micro_steps", "global_samples", "lr_scheduler")
    for key, value in after["engine"].items():
        from_saved = case.load == "weights" and key in counters
        expected = (saved if from_saved else before)["engine"][key]
        if key == "optimizer" and case.load == "weights":  # the scheduler sets the lr
            expected = {**expected, "param_groups": saved["engine"][key]["param_groups"]}
        assert_same(expected, value, f"{where}: {key}")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@example(Case(stage=3, offload="nvme", ratio=0.5, state_dtype="bf16", speculative=True,
              precision="fp16", overflow=True, accumulation=2, clip=True, schedule=True,
              tight_arena=True, save_at=2))
@example(Case(stage=2, offload="cpu", ratio=1.0, state_dtype="8bit", speculative=False,
              precision="bf16", overflow=False, accumulation=1, clip=True, schedule=False,
              tight_arena=False, save_at=1))
@example(Case(stage=3, offload="nvme", ratio=1.0, state_dtype="8bit", speculative=True,
              precision="bf16", overflow=False, accumulation=1, clip=False, schedule=True,
              tight_arena=True, save_at=2, frozen=True, load="weights"))
@example(Case(stage=1, offload="cpu", ratio=0.5, state_dtype="fp32", speculative=False,
              precision="fp16", overflow=False, accumulation=2, clip=True, schedule=True,
              tight_arena=False, save_at=1, frozen=True, load="module", resume_offload="none"))
@example(Case(stage=2, offload="none", ratio=1.0, state_dtype="fp32", speculative=True,
              precision="bf16", overflow=False, accumulation=2, clip=False, schedule=False,
              tight_arena=False, save_at=1, resume_offload="cpu"))
@given(case=cases())
def test_checkpoint_resumes_exactly(pool: Any, case: Case) -> None:
    ranks = pool().run(round_trip, asdict(case))
    moved = case.resumed() != case
    close = 0.0 if not moved else CLOSE if case.precision == "fp32" else HALF_CLOSE
    for rank, result in enumerate(ranks):
        if case.load == "full":
            assert_same(result["straight"], result["resumed"], f"rank{rank} {case}", close)
        else:
            assert_partial_load(result["loaded"], case, f"rank{rank} {case}")
    if case.tight_arena:
        assert any(ranks[0]["swapped"].values()), ranks[0]["swapped"]
