"""Property test: an engine without an optimizer evaluates as plain torch does, over the
config space it is built from.

Each example draws the offload device (none / cpu / nvme) x Twin-Flow's ``ratio`` x
fp32 / bf16 x a job arena
that holds the weights or one that forces swapping x units by module class or by size x
a live-parameter budget that holds every unit or one or two x frozen parameters x one or
two parameter groups x ``no_grad`` or ``torch.inference_mode`` x a training checkpoint's
weights loaded (``load_optimizer_states=False``) or the model's own. On 2 gloo ranks (one
pair of long-lived rank processes, one shared daemon) ``trainer.initialize(inference=True)``
at ZeRO stage 3 evaluates a few batches per rank, twice over; every loss must equal plain
torch's on the same weights in the same dtype, bit for bit, the engine must hold no
optimizer state, and ``requires_grad`` must be as the model had it.

CI runs a fixed, seeded sample (``derandomize``) of ``OFFLOADD_PROPERTY_EXAMPLES``
examples (default 5) plus the explicit ``@example`` cases.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
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
WIDTH = 96
BATCHES = 3


@dataclass(frozen=True)
class Case:
    offload: str
    precision: str
    tight_arena: bool
    by_size: bool
    one_unit_live: bool
    frozen: bool
    groups: int
    mode: str
    from_checkpoint: bool
    ratio: float = 1.0
    """Twin-Flow's split (``offload_optimizer.ratio``): the backend an offloaded run uses."""


@st.composite
def cases(draw: Any) -> Case:
    offload = draw(st.sampled_from(["none", "cpu", "nvme"]))
    return Case(offload=offload, precision=draw(st.sampled_from(["fp32", "bf16"])),
                tight_arena=offload == "nvme" and draw(st.booleans()),
                by_size=draw(st.booleans()), one_unit_live=draw(st.booleans()),
                frozen=draw(st.booleans()), groups=draw(st.sampled_from([1, 2])),
                mode=draw(st.sampled_from(["no_grad", "inference_mode"])),
                from_checkpoint=draw(st.booleans()),
                ratio=draw(st.sampled_from([1.0, 0.5])) if offload != "none" else 1.0)


def _model(case: Case, seed: int) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet(width=WIDTH)
    if case.frozen:
        model.blocks[1].requires_grad_(False)
    return model


def _groups(model: TinyNet, case: Case) -> Any:
    if case.groups == 1:
        return None
    trainable = [param for param in model.parameters() if param.requires_grad]
    return [{"params": [p for p in trainable if p.ndim >= 2]},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]


def _config(case: Case, shared: SharedDaemon, job: str, *, optimizer: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3,
                            "stage3_max_live_parameters": 30_000 if case.one_unit_live
                            else 10**9, "stage3_prefetch_bucket_size": 20_000}
    if case.offload != "none":
        offload = {"device": case.offload, "nvme_path": shared.shared_dir}
        zero.update(offload_param=offload, offload_optimizer={**offload, "ratio": case.ratio})
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
        "units": {"min_num_params": 20_000} if case.by_size
        else {"module_classes": [Block.__name__]}}
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    if case.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if case.offload != "none":
        config["offloadd"] = {"socket": shared.socket_path, "job": job,
                              "arena_size": (1 << 20) if case.tight_arena else (64 << 20)}
    return config


def _evaluate(model: Any, rank: int, case: Case, device: torch.device) -> list[float]:
    context = torch.inference_mode() if case.mode == "inference_mode" else torch.no_grad()
    losses = []
    with context:
        for repeat in range(2):
            for index in range(BATCHES):
                features, labels = make_batch(100 + index, repeat, rank, 4)
                losses.append(float(model(features.to(device), labels.to(device))))
    return losses


def evaluate(rank: int, world: int, shared: SharedDaemon, fields: dict[str, Any]
             ) -> dict[str, Any]:
    import trainer

    case = Case(**fields)
    shared.examples += 1
    save_dir = Path(shared.shared_dir) / f"weights{shared.examples}"
    if case.from_checkpoint:  # a short training run's checkpoint, then its weights
        model = _model(case, 1)
        engine, _, _, _ = trainer.initialize(
            model=model, model_parameters=_groups(model, case),
            config=_config(case, shared, f"t{shared.examples}", optimizer=True))
        try:
            for step in range(2):
                engine.backward(engine(*[t.to(engine.collectives.device)
                                         for t in make_batch(step, 0, rank, 4)]))
                engine.step()
            engine.save_checkpoint(save_dir, tag="t")
        finally:
            engine.destroy()  # the module whole again: what the reference evaluates
        weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    else:
        weights = _model(case, 0).state_dict()
    reference = _model(case, 2)
    reference.load_state_dict(weights)
    if case.precision == "bf16":
        reference.to(torch.bfloat16)
    reference.eval()
    expected = [float(reference(features.to(torch.bfloat16) if case.precision == "bf16"
                                else features, labels))
                for features, labels in _inputs(rank)]

    model = _model(case, 0 if not case.from_checkpoint else 3)
    flags = [param.requires_grad for param in model.parameters()]
    engine, _, _, _ = trainer.initialize(
        model=model, model_parameters=_groups(model, case), inference=True,
        config=_config(case, shared, f"i{shared.examples}", optimizer=False))
    try:
        if case.from_checkpoint:
            engine.load_checkpoint(save_dir, tag="t", load_optimizer_states=False)
        engine.eval()
        assert engine.collectives.device.type == "twin", engine.collectives.device
        losses = _evaluate(engine, rank, case, engine.collectives.device)
        trainable = [unit.trainable for unit in engine.units]
        held = engine.offload_stats().get("shard_nbytes") if case.offload != "none" else None
        padded = sum(unit.padded_numel for unit in engine.units)
    finally:
        engine.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    return {"losses": losses, "expected": expected, "trainable": trainable, "held": held,
            "padded": padded, "flags": flags,
            "flags_after": [param.requires_grad for param in model.parameters()]}


def _inputs(rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        for repeat in range(2):
            for index in range(BATCHES):
                yield make_batch(100 + index, repeat, rank, 4)


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    with rank_pools(2, SharedDaemon, STRICT_TWIN) as get:  # the ranks on the strict twin
        yield get


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@example(Case(offload="nvme", precision="bf16", tight_arena=True, by_size=False,
              one_unit_live=True, frozen=True, groups=2, mode="inference_mode",
              from_checkpoint=True, ratio=0.5))
@example(Case(offload="none", precision="fp32", tight_arena=False, by_size=True,
              one_unit_live=False, frozen=False, groups=1, mode="no_grad",
              from_checkpoint=False))
@given(case=cases())
def test_an_inference_engine_evaluates_as_plain_torch(pool: Any, case: Case) -> None:
    for rank, result in enumerate(pool().run(evaluate, asdict(case))):
        where = f"rank{rank} {case}"
        assert result["losses"] == result["expected"], where
        assert result["trainable"] and not any(result["trainable"]), where
        assert result["flags_after"] == result["flags"], where
        if result["held"] is not None:  # the weights in the training dtype, nothing else
            itemsize = 2 if case.precision == "bf16" else 4
            assert result["held"] == itemsize * result["padded"], where  # both ranks
