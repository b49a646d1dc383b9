"""The torch reference of the moment formats (``offloadd.formats`` specifies them).

``encode``/``decode`` convert whole moments, ``encode_span_``/``decode_span``
a range of one (what the torch fallback of ``offloadd.compute.adam`` walks through),
``convert`` between formats. A moment is a flat tensor whose dtype is its
format: float32, bfloat16, or uint8 for blockwise8 (fp32 scales, then codes).
The native kernels produce exactly these bytes from the same fp32 values.
"""

from __future__ import annotations

import torch

from offloadd.formats import (
    BLOCK_ELEMENTS,
    DROPPED_BITS,
    MASK32,
    MOMENT_FORMATS,
    SIGNED_BIAS,
    SIGNED_HALF_SMALLEST_BITS,
    SMALLEST_CODE,
    UNSIGNED_BIAS,
    MomentFormat,
    blockwise8_numel,
    moment_nbytes,
    num_blocks,
)

__all__ = [
    "convert",
    "decode",
    "decode_span",
    "empty",
    "encode",
    "encode_span_",
    "format_of",
    "moment_numel",
    "split_blockwise8",
]

_TORCH_DTYPES: dict[MomentFormat, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "blockwise8": torch.uint8}


def format_of(dtype: torch.dtype) -> MomentFormat:
    """The format of a moment held as a tensor of ``dtype``."""
    for name, torch_dtype in _TORCH_DTYPES.items():
        if torch_dtype == dtype:
            return name
    raise ValueError(f"no moment format is stored as {dtype}: expected float32, bfloat16 "
                     "or uint8 (blockwise8)")


def split_blockwise8(buffer: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scales and the uint8 codes of a ``blockwise8`` moment (views of ``buffer``)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"a blockwise8 moment is a flat uint8 tensor, got {buffer.dtype} "
                         f"with shape {tuple(buffer.shape)}")
    if buffer.numel() != moment_nbytes("blockwise8", numel):
        raise ValueError(f"a blockwise8 moment of {numel} elements takes "
                         f"{moment_nbytes('blockwise8', numel)} bytes, got {buffer.numel()}")
    scale_nbytes = 4 * num_blocks(numel)
    return buffer[:scale_nbytes].view(torch.float32), buffer[scale_nbytes:]


def moment_numel(buffer: torch.Tensor) -> int:
    """Elements of the moment held in ``buffer``."""
    if buffer.dtype == torch.uint8:
        return blockwise8_numel(buffer.numel())
    return buffer.numel()


