"""The strict twin's device memory (``trainer.device.twin_memory``): what it counts is
what a reference count of the live storages says, after any sequence of allocations,
views, drops and in-place resizes; the peak is the reference's peak; an allocation past
``OFFLOADD_TWIN_MEMORY`` fails with ``torch.OutOfMemoryError`` as on a GPU and leaves
nothing counted; storages autograd keeps for backward count after Python dropped them;
activation checkpointing runs on the twin."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from trainer.device import twin_memory
from trainer.device.twin import DeviceTensor, adopt_module, twin_device

EXAMPLES = int(os.environ.get("OFFLOADD_PROPERTY_EXAMPLES", "40"))


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[twin_memory.TwinMemory]:
    """The twin's memory with no capacity and its peak reset (other tests of this process
    may hold device tensors: figures are compared as deltas)."""
    twin_device()
    memory = twin_memory.memory()
    monkeypatch.setattr(memory, "capacity_nbytes", None)
    twin_memory.reset_peak_memory_stats()
    yield memory


def _reference(held: list[torch.Tensor], storages: list[torch.UntypedStorage]) -> int:
    """Bytes of the distinct storages behind ``held`` (views share one) and of ``storages``
    (kept by reference after their tensors may have been dropped)."""
    live = {tensor.untyped_storage()._cdata: tensor.untyped_storage().nbytes()
            for tensor in held}
    live.update((storage._cdata, storage.nbytes()) for storage in storages)
    return sum(live.values())


def _backed(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() >= (
        tensor.storage_offset() + tensor.numel()) * tensor.element_size()


ACTIONS = st.lists(st.tuples(st.sampled_from(["alloc", "op", "view", "drop", "shrink", "grow"]),
                             st.integers(0, 4096), st.integers(0, 1 << 16)),
                   min_size=1, max_size=40)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # base, peak: per example
@given(actions=ACTIONS)
def test_counts_and_peak_match_a_reference(memory: twin_memory.TwinMemory,
                                           actions: list[tuple[str, int, int]]) -> None:
    device = twin_device()
    base = twin_memory.memory_allocated()
    twin_memory.reset_peak_memory_stats()
    held: list[torch.Tensor] = []
    resizable: list[torch.UntypedStorage] = []
    peak = base
    for action, numel, pick in actions:
        usable = [tensor for tensor in held if _backed(tensor)]  # a freed storage is not read
        if action == "alloc" or not usable:
            held.append(torch.empty(numel, device=device))
        elif action == "op":
            held.append(usable[pick % len(usable)] * 2)  # one kernel: no transient to count
        elif action == "view":
            source = usable[pick % len(usable)]
            held.append(source.view(-1)[: source.numel() // 2])
            del source
        elif action == "drop":
            held.pop(pick % len(held))
        else:
            resizable.append(held[pick % len(held)].untyped_storage())
            resizable[-1].resize_(0 if action == "shrink" else numel * 4)
        del usable
        assert all(isinstance(tensor, DeviceTensor) for tensor in held)
        expected = base + _reference(held, resizable)
        peak = max(peak, expected)
        assert twin_memory.memory_allocated() == expected, action
    assert twin_memory.max_memory_allocated() == peak
    held.clear()
    resizable.clear()
    assert twin_memory.memory_allocated() == base


def test_over_capacity_fails_as_cuda_does_and_counts_nothing(
        memory: twin_memory.TwinMemory) -> None:
    device = twin_device()
    base = twin_memory.memory_allocated()
    memory.capacity_nbytes = base + (1 << 20)
    first = torch.empty(192 << 10, device=device)  # 768 KiB of fp32
    second = torch.empty(64 << 10, device=device)  # 256 KiB more: exactly the capacity
    with pytest.raises(torch.OutOfMemoryError, match="OFFLOADD_TWIN_MEMORY"):
        torch.empty(1, device=device)
    assert twin_memory.memory_allocated() == base + (1 << 20)  # the refused one is not counted
    del second
    with pytest.raises(torch.OutOfMemoryError):
        first * 2  # an op's result, not only an explicit allocation
    assert twin_memory.memory_allocated() == base + (768 << 10)
    storage = first.untyped_storage()
    with pytest.raises(torch.OutOfMemoryError):
        storage.resize_(2 << 20)
    assert storage.nbytes() == 768 << 10  # refused before it grew
    free, total = twin_memory.mem_get_info()
    assert total == base + (1 << 20) and free == total - twin_memory.memory_allocated()
    del first, storage
    assert twin_memory.memory_allocated() == base
    torch.empty(200 << 10, device=device)  # room again once freed


def test_storages_autograd_keeps_count_until_backward(memory: twin_memory.TwinMemory) -> None:
    device = twin_device()
    weight = torch.randn(256, 256, device=device, requires_grad=True)
    inputs = torch.randn(64, 256, device=device)
    base = twin_memory.memory_allocated()

    def forward() -> torch.Tensor:
        hidden = (inputs @ weight).tanh()  # saved for backward; Python drops it on return
        return (hidden @ weight).sum()

    loss = forward()
    saved = twin_memory.memory_allocated() - base
    assert saved >= 64 * 256 * 4  # at least the hidden activation
    loss.backward()
    del loss
    assert twin_memory.memory_allocated() - base < saved  # backward freed what it kept
    assert isinstance(weight.grad, DeviceTensor)
    assert twin_memory.memory_allocated() - base >= 256 * 256 * 4  # the gradient now


def test_module_gradients_count_when_autograd_makes_them(memory: twin_memory.TwinMemory) -> None:
    device = twin_device()
    model = torch.nn.Linear(128, 128).to(device)
    adopt_module(model)
    base = twin_memory.memory_allocated()
    model(torch.randn(4, 128, device=device)).sum().backward()
    # counted by the post-accumulate hook, before anyone reads .grad
    assert twin_memory.memory_allocated() - base == (128 * 128 + 128) * 4


def test_activation_checkpointing_recomputes_on_the_twin(memory: twin_memory.TwinMemory) -> None:
    device = twin_device()
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    host_block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                     torch.nn.Linear(32, 16))
    host_block.load_state_dict(block.state_dict())
    block.to(device)
    adopt_module(block)
    inputs = torch.randn(8, 16)
    checkpoint(block, inputs.to(device), use_reentrant=False).square().sum().backward()
    host_block(inputs).square().sum().backward()
    for ours, expected in zip(block.parameters(), host_block.parameters(), strict=True):
        assert isinstance(ours.grad, DeviceTensor)
        torch.testing.assert_close(ours.grad.cpu(), expected.grad, rtol=0, atol=0)


@pytest.mark.parametrize("text, nbytes", [("4096", 4096), ("512MiB", 512 << 20),
                                          ("1.5GiB", 3 << 29), ("2gb", 2 * 10**9)])
def test_capacity_parses_sizes(text: str, nbytes: int) -> None:
    assert twin_memory.parse_nbytes(text) == nbytes


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "0", "-3MiB"])
def test_a_bad_capacity_names_the_knob(text: str) -> None:
    with pytest.raises(ValueError, match="OFFLOADD_TWIN_MEMORY"):
        twin_memory.parse_nbytes(text)
