"""The device memory the running gradient sums take is measured, not a fixed share.

On the strict twin with a capacity, as on a GPU: the first accumulation window keeps no
sum on the device; the next ones keep what that window's peak leaves free (less the
headroom), and a later peak that goes further into the headroom shrinks the room. A
GPT with fp32 sums, every unit held across micro-batches and long sequences trains in
8 MiB where a room of half the free memory ran out of it in the second micro-batch's
forward, and ends bit-identical to the run that keeps no sum on the device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model
from conftest import cap_twin_device
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainer
from trainer.demo.train import TinyGPT
from trainer.device import twin_memory
from trainer.device.twin import twin_device
from trainer.offload.sum_room import HEADROOM_FRACTION, TWIN_DEVICE_NBYTES, SumRoom
from trainer.state.checkpoint import consolidate_fp32_state_dict

pytestmark = pytest.mark.usefixtures("strict_device_twin")

CAPACITY = 8 << 20
MICRO, WINDOWS, TOKENS = 4, 3, 128


class _Recomputed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, hidden, use_reentrant=False)


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, width=64, depth=21, heads=1, max_len=TOKENS)
    model.blocks = nn.ModuleList(_Recomputed(block) for block in model.blocks)
    return model


def _train_gpt(room: int | None) -> dict[str, Any]:
    """``WINDOWS`` windows of ``MICRO`` micro-batches; ``room`` None: as measured, else
    forced for every window."""
    config = base_config(
        train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=MICRO,
        zero_optimization={"stage": 3, "offload_param": {"device": "cpu"},
                           "offload_optimizer": {"device": "cpu"}},
        bf16={"enabled": True}, units={"module_classes": ["GPTBlock"]})
    model = _gpt()
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    held, rooms, losses = [], [], []
    try:
        generator = torch.Generator().manual_seed(1)
        for _ in range(WINDOWS):
            rooms.append(engine.backend.device_sum_room_nbytes)
            for _ in range(MICRO):
                if room is not None:
                    engine.backend.device_sum_room_nbytes = room
                ids = torch.randint(0, 512, (4, TOKENS), generator=generator)
                loss = engine(ids.to(engine.collectives.device))
                engine.backward(loss)
                held.append(sum(total.nbytes for total in engine.backend._device_sums.values()))
                engine.step()
                losses.append(loss.item())
        engine.backend.wait_steps()
        return {"state": consolidate_fp32_state_dict(engine), "losses": losses,
                "held": held, "rooms": rooms, "peak": twin_memory.max_memory_allocated()}
    finally:
        engine.close()


@pytest.mark.slow
def test_fp32_sums_fit_what_the_first_window_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    cap_twin_device(monkeypatch, CAPACITY)
    base = twin_memory.memory_allocated()
    measured = _train_gpt(None)
    # The first window keeps nothing on the device; the next ones keep sums, each within
    # what the first window's peak left of the plan (capacity less headroom)
    assert measured["rooms"][0] == 0 and measured["held"][:MICRO] == [0] * MICRO
    plan = CAPACITY - CAPACITY // HEADROOM_FRACTION
    assert 0 < measured["rooms"][1] < plan - 2 * sum(p.numel() for p in _gpt().parameters())
    later = measured["held"][MICRO:]
    assert max(later) > 0 and max(later) <= measured["rooms"][1]
    assert later[MICRO - 1] == 0, "the window's last micro-batch writes the sums out"
    assert measured["peak"] - base <= plan

    cap_twin_device(monkeypatch, CAPACITY)
    none_kept = _train_gpt(0)
    assert none_kept["losses"] == measured["losses"]
    for name, value in none_kept["state"].items():
        assert torch.equal(measured["state"][name], value), name


@pytest.mark.slow
def test_half_the_free_memory_ran_out_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case above with the old fixed room (half of what was free at the start) for
    every window: the held parameters, the sums and a micro-batch's activations do not
    fit the device together."""
    cap_twin_device(monkeypatch, CAPACITY)
    with pytest.raises(torch.OutOfMemoryError, match="OFFLOADD_TWIN_MEMORY"):
        _train_gpt(CAPACITY // 2)


def test_the_room_is_what_the_peak_leaves_and_shrinks_past_the_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    device = twin_device()
    cap_twin_device(monkeypatch, 1 << 20)
    base = twin_memory.memory_allocated()
    capacity = base + (1 << 20)
    plan = capacity - capacity // HEADROOM_FRACTION
    assert SumRoom(device, zero_copy=True).nbytes == 0
    room = SumRoom(device, zero_copy=False)
    assert room.nbytes == 0, "nothing is kept before a window was measured"

    def window(peak: int) -> int:
        """A window whose tensors peak at ``peak`` bytes; the room it leaves."""
        block = torch.empty(peak - twin_memory.memory_allocated(), dtype=torch.uint8,
                            device=device)
        del block
        room.window_done()
        return room.nbytes

    assert window(base + 400_000) == plan - base - 400_000
    # a lower peak later leaves the room as it was: the peak is never reset
    assert window(base + 100_000) == plan - base - 400_000
    first = room.nbytes
    # the sums taking their room reach the plan exactly: nothing changes
    assert window(plan) == first
    # a peak into the headroom gives its overshoot back, once
    assert window(plan + 10_000) == first - 10_000
    assert window(plan + 10_000) == first - 10_000
    assert window(plan + 25_000) == first - 25_000
    assert window(capacity) == max(0, first - (capacity - plan))


def test_an_unbounded_device_keeps_the_fixed_share(monkeypatch: pytest.MonkeyPatch) -> None:
    cap_twin_device(monkeypatch, None)
    room = SumRoom(twin_device(), zero_copy=False)
    assert room.nbytes == TWIN_DEVICE_NBYTES // 2
    room.window_done()
    assert room.nbytes == TWIN_DEVICE_NBYTES // 2


def test_a_sum_starts_with_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Room that appears in the middle of a window (a tool or test setting it) is not
    taken until the next window: a sum begun at the second micro-batch would write the
    arena over the first's gradient."""
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    config = base_config(gradient_accumulation_steps=3, zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})
    runs = {}
    for late in (False, True):
        engine, _, _, _ = trainer.initialize(model=make_model(0), config=config)
        try:
            for step in range(2):
                for micro in range(3):
                    engine.backend.device_sum_room_nbytes = (1 << 30) if late and micro else 0
                    batch = make_batch(step, micro, 0, engine.train_micro_batch_size_per_gpu())
                    engine.backward(engine(*(t.to(engine.collectives.device) for t in batch)))
                    assert not engine.backend._device_sums
                    engine.step()
            runs[late] = consolidate_fp32_state_dict(engine)
        finally:
            engine.close()
    for name, value in runs[False].items():
        assert torch.equal(runs[True][name], value), name
