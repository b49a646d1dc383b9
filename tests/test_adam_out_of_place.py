"""``adam_step`` out of place (``source``: a speculative step's), every kernel and format.

The step read from ``source`` must write exactly the bytes the in-place step writes,
whatever the destination held, and leave ``source`` as it was. The native kernels stream
the written state where its vectors are aligned and store it plainly where not, so the
destinations are tried aligned and 4 bytes off, and the sizes cross the SIMD tails,
the blockwise8 block tail and the task boundary (64 Ki elements).
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
STATE = ("master", "exp_avg", "exp_avg_sq")
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


def _garbage_like(tensor: torch.Tensor, misalign: int) -> torch.Tensor:
    """A tensor of ``tensor``'s dtype and size filled with 7s, ``misalign`` bytes past the
    start of its (64-byte aligned) storage (a multiple of 4: blockwise8 scales are fp32)."""
    skip = misalign // tensor.element_size()
    storage = torch.full((tensor.numel() + skip,), 7, dtype=tensor.dtype)
    return storage[skip:]


def _step(kernel: str, state: dict[str, torch.Tensor], **source: Any) -> None:
    adam.adam_step(state["master"], state["exp_avg"], state["exp_avg_sq"], state["grad"],
                   param_out=state["param"], use_kernel=kernel, **HYPER, **source)


def _assert_bytes_equal(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("misalign", [0, 4])
def test_out_of_place_writes_the_in_place_step_and_keeps_its_source(
        kernel: str, fmt: str, numel: int, misalign: int) -> None:
    before = _state(fmt, numel, numel)
    in_place = _clone(before)
    _step(kernel, in_place)
    source = _clone(before)
    ours = {name: _garbage_like(tensor, misalign) if name in STATE else tensor.clone()
            for name, tensor in before.items()}
    _step(kernel, ours, source=tuple(source[name] for name in STATE))
    _assert_bytes_equal(ours, in_place)
    _assert_bytes_equal(source, before)


def test_a_source_of_the_wrong_shape_or_overlapping_the_state_is_refused() -> None:
    state = _state("bfloat16", 100, 0)
    wrong = (state["master"].clone(), state["exp_avg"].float(), state["exp_avg_sq"].clone())
    with pytest.raises(ValueError, match="source exp_avg"):
        _step(KERNELS[0], state, source=wrong)
    with pytest.raises(ValueError, match="source is master, exp_avg and exp_avg_sq"):
        _step(KERNELS[0], state, source=wrong[:2])
    overlapping = (state["master"], state["exp_avg"].clone(), state["exp_avg_sq"].clone())
    with pytest.raises(ValueError, match="overlaps the master"):
        _step(KERNELS[0], state, source=overlapping)
