"""Compact Adam moments (offloadd.formats): the torch codec, and every kernel against it.

A compact step is specified as: decode the stored moments to fp32 (exact), run the fp32
Adam step of the same kernel, encode the new moments (offloadd.moment_codec). Each native
kernel fuses that into one pass; here it must produce the same bytes as the composition
(master, param_out and both moments, bit for bit) over sizes that hit the SIMD tails and
the blockwise8 block tail. The torch path ("torch") is that composition by construction,
so the same test pins it too.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from offloadd import formats, moment_codec
from offloadd.compute import adam

NATIVE_KERNELS = adam.native_kernels()
ALL_KERNELS = [*NATIVE_KERNELS, "torch"]
SIZES = [1, 7, 15, 16, 17, 255, 256, 257, 1023, 4097, (1 << 16) + 300]
COMPACT = ["bfloat16", "blockwise8"]
HYPER: dict[str, Any] = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
SEED = 7


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _moments(fmt: formats.MomentFormat, numel: int, generator: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored moments with a spread of magnitudes (some blocks far below others)."""
    spread = torch.exp(torch.randn(numel, generator=generator) * 3)
    exp_avg = torch.randn(numel, generator=generator) * 1e-3 * spread
    exp_avg_sq = torch.rand(numel, generator=generator) * 1e-6 * spread ** 2
    return (moment_codec.encode(exp_avg, fmt, signed=True),
            moment_codec.encode(exp_avg_sq, fmt, signed=False))


def _composed_step(kernel: str, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                   param_out: torch.Tensor | None, **kwargs: Any) -> None:
    """The specification: decode, the fp32 step of ``kernel``, encode (in place)."""
    numel = master.numel()
    fmt = moment_codec.format_of(exp_avg.dtype)
    exp_avg32 = moment_codec.decode(exp_avg, signed=True, numel=numel)
    exp_avg_sq32 = moment_codec.decode(exp_avg_sq, signed=False, numel=numel)
    adam.adam_step(master, exp_avg32, exp_avg_sq32, grad, param_out=param_out,
                   use_kernel=kernel, **kwargs)  # type: ignore[arg-type]
    key = formats.rounding_key(SEED, kwargs["step"])
    exp_avg.copy_(moment_codec.encode(exp_avg32, fmt, signed=True, key=key))
    exp_avg_sq.copy_(moment_codec.encode(exp_avg_sq32, fmt, signed=False, key=key))


@pytest.mark.parametrize("kernel", ALL_KERNELS)
@pytest.mark.parametrize("fmt", COMPACT)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize(("grad_dtype", "out_dtype", "decoupled"), [
    (torch.float32, None, True), (torch.bfloat16, torch.bfloat16, True),
    (torch.float32, torch.float32, False), (torch.bfloat16, torch.float16, False)],
    ids=["g32-noout-adamw", "gbf16-outbf16-adamw", "g32-out32-l2", "gbf16-out16-l2"])
def test_kernel_matches_decode_step_encode(kernel: str, fmt: formats.MomentFormat, numel: int,
                                           grad_dtype: torch.dtype,
                                           out_dtype: torch.dtype | None,
                                           decoupled: bool) -> None:
    generator = torch.Generator().manual_seed(numel)
    master = torch.randn(numel, generator=generator)
    exp_avg, exp_avg_sq = _moments(fmt, numel, generator)
    ours = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    spec = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    outs = [None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
            for _ in range(2)]
    for step in (1, 2, 3):  # step 1 also decodes the all-nonzero initial moments
        grad = (torch.randn(numel, generator=generator) * 1e-2).to(grad_dtype)
        kwargs = dict(step=step, weight_decay=0.01, decoupled_weight_decay=decoupled,
                      grad_scale=0.5, **HYPER)
        adam.adam_step(*ours, grad, param_out=outs[0], use_kernel=kernel,  # type: ignore[arg-type]
                       rounding_seed=SEED, **kwargs)
        _composed_step(kernel, *spec, grad, outs[1], **kwargs)
    for name, got, want in zip(("master", "exp_avg", "exp_avg_sq"), ours, spec, strict=True):
        assert torch.equal(_bytes(got), _bytes(want)), f"{name} differs"
    if out_dtype is not None:
        assert outs[0] is not None and outs[1] is not None
        assert torch.equal(_bytes(outs[0]), _bytes(outs[1]))


@pytest.mark.skipif(not NATIVE_KERNELS, reason="offloadd._native is not built")
@pytest.mark.parametrize("kernel", NATIVE_KERNELS)
@pytest.mark.parametrize("fmt", COMPACT)
def test_thread_count_does_not_change_compact_results(kernel: str,
                                                      fmt: formats.MomentFormat) -> None:
    numel = 3 * (1 << 16) + 300
    generator = torch.Generator().manual_seed(3)
    master = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator).to(torch.bfloat16)
    exp_avg, exp_avg_sq = _moments(fmt, numel, generator)
    results = []
    for num_threads in (1, 3):
        state = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
        adam.adam_step(*state, grad, step=4, use_kernel=kernel,  # type: ignore[arg-type]
                       num_threads=num_threads, rounding_seed=1, **HYPER)
        results.append(state)
    for one, many in zip(*results, strict=True):
        assert torch.equal(_bytes(one), _bytes(many))


