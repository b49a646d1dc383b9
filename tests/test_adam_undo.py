"""``adam_step``'s undo copy (a speculative step's saved state), every kernel and format.

``save_to`` must receive the state exactly as it was before the update and leave the
update itself unchanged; ``restore_from`` must give exactly the step run from the saved
state, whatever the state held before. The native kernels copy slice by slice beside the
update (the blockwise8 scales per block, the last task mid-block), so the sizes cross the
SIMD tails, the block tail and the task boundary (64 Ki elements).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offloadd import moment_codec
from offloadd.compute import adam

KERNELS = [*adam.native_kernels(), "torch"]
FORMATS = ["float32", "bfloat16", "blockwise8"]
SIZES = [1, 7, 17, 255, 257, 1023, (1 << 16) - 1, (1 << 16) + 300, 3 * (1 << 16) + 17]
HYPER: dict[str, Any] = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=0.01, grad_scale=0.5, rounding_seed=11)


def _state(fmt: str, numel: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    exp_avg = torch.randn(numel, generator=generator) * 1e-3
    exp_avg_sq = torch.rand(numel, generator=generator) * 1e-6
    if fmt != "float32":
        exp_avg = moment_codec.encode(exp_avg, fmt, signed=True)
        exp_avg_sq = moment_codec.encode(exp_avg_sq, fmt, signed=False)
    return {"master": torch.randn(numel, generator=generator), "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
            "grad": torch.randn(numel, generator=generator).to(torch.bfloat16),
            "param": torch.empty(numel, dtype=torch.bfloat16)}


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in state.items()}


def _step(kernel: str, state: dict[str, torch.Tensor], **undo: Any) -> None:
    adam.adam_step(state["master"], state["exp_avg"], state["exp_avg_sq"], state["grad"],
                   param_out=state["param"], use_kernel=kernel, **HYPER, **undo)


def _saved(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(state[name] for name in ("master", "exp_avg", "exp_avg_sq"))


def _assert_bytes_equal(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", SIZES)
def test_save_to_keeps_the_state_before_and_steps_as_without(kernel: str, fmt: str,
                                                             numel: int) -> None:
    before = _state(fmt, numel, numel)
    plain, ours = _clone(before), _clone(before)
    _step(kernel, plain)
    undo = {name: torch.full_like(tensor, 7) for name, tensor in before.items()}
    _step(kernel, ours, save_to=_saved(undo))
    _assert_bytes_equal(ours, plain)
    _assert_bytes_equal(dict(zip(("master", "exp_avg", "exp_avg_sq"), _saved(undo),
                                 strict=True)),
                        dict(zip(("master", "exp_avg", "exp_avg_sq"), _saved(before),
                                 strict=True)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", SIZES)
def test_restore_from_steps_from_the_saved_state(kernel: str, fmt: str, numel: int) -> None:
    before = _state(fmt, numel, numel)
    expected = _clone(before)
    _step(kernel, expected)
    ours = _state(fmt, numel, numel + 1)  # what a speculative step left: other bytes
    ours["grad"] = before["grad"].clone()
    _step(kernel, ours, restore_from=_saved(_clone(before)))
    _assert_bytes_equal(ours, expected)


def test_undo_copies_of_the_wrong_shape_are_refused() -> None:
    state = _state("bfloat16", 100, 0)
    wrong = (state["master"].clone(), state["exp_avg"].float(), state["exp_avg_sq"].clone())
    with pytest.raises(ValueError, match="undo copy of exp_avg"):
        _step(KERNELS[0], state, save_to=wrong)
    with pytest.raises(ValueError, match="not both"):
        _step(KERNELS[0], state, save_to=_saved(state), restore_from=_saved(state))
