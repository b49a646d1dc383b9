"""The twin plays CUDA's streams: work issued ahead of compute is waited for at use.

``TwinCopyEngine`` runs copies on a worker (the copy stream) and the host plays
the compute stream. Inside ``ahead_of_compute`` the host issues to the copy
stream and does not wait; compute waits at use (``wait_on_compute(ready())``).
These tests check that structure, never timings: with the worker held, issuing
returns; in a stage-3 step the H2D of the next unit is issued before the
current unit computes and waited for only after it; no gradient D2H is waited
for during backward (the optimizer step it feeds is sent once it completed).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import trainer
import trainer.device.copy_engine
from trainer.demo import train as demo_train
from trainer.device.copy_engine import CopyAfterReleaseError, TwinCopyEngine, TwinEvent

ISSUE_TIMEOUT_S = 60.0
"""Only a failing test waits this long (issuing hung on a held worker)."""


@pytest.fixture
def twin() -> Iterator[TwinCopyEngine]:
    engine = TwinCopyEngine(max_delay_s=0.0)
    yield engine
    engine.close()


def _returns_while_held(twin: TwinCopyEngine, work: Any) -> bool:
    """Run ``work`` with the copy worker paused: True when it returned meanwhile."""
    with twin.hold():
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        worker.join(ISSUE_TIMEOUT_S)
        returned = not worker.is_alive()
    worker.join()
    return returned


def test_work_ahead_of_compute_is_waited_for_at_use_not_at_issue(twin: TwinCopyEngine) -> None:
    src, dst, doubled = torch.arange(64.0), torch.zeros(64), torch.zeros(64)
    marker: list[Any] = []

    def issue() -> None:
        with twin.ahead_of_compute():
            twin.wait_on_compute(twin.h2d(dst, src))  # a stream wait: the host goes on
            twin.run_on_stream(lambda: torch.mul(dst, 2, out=doubled))  # behind the copy
            marker.append(twin.ready())

    assert _returns_while_held(twin, issue)
    assert not marker[0].query()
    twin.wait_on_compute(marker[0])  # at use: the host waits here
    assert torch.equal(doubled, 2 * src)


def test_ready_fails_with_a_failed_copy_issued_before_it(connect, twin: TwinCopyEngine) -> None:
    client = connect()
    client.put("p", torch.arange(16, dtype=torch.float32))
    lease = client.acquire("p", "r")
    with twin.hold(), twin.ahead_of_compute():
        twin.h2d(torch.zeros(16), lease.tensor(torch.float32), guard=lease)
        lease.release()  # the bug the twin catches: the DMA has not read the bytes yet
        marker = twin.ready()
    with pytest.raises(CopyAfterReleaseError):
        twin.wait_on_compute(marker)
    again = twin.ready()  # a marker reports a failure once
    twin.wait_on_compute(again)


def test_a_collective_issued_ahead_waits_for_the_copies_before_it(twin: TwinCopyEngine) -> None:
    """gloo (the twin's NCCL) runs at issue: before it, the host waits for its input."""
    src, dst = torch.arange(8.0), torch.zeros(8)
    with twin.ahead_of_compute():
        twin.h2d(dst, src)
        twin.before_collective()
        assert torch.equal(dst, src)


def test_stage3_prefetch_returns_with_its_copy_in_flight(connect, twin: TwinCopyEngine) -> None:
    """A prefetched gather issues the partition's H2D and returns; the gather at use waits."""
    from trainer.config import UnitsConfig
    from trainer.dist.collectives import Collectives
    from trainer.offload.backend import UnitSpec
    from trainer.offload.daemon_backend import DaemonBackend
    from trainer.zero.gather import FullParams, GatherState
    from trainer.zero.partition import build_units
    from trainer.zero.stages import OffloadedPartitions

    backend = DaemonBackend(connect(), collectives=Collectives(), copies=twin)
    try:
        values = torch.arange(32, dtype=torch.float32)
        backend.register(UnitSpec(index=0, part_numel=32, param_dtype=torch.float32), values)
        layer = torch.nn.Linear(8, 4, bias=False)
        weight = layer.weight
        (unit,) = build_units(layer, UnitsConfig(), num_parts=1, part_index=0)
        full = FullParams(Collectives(), OffloadedPartitions(backend, torch.float32),
                          torch.float32, max_live_numel=1 << 20, copies=twin)
        full.adopt(unit)
        assert _returns_while_held(twin, lambda: full.prefetch([unit], 1 << 20))
        assert full.state(unit) is GatherState.GATHERING
        full.gather(unit)
        assert torch.equal(weight.detach().reshape(-1), values)
        full.free(unit)
    finally:
        backend.close()


class RecordingTwin(TwinCopyEngine):
    """Logs, in the host's order, each H2D into a unit's parameters and each time the
    host blocks on a copy event, tagged with the event's copy."""

    def __init__(self, log: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log = log
        self.tags: dict[int, str] = {}
        self._last_h2d = ""

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Any = None) -> Any:
        event = super().h2d(dst, src, guard=guard)
        shard_id = getattr(guard, "shard_id", "")
        self.tags[id(event)] = self._last_h2d = f"h2d {shard_id.split('.')[0]}"
        self.log.append(("issue", self._last_h2d))
        return event

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Any = None) -> Any:
        event = super().d2h(dst, src, guard=guard)
        self.tags[id(event)] = f"d2h {getattr(guard, 'shard_id', '').split('.')[0]}"
        return event

    def ready(self) -> Any:
        event = super().ready()
        self.tags[id(event)] = f"ready {self._last_h2d.removeprefix('h2d ')}"
        return event