def test_first_step_equals_fp32_adam() -> None:
    """Zero moments are exact in every format and the update uses the fp32 moments it just
    computed, so step 1 moves the master exactly as fp32 Adam does."""
    numel = 1000
    grad = torch.randn(numel)
    masters = {}
    for fmt in formats.MOMENT_FORMATS:
        master = torch.ones(numel)
        state = [moment_codec.empty(fmt, numel).zero_() for _ in range(2)]
        adam.adam_step(master, *state, grad, step=1, **HYPER)
        masters[fmt] = master
    assert torch.equal(masters["bfloat16"], masters["float32"])
    assert torch.equal(masters["blockwise8"], masters["float32"])


# ---------------------------------------------------------------- codec


def test_sizes_and_layout() -> None:
    assert formats.moment_nbytes("float32", 1000) == 4000
    assert formats.moment_nbytes("bfloat16", 1000) == 2000
    assert formats.moment_nbytes("blockwise8", 1000) == 4 * 4 + 1000
    for numel in (0, 1, 255, 256, 257, 10**6 + 3):
        nbytes = formats.moment_nbytes("blockwise8", numel)
        assert formats.blockwise8_numel(nbytes) == numel
    with pytest.raises(ValueError, match="unknown moment format 'int4'"):
        formats.moment_nbytes("int4", 8)  # type: ignore[arg-type]


def test_hash_matches_the_scalar_specification() -> None:
    key = formats.rounding_key(3, 11)
    bits = moment_codec._random_bits(5000, 100, key)  # elements 100 .. 5099
    for i in range(0, 5000, 37):
        assert int(bits[i]) == formats.hash32((100 + i) ^ key)


def test_blockwise8_round_trip_error_is_bounded() -> None:
    """3 mantissa bits rounded to nearest: relative error <= 2^-4 of each element above
    the code's range; the block's absmax is exact."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=generator) * torch.exp(
        torch.randn(4096, generator=generator))
    for signed, source in ((True, values), (False, values.square())):
        decoded = moment_codec.decode(moment_codec.encode(source, "blockwise8", signed=signed),
                                      signed=signed)
        blocks = source.view(-1, formats.BLOCK_ELEMENTS)
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        floor = absmax * (2.0 ** -14 if signed else 2.0 ** -30)
        big = blocks.abs() >= floor
        error = (decoded.view_as(blocks) - blocks).abs()
        assert (error[big] <= blocks.abs()[big] * 2.0 ** -4 * (1 + 1e-6)).all()
        assert (error[~big] <= floor.expand_as(blocks)[~big]).all()
        assert torch.equal(decoded.view_as(blocks).abs().amax(dim=1, keepdim=True), absmax)


def test_blockwise8_second_moment_never_rounds_to_zero() -> None:
    """A nonzero exp_avg_sq stays nonzero (else the step would be lr * m / eps)."""
    values = torch.zeros(512)
    values[0], values[1], values[300] = 1.0, 1e-30, 1e-12
    decoded = moment_codec.decode(moment_codec.encode(values, "blockwise8", signed=False),
                                  signed=False)
    assert decoded[1] > 0 and decoded[300] > 0 and decoded[2] == 0
    assert decoded[300] == 1e-12  # the absmax of its block: exact


def test_blockwise8_all_zero_block_stays_zero() -> None:
    encoded = moment_codec.encode(torch.zeros(300), "blockwise8", signed=True)
    assert torch.equal(encoded, torch.zeros_like(encoded))


def test_bf16_stochastic_rounding_is_unbiased() -> None:
    """A value between two bf16 neighbours rounds up with the probability of its position:
    the mean of many roundings is the value (round-to-nearest would be off by up to 1/2
    ulp every time, which Adam's slow exp_avg_sq decay cannot survive)."""
    value = 1.0 + 2.0 ** -7 * 0.3  # 30% of the way from 1.0 to the next bf16
    values = torch.full((200_000,), value)
    for signed in (True, False):
        rounded = moment_codec.decode(
            moment_codec.encode(values, "bfloat16", signed=signed, key=12345), signed=signed)
        assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
        assert abs(rounded.double().mean().item() - value) < 2.0 ** -7 * 0.01


def test_bf16_keeps_nan_and_infinity() -> None:
    values = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0])
    decoded = moment_codec.decode(moment_codec.encode(values, "bfloat16", signed=True),
                                  signed=True)
    assert decoded[0].isnan()
    assert decoded[1:3].tolist() == [math.inf, -math.inf]


def test_convert_between_formats() -> None:
    values = torch.randn(1000)
    as_bf16 = moment_codec.encode(values, "bfloat16", signed=True)
    same = moment_codec.convert(as_bf16, "bfloat16", signed=True, numel=1000)
    assert same.data_ptr() == as_bf16.data_ptr()  # already in the format: not copied
    exact = moment_codec.convert(as_bf16, "float32", signed=True, numel=1000)
    assert torch.equal(exact, as_bf16.float())
    with pytest.raises(ValueError, match="holds 1000 elements"):
        moment_codec.convert(as_bf16, "blockwise8", signed=True, numel=999)


@pytest.mark.parametrize(("exp_avg", "exp_avg_sq", "message"), [
    (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), "share one format"),
    (torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8),
     "exp_avg has 8 elements"),
    (torch.zeros(8, dtype=torch.float16), torch.zeros(8, dtype=torch.float16),
     "exp_avg must have dtype"),
])
def test_rejects_mismatched_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        adam.adam_step(torch.zeros(8), exp_avg, exp_avg_sq, torch.zeros(8), step=1, **HYPER)
