"""On a real GPU: the CUDA copy engine, the pinned arena and ZeRO-3 training on cuda.

Marked ``gpu`` and skipped without CUDA; ``bench/gpu_check.sh`` runs them in one
device call (``pytest -m gpu``). The same ordering rules run on the CPU twin in
tests/test_copy_engine*.py.
"""

from __future__ import annotations

import pytest
import torch
from _dist import base_config, make_batch, make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_engine_copies_arena_leases_and_releases_after_the_event(connect) -> None:
    from trainer.device.copy_engine import CudaCopyEngine, ReleaseQueue, host_address

    engine = CudaCopyEngine("cuda:0")
    client = connect(arena_nbytes=64 << 20)
    assert engine.register_host(host_address(client.arena.view), client.arena.nbytes)
    try:
        values = torch.arange(1 << 20, dtype=torch.float32)
        client.put("p", values)
        client.alloc("g", values.nbytes, "float32")
        releases = ReleaseQueue(engine)
        device_part = engine.empty(values.numel(), torch.float32)
        lease = client.acquire("p", "r")
        event = engine.h2d(device_part, lease.tensor(torch.float32), guard=lease)
        engine.wait_on_compute(event)
        releases.release_after(event, lease.release)
        doubled = device_part * 2  # on the compute stream, after the event
        write = client.acquire("g", "w")
        releases.release_after(engine.d2h(write.tensor(torch.float32), doubled, guard=write),
                               write.release)
        releases.drain()
        assert lease.released and write.released
        assert torch.equal(torch.frombuffer(bytearray(client.get("g")), dtype=torch.float32),
                           values * 2)
    finally:
        engine.synchronize()
        engine.unregister_host(host_address(client.arena.view))


def test_resolve_device_picks_cuda_and_nccl() -> None:
    from trainer.device.compute import resolve_device

    compute = resolve_device("auto", local_rank=0)
    assert compute.device == torch.device("cuda", 0) and compute.dist_backend == "nccl"


def _train(device: str, steps: int = 3, **extra: object
           ) -> tuple[dict[str, torch.Tensor], list[float]]:
    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"}}
    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, config=base_config(
        zero_optimization=zero, device=device, **extra))
    losses = []
    try:
        for step in range(steps):
            batch = [t.to(engine.collectives.device) for t in make_batch(step, 0, 0, 4)]
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        _last_stats[:] = [engine.offload_stats()]
        return consolidate_fp32_state_dict(engine), losses
    finally:
        engine.close()


_last_stats: list[dict] = []


def test_zero3_offloaded_training_on_cuda_matches_cpu() -> None:
    cpu_state, cpu_losses = _train("cpu")
    gpu_state, gpu_losses = _train("cuda")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for name, value in cpu_state.items():
        torch.testing.assert_close(gpu_state[name].cpu(), value, rtol=1e-4, atol=1e-5)


def test_engine_on_cuda_pins_the_arena() -> None:
    import trainer

    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"}}
    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, config=base_config(
        zero_optimization=zero, device="cuda"))
    try:
        loss = engine(*(t.cuda() for t in make_batch(0, 0, 0, 4)))
        engine.backward(loss)
        engine.step()
        stats = engine.offload_stats()
        assert stats["rank_copy_engine"] == "cuda"
        assert stats["rank_arena_pinned"] == "pinned"
    finally:
        engine.close()


def test_daemon_copies_on_cuda_train_like_cpu() -> None:
    """device_copies "daemon": the daemon (cupy) copies through the rank's IPC staging slots;
    without cupy in the daemon it falls back to rank copies with reason no_cupy."""
    import importlib.util
    import warnings

    cpu_state, cpu_losses = _train("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpu_state, gpu_losses = _train("cuda", offloadd={"device_copies": "daemon"})
    stats = _last_stats[0]
    if importlib.util.find_spec("cupy") is not None:
        assert (stats["rank_device_copies"], stats["rank_device_copies_reason"]) == \
            ("daemon", ""), [str(w.message) for w in caught]
    else:
        assert (stats["rank_device_copies"], stats["rank_device_copies_reason"]) == \
            ("rank", "no_cupy")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for name, value in cpu_state.items():
        torch.testing.assert_close(gpu_state[name].cpu(), value, rtol=1e-4, atol=1e-5)


def test_refused_host_registration_leaves_no_cuda_error_behind() -> None:
    """cudaHostRegister refusing (here: memory already registered) must not leave CUDA's
    last error set, which the next kernel launch check would raise as its own."""
    from trainer.device.copy_engine import CudaCopyEngine

    engine = CudaCopyEngine("cuda:0")
    host = torch.zeros(1 << 20, dtype=torch.uint8)
    assert engine.register_host(host.data_ptr(), host.nbytes)
    try:
        assert not CudaCopyEngine("cuda:0").register_host(host.data_ptr(), host.nbytes)
        values = torch.arange(1024, device="cuda:0") * 2  # a kernel launch, checked
        torch.cuda.synchronize()
        assert int(values[-1]) == 2046
    finally:
        engine.unregister_host(host.data_ptr())


def test_daemon_finds_the_rank_gpu_by_pci_bus_id() -> None:
    cupy = pytest.importorskip("cupy")
    from offloadd.gpu.cuda import find_device

    properties = torch.cuda.get_device_properties(0)
    bus_id = (f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:"
              f"{properties.pci_device_id:02x}.0")
    assert find_device(cupy, "GPU-not-this-uuid", bus_id) == 0
    assert find_device(cupy, str(properties.uuid)) == 0


def test_closed_staging_gives_its_ipc_exported_memory_back() -> None:
    """The staging buffer is exported by CUDA IPC to the daemon's cupy, which never takes
    part in torch's IPC reference counting: closing it must free the block all the same."""
    import gc

    from trainer.offload.daemon_copies import CudaStaging

    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated(0)
    staging = CudaStaging(torch.device("cuda", 0), num_slots=2, slot_nbytes=8 << 20)
    assert staging.export()["ipc_handle"]
    assert torch.cuda.memory_allocated(0) >= before + (16 << 20)
    staging.close()
    del staging
    gc.collect()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated(0) == before