def _record_blocking_waits(monkeypatch: pytest.MonkeyPatch, engines: list[RecordingTwin]) -> None:
    synchronize = TwinEvent.synchronize

    def recorded(event: TwinEvent) -> None:
        if not event.query():
            for engine in engines:
                if id(event) in engine.tags:
                    engine.log.append(("wait", engine.tags[id(event)]))
        synchronize(event)

    monkeypatch.setattr(TwinEvent, "synchronize", recorded)


def test_stage3_step_issues_each_h2d_before_the_previous_unit_computes(monkeypatch) -> None:
    """Forward of a stage-3 step on the twin, after the first step: unit k+1's H2D is
    issued before unit k computes, and the host waits for it only after that compute (at
    use); backward waits for no gradient D2H."""
    log: list[tuple[str, str]] = []
    engines: list[RecordingTwin] = []

    def select(device: Any, kind: str | None = None) -> RecordingTwin:
        engines.append(RecordingTwin(log, max_delay_s=0.0, device=torch.device(device)))
        return engines[-1]

    monkeypatch.setattr(trainer.device.copy_engine, "select_copy_engine", select)
    _record_blocking_waits(monkeypatch, engines)
    torch.manual_seed(0)
    model = demo_train.TinyGPT(depth=3)
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}},
              "units": {"module_classes": ["GPTBlock"]}}
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    blocks = [f"u{index}" for index in range(1, 4)]  # unit 0 is the root (embeddings, head)
    for name, block in zip(blocks, engine.module.blocks, strict=True):
        block.register_forward_pre_hook(lambda *_, name=name: log.append(("compute", name)))
        block.register_full_backward_pre_hook(
            lambda *_, name=name: log.append(("backward", name)))
    try:
        for step in range(2):
            if step == 1:
                del log[:]
            ids = demo_train.synthetic_batch(step, 0)[:2].to(engine.collectives.device)
            engine.backward(engine(ids))
            log.append(("end", "backward"))
            engine.step()
        engine.backend.wait_steps()
        deferred_steps = engine.backend.stats().get("rank_deferred_steps", 0)
    finally:
        engine.close()
    for previous, unit in itertools.pairwise(blocks):
        issued = log.index(("issue", f"h2d {unit}"))
        computed = log.index(("compute", previous))
        assert issued < computed, log
        assert ("wait", f"h2d {unit}") not in log, log  # never waited for at issue
        waits = [i for i, entry in enumerate(log) if entry == ("wait", f"ready {unit}")]
        assert all(wait > computed for wait in waits), log
    backward = log[log.index(("backward", blocks[-1])):log.index(("end", "backward"))]
    assert not [entry for entry in backward
                if entry[0] == "wait" and entry[1].startswith("d2h")], backward
    assert deferred_steps > 0
