"""The twin plays CUDA's streams: work issued ahead of compute is waited for at use.

``TwinCopyEngine`` runs copies on a worker (the copy stream) and the host plays
the compute stream. Inside ``ahead_of_compute`` the host issues to the copy
stream and does not wait; compute waits at use (``wait_on_compute(ready())``).
These tests check that structure, never timings: with the worker held, issuing
returns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trainer.copy_engine import CopyAfterReleaseError, TwinCopyEngine

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
    from trainer.collectives import Collectives
    from trainer.config import UnitsConfig
    from trainer.daemon_backend import DaemonBackend
    from trainer.gather import FullParams, GatherState
    from trainer.offload import UnitSpec
    from trainer.partition import build_units
    from trainer.zero import OffloadedPartitions

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
