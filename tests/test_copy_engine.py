"""The copy engines' ordering rules, checked on the CPU twin against real daemon leases.

Hazard under test: a lease released (or a write lease committed) before the copy that
uses its bytes completed lets the daemon rewrite or evict those bytes mid-DMA. The twin
runs copies late on a worker thread, so releasing early is caught; ``hold()`` makes the
window deterministic.
"""

from __future__ import annotations

import pytest
import torch

from trainer.device.copy_engine import (
    CopyAfterReleaseError,
    CopyEngineUnavailableError,
    InlineCopyEngine,
    ReleaseQueue,
    TwinCopyEngine,
    select_copy_engine,
)


@pytest.fixture
def twin():
    engine = TwinCopyEngine(max_delay_s=200e-6, seed=1)
    yield engine
    engine.close()


def test_twin_copies_complete_later_in_issue_order(twin: TwinCopyEngine) -> None:
    src = [torch.full((1000,), float(i)) for i in range(20)]
    dst = [torch.zeros(1000) for _ in range(20)]
    with twin.hold():
        events = [twin.h2d(d, s) for d, s in zip(dst, src, strict=True)]
        assert not any(event.query() for event in events)
        assert all(float(d.sum()) == 0 for d in dst)
    for event in events:
        twin.wait_on_compute(event)
    assert [int(d[0]) for d in dst] == list(range(20))


def test_releasing_a_lease_before_its_copy_completes_fails_on_the_twin(
        connect, twin: TwinCopyEngine) -> None:
    client = connect()
    client.put("p", torch.arange(256, dtype=torch.float32))
    lease = client.acquire("p", "r")
    device_part = twin.empty(256, torch.float32)
    with twin.hold():
        event = twin.h2d(device_part, lease.tensor(torch.float32), guard=lease)
        lease.release()  # the bug: the DMA has not read the arena bytes yet
    with pytest.raises(CopyAfterReleaseError, match="release_after"):
        event.synchronize()
    assert twin.late_releases_caught == 1


def test_release_after_event_keeps_the_lease_until_the_copy_completed(
        connect, twin: TwinCopyEngine) -> None:
    client = connect()
    client.put("p", torch.arange(256, dtype=torch.float32))
    releases = ReleaseQueue(twin)
    lease = client.acquire("p", "r")
    device_part = twin.empty(256, torch.float32)
    with twin.hold():
        event = twin.h2d(device_part, lease.tensor(torch.float32), guard=lease)
        releases.release_after(event, lease.release)
        assert releases.poll() == 0
        assert not lease.released
        assert client.stats()["leased_nbytes"] > 0
    twin.wait_on_compute(event)
    assert releases.poll() == 1
    assert lease.released
    assert torch.equal(device_part, torch.arange(256, dtype=torch.float32))
    assert client.stats()["leased_nbytes"] == 0


def test_a_write_lease_commits_only_after_the_d2h_copy(connect, twin: TwinCopyEngine) -> None:
    client = connect()
    client.alloc("g", 4 * 64, "float32")
    releases = ReleaseQueue(twin)
    grad = torch.full((64,), 3.0)
    lease = client.acquire("g", "w")
    with twin.hold():
        event = twin.d2h(lease.tensor(torch.float32), grad, guard=lease)
        releases.release_after(event, lease.release)
        assert not lease.released
    releases.drain()
    assert client.get("g") == grad.numpy().tobytes()


def test_drain_releases_every_lease_and_reraises_the_first_race(
        connect, twin: TwinCopyEngine) -> None:
    client = connect()
    client.put("a", torch.zeros(16))
    client.put("b", torch.zeros(16))
    releases = ReleaseQueue(twin)
    early, late = client.acquire("a", "r"), client.acquire("b", "r")
    with twin.hold():
        first = twin.h2d(torch.empty(16), early.tensor(torch.float32), guard=early)
        early.release()
        releases.release_after(first, lambda: None)
        releases.release_after(twin.h2d(torch.empty(16), late.tensor(torch.float32),
                                        guard=late), late.release)
    with pytest.raises(CopyAfterReleaseError):
        releases.drain()
    assert late.released and len(releases) == 0


def test_twin_events_are_pooled_and_reused(twin: TwinCopyEngine) -> None:
    releases = ReleaseQueue(twin)
    seen = set()
    for _ in range(50):
        event = twin.h2d(torch.empty(4), torch.ones(4))
        seen.add(id(event))
        releases.release_after(event, lambda: None)
        releases.drain()
    assert len(seen) <= 3


def test_host_registration_is_tracked_and_must_be_undone(twin: TwinCopyEngine) -> None:
    buffer = torch.zeros(4096, dtype=torch.uint8)
    assert twin.register_host(buffer.data_ptr(), buffer.nbytes)
    twin.unregister_host(buffer.data_ptr())
    with pytest.raises(RuntimeError, match="never registered"):
        twin.unregister_host(buffer.data_ptr())