# ---------------------------------------------------------------- rounding bits


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 on int64 tensors holding uint32 values, without int64
    overflow (the constant's halves are multiplied separately)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """``offloadd.formats.hash32`` of every element (uint32 values in int64)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _random_bits(numel: int, index_offset: int, key: int) -> torch.Tensor:
    index = torch.arange(index_offset, index_offset + numel, dtype=torch.int64) & MASK32
    return _hash32(index ^ key)


# ---------------------------------------------------------------- bf16


def _bf16_stochastic(values: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``values`` to bf16, up in magnitude with the probability of the 16
    dropped bits: add 16 random bits to the fp32 pattern and truncate. NaN stays NaN
    (0xFFFF, as the round-to-nearest conversion gives)."""
    bits = values.view(torch.int32).to(torch.int64) & MASK32
    top = ((bits + random16) >> 16) & 0xFFFF
    top = torch.where(values.isnan(), 0xFFFF, top)
    top = torch.where(top >= 1 << 15, top - (1 << 16), top)  # as int16 bit patterns
    return top.to(torch.int16).view(torch.bfloat16)


# ---------------------------------------------------------------- blockwise8


def _encode_codes(normalized: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """Codes of ``normalized`` (|x| <= 1), rounded to nearest, ties to even."""
    bits = normalized.view(torch.int32).to(torch.int64) & MASK32
    magnitude_bits = bits & 0x7FFFFFFF
    half = (1 << (DROPPED_BITS - 1)) - 1
    rounded = (magnitude_bits + half + ((magnitude_bits >> DROPPED_BITS) & 1)) >> DROPPED_BITS
    bias = SIGNED_BIAS if signed else UNSIGNED_BIAS
    magnitude = rounded - bias
    if signed:
        below = (magnitude_bits >= SIGNED_HALF_SMALLEST_BITS).to(torch.int64) * SMALLEST_CODE
    else:
        below = (magnitude_bits != 0).to(torch.int64) * SMALLEST_CODE
    magnitude = torch.where(magnitude < SMALLEST_CODE, below, magnitude)
    if signed:
        magnitude = magnitude | ((bits >> 24) & 0x80)
    return magnitude.to(torch.uint8)


def _decode_codes(codes: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """Values (|x| <= 1) of ``codes``; exact."""
    codes = codes.to(torch.int32)
    magnitude = codes & 0x7F if signed else codes
    bias = SIGNED_BIAS if signed else UNSIGNED_BIAS
    bits = torch.where(magnitude == 0, 0, (magnitude + bias) << DROPPED_BITS)
    if signed:
        bits = bits | ((codes & 0x80) << 24)
    return bits.view(torch.float32)


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as rows of BLOCK_ELEMENTS, the last one padded with zeros."""
    pad = -flat.numel() % BLOCK_ELEMENTS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK_ELEMENTS)


def _encode_blockwise8(values: torch.Tensor, scales_out: torch.Tensor, codes_out: torch.Tensor,
                       *, signed: bool) -> None:
    blocks = _blocks(values)
    scales = blocks.abs().amax(dim=1)
    # An all-zero block keeps scale 0 and divides by 1, so its codes are zero too.
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    scales_out.copy_(scales)
    codes_out.copy_(_encode_codes(blocks / divisor[:, None], signed=signed).view(-1)[
        :values.numel()])


def _decode_blockwise8(scales: torch.Tensor, codes: torch.Tensor, *, signed: bool
                       ) -> torch.Tensor:
    normalized = _blocks(_decode_codes(codes, signed=signed))
    return (normalized * scales[:, None]).view(-1)[:codes.numel()]


def _block_span(buffer: torch.Tensor, numel: int, begin: int, end: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and codes of elements [begin, end) of a blockwise8 moment (``begin`` on a
    block boundary)."""
    if begin % BLOCK_ELEMENTS:
        raise ValueError(f"a blockwise8 span starts on a block boundary, not at {begin}")
    scales, codes = split_blockwise8(buffer, numel)
    return scales[begin // BLOCK_ELEMENTS:num_blocks(end)], codes[begin:end]


# ---------------------------------------------------------------- public


def decode_span(buffer: torch.Tensor, numel: int, begin: int, end: int, *, signed: bool
                ) -> torch.Tensor:
    """Elements [begin, end) of a moment of ``numel`` elements stored in ``buffer`` (its
    format is its dtype), as a new fp32 tensor. blockwise8 spans start on a block."""
    fmt = format_of(buffer.dtype)
    if fmt == "blockwise8":
        return _decode_blockwise8(*_block_span(buffer, numel, begin, end), signed=signed)
    return buffer[begin:end].to(torch.float32, copy=True)


def encode_span_(buffer: torch.Tensor, numel: int, begin: int, end: int, values: torch.Tensor,
                 *, signed: bool, key: int = 0) -> None:
    """Store fp32 ``values`` as elements [begin, end) of the moment in ``buffer``, in its
    format. bf16 rounds with the bits of ``moments.rounding_key`` ``key`` (element ``i`` of the
    moment draws ``hash32(i ^ key)``)."""
    fmt = format_of(buffer.dtype)
    if fmt == "float32":
        buffer[begin:end].copy_(values)
    elif fmt == "bfloat16":
        random = _random_bits(end - begin, begin, key)
        random16 = random & 0xFFFF if signed else random >> 16
        buffer[begin:end].copy_(_bf16_stochastic(values, random16))
    else:
        scales, codes = _block_span(buffer, numel, begin, end)
        _encode_blockwise8(values, scales, codes, signed=signed)


def empty(fmt: MomentFormat, numel: int) -> torch.Tensor:
    """An uninitialised moment of ``numel`` elements in ``fmt``."""
    if fmt not in _TORCH_DTYPES:
        raise ValueError(f"unknown moment format {fmt!r}: expected one of {MOMENT_FORMATS}")
    count = moment_nbytes(fmt, numel) // _TORCH_DTYPES[fmt].itemsize
    return torch.empty(count, dtype=_TORCH_DTYPES[fmt])


def encode(values: torch.Tensor, fmt: MomentFormat, *, signed: bool, key: int = 0
           ) -> torch.Tensor:
    """Flat fp32 ``values`` stored in ``fmt``: a new tensor (fp32, bf16, or blockwise8's
    uint8 scales-then-codes). ``signed``: exp_avg (True) or exp_avg_sq (False)."""
    values = values.reshape(-1).to(torch.float32)
    out = empty(fmt, values.numel())
    encode_span_(out, values.numel(), 0, values.numel(), values, signed=signed, key=key)
    return out


def decode(buffer: torch.Tensor, *, signed: bool, numel: int | None = None) -> torch.Tensor:
    """The fp32 values of a whole moment stored in ``buffer`` (its format is its dtype)."""
    buffer = buffer.reshape(-1)
    numel = numel if numel is not None else moment_numel(buffer)
    return decode_span(buffer, numel, 0, numel, signed=signed)


def convert(buffer: torch.Tensor, fmt: MomentFormat, *, signed: bool, numel: int,
            key: int = 0) -> torch.Tensor:
    """A moment of ``numel`` elements (any format) in ``fmt``: ``buffer`` itself when
    already in it (exact), else decoded and encoded again (bf16 -> fp32 is exact; into a
    smaller format rounds)."""
    buffer = buffer.reshape(-1)
    if moment_numel(buffer) != numel:
        raise ValueError(f"the moment holds {moment_numel(buffer)} elements "
                         f"({format_of(buffer.dtype)}), expected {numel}")
    if format_of(buffer.dtype) == fmt:
        return buffer
    return encode(decode(buffer, signed=signed, numel=numel), fmt, signed=signed, key=key)