def test_select_copy_engine_by_env_and_device(monkeypatch) -> None:
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "inline")
    assert isinstance(select_copy_engine("cpu"), InlineCopyEngine)
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    engine = select_copy_engine("cpu")
    assert isinstance(engine, TwinCopyEngine)
    engine.close()
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "warp")
    with pytest.raises(ValueError, match="OFFLOADD_COPY_ENGINE"):
        select_copy_engine("cpu")
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "cuda")
    with pytest.raises(ValueError, match="cuda compute device"):
        select_copy_engine("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_engine_without_cuda_names_the_fix() -> None:
    with pytest.raises(CopyEngineUnavailableError, match='"device": "cpu"'):
        select_copy_engine("cuda:0", "cuda")


def test_backend_d2h_of_a_gradient_survives_reuse_of_the_grad_buffer(
        connect, twin: TwinCopyEngine) -> None:
    from trainer.dist.collectives import Collectives
    from trainer.offload.backend import UnitSpec
    from trainer.offload.daemon_backend import DaemonBackend

    backend = DaemonBackend(connect(), collectives=Collectives(), copies=twin)
    backend.register(UnitSpec(index=0, part_numel=32, param_dtype=torch.float32),
                     torch.zeros(32))
    grad = torch.full((32,), 2.0)
    with twin.hold():
        norm = backend.accumulate_grad(0, grad, first=True, want_sq_norm=True)
        grad.fill_(99.0)  # the reducer reuses its buffer while the D2H is still queued
    backend.wait_steps()
    assert float(norm) == pytest.approx(32 * 4.0)
    assert backend.client.get("u0.grad") == torch.full((32,), 2.0).numpy().tobytes()
    backend.close()


def test_a_refused_arena_registration_warns_with_the_fix_and_copies_still_work(
        connect) -> None:
    from trainer.dist.collectives import Collectives
    from trainer.offload.backend import UnitSpec
    from trainer.offload.daemon_backend import DaemonBackend

    twin = TwinCopyEngine(memlock_nbytes=64 << 10)  # far below the 4 MiB arena
    with pytest.warns(RuntimeWarning, match="ulimit -l unlimited"):
        backend = DaemonBackend(connect(), collectives=Collectives(), copies=twin)
    try:
        assert backend.stats()["rank_arena_pinned"] == "failed"
        assert twin.registered == {}
        backend.register(UnitSpec(index=0, part_numel=8, param_dtype=torch.float32),
                         torch.arange(8, dtype=torch.float32))
        out = twin.empty(8, torch.float32)
        backend.read_params(0, out)
        assert torch.equal(out, torch.arange(8, dtype=torch.float32))
    finally:
        backend.close()


def test_the_timed_twin_copies_at_its_bandwidth_and_counts_waits() -> None:
    """OFFLOADD_TWIN_GBPS: a copy lasts nbytes / rate on the worker; the host's blocking
    waits on copy events are the exposed part (what overlap_fraction is made of)."""
    engine = TwinCopyEngine(max_delay_s=0.0, gbps=0.01)  # 10 MB/s: 100 kB last 10 ms
    try:
        src = torch.arange(25_000, dtype=torch.float32)
        dst = torch.empty_like(src)
        event = engine.h2d(dst, src)
        event.synchronize()
        assert torch.equal(dst, src)
        assert engine.timing.copy_s >= src.nbytes / 0.01e9
        assert engine.timing.exposed_s > 0.0 and engine.timing.overlap_fraction < 0.5
        engine.timing.reset()
        event = engine.d2h(dst, src)
        engine.synchronize()  # waited here: exposed too
        assert engine.timing.exposed_s > 0.0 and event.query()
        with pytest.raises(ValueError, match="OFFLOADD_TWIN_GBPS"):
            TwinCopyEngine(gbps=0.0)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["inline", "twin"])
def test_engines_count_the_bytes_each_way(kind: str) -> None:
    engine = InlineCopyEngine() if kind == "inline" else TwinCopyEngine(max_delay_s=0.0)
    try:
        sizes = [(7, torch.float32), (1023, torch.bfloat16), (16, torch.uint8)]
        for numel, dtype in sizes:
            host = torch.arange(numel).to(dtype)
            device = engine.empty(numel, dtype)
            engine.wait_on_compute(engine.h2d(device, host))
            back = torch.empty_like(host)
            engine.d2h(back, device).synchronize()
            assert torch.equal(back, host)
        expected = sum(numel * torch.empty(0, dtype=dtype).element_size()
                       for numel, dtype in sizes)
        assert (engine.h2d_nbytes, engine.d2h_nbytes) == (expected, expected)
    finally:
        engine.close()
