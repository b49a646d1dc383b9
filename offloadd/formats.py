"""Shard dtypes and how the Adam moments of a unit are stored: fp32, bf16, or 8-bit block-wise.

The fp32 master is always fp32; only ``exp_avg`` and ``exp_avg_sq`` may be
compact, which cuts the optimizer state crossing the disk per step from 12 B
to 8 B (bf16) or ~6 B (8-bit) per parameter. One format per unit, chosen by
the rank when it creates the shards and read back by the daemon from the
shard's dtype tag:

- ``float32`` (tag ``float32``): 4 B per element, exactly torch's AdamW.
- ``bfloat16`` (tag ``bfloat16``): 2 B per element. Each step computes the
  moments in fp32 and rounds them to bf16 **stochastically** (up with the
  probability of the dropped low 16 bits), so the stored moment is unbiased.
  Round-to-nearest would be biased here: with beta2 = 0.999 a step moves
  ``exp_avg_sq`` by ~0.1%, less than half a bf16 ulp (0.2-0.4%), so under
  round-to-nearest it could never decay and only ratchets up on spikes.
- ``blockwise8`` (tag ``uint8``): ~1.016 B per element. Per block of
  ``BLOCK_ELEMENTS`` elements one fp32 scale, the block's largest magnitude
  (absmax), and one byte per element: a small float code of the element
  divided by that scale, rounded to nearest (ties to even). The absmax
  element is exact (code 1.0), so a block whose largest moment decays or
  grows carries the others with it. ``exp_avg`` (signed) uses a sign bit, 4
  exponent and 3 mantissa bits: magnitudes 2^-14 .. 1 (values below 2^-15
  of the absmax become 0). ``exp_avg_sq`` (never negative) needs no sign and
  spends it on range, 5 exponent and 3 mantissa bits: 2^-30 .. 1, and a
  nonzero value is never stored as 0 (it becomes 2^-30 of the absmax):
  Adam divides by sqrt(exp_avg_sq), and a second moment rounded to zero
  under a nonzero first moment would turn into a step of lr * m / eps.
  Like bitsandbytes' and torchao's 8-bit Adam, the block-wise absmax scale
  keeps the quantization relative to each block's own magnitude; unlike
  their 256-entry lookup maps, the code is an exponent and a mantissa, so a
  SIMD kernel encodes it with integer arithmetic instead of a table search.
  Round-to-nearest, not stochastic: at 3 mantissa bits a stochastic
  rounding's per-step noise (up to ~6%) would accumulate in exp_avg_sq over
  its ~1/(1 - beta2) steps of memory into noise larger than the moment.

Layout of a ``blockwise8`` moment of ``numel`` elements in its shard:
``num_blocks(numel)`` fp32 scales, then ``numel`` code bytes; block ``b``
holds elements ``[b * BLOCK_ELEMENTS, (b + 1) * BLOCK_ELEMENTS)`` of the
unit's partition, the last block possibly shorter.

Each step's parameter update uses the fp32 moments it just computed; only
what is stored for the next step is rounded (as torchao's low-bit Adam does),
so the first step equals fp32 Adam exactly.

Stochastic rounding draws its bits from a counter-based hash of the element
index and a per-step key (``rounding_key``), so every kernel, any thread
split and a resumed run round alike.

This module is the formats' specification (names, sizes, layout, rounding
key) and imports no torch, so the daemon checks shards and steps them with its
native kernels without torch; ``offloadd.moment_codec`` is the torch reference
encoder/decoder: a native kernel's compact step (``offloadd._native``) equals
decoding with it, that kernel's fp32 step and encoding with it, byte for byte
(``tests/test_compact_kernels.py``).
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "BLOCK_ELEMENTS",
    "MOMENT_FORMATS",
    "SHARD_DTYPES",
    "MomentFormat",
    "hash32",
    "moment_nbytes",
    "num_blocks",
    "rounding_key",
]

MomentFormat = Literal["float32", "bfloat16", "blockwise8"]
MOMENT_FORMATS: tuple[MomentFormat, ...] = ("float32", "bfloat16", "blockwise8")
SHARD_DTYPES: dict[MomentFormat, str] = {
    "float32": "float32", "bfloat16": "bfloat16", "blockwise8": "uint8"}
"""The shard dtype tag each format's moments are created with (what the daemon reads)."""
ITEMSIZE: dict[MomentFormat, int] = {"float32": 4, "bfloat16": 2, "blockwise8": 1}
"""Bytes per element of the format's tensor (blockwise8 adds its scales)."""

BLOCK_ELEMENTS = 256
"""Elements sharing one fp32 scale in ``blockwise8`` (torchao's and bitsandbytes' size:
small enough that one large element does not flatten its neighbours to zero)."""

# Code layout (see the module docstring). A code's magnitude is the fp32 value's
# (biased exponent << 3 | top 3 mantissa bits) minus a bias that maps 1.0 to the
# largest code: 120 for the signed code, 248 for the unsigned one.
MANTISSA_BITS = 3
DROPPED_BITS = 23 - MANTISSA_BITS
SIGNED_BIAS = (127 - 15) << MANTISSA_BITS
UNSIGNED_BIAS = (127 - 31) << MANTISSA_BITS
SMALLEST_CODE = 1 << MANTISSA_BITS
"""The smallest nonzero magnitude code: exponent field 1, mantissa 0."""
SIGNED_HALF_SMALLEST_BITS = (127 - 15) << 23
"""fp32 bits of 2^-15, half the smallest signed magnitude: at or above it rounds up to it."""

MASK32 = 0xFFFFFFFF


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK_ELEMENTS)


def moment_nbytes(fmt: MomentFormat, numel: int) -> int:
    """Bytes one moment of ``numel`` elements takes in ``fmt``."""
    if fmt not in ITEMSIZE:
        raise ValueError(f"unknown moment format {fmt!r}: expected one of {MOMENT_FORMATS}")
    if fmt == "blockwise8":
        return 4 * num_blocks(numel) + numel
    return ITEMSIZE[fmt] * numel


def blockwise8_numel(nbytes: int) -> int:
    """Elements of a blockwise8 moment of ``nbytes`` bytes (the size determines them)."""
    # The size grows strictly with the element count, so at most one count fits.
    guess = nbytes // (BLOCK_ELEMENTS + 4)
    for blocks in range(max(0, guess - 1), guess + 2):
        numel = nbytes - 4 * blocks
        if numel >= 0 and num_blocks(numel) == blocks:
            return numel
    raise ValueError(f"{nbytes} bytes is no blockwise8 moment's size")


def hash32(x: int) -> int:
    """A 32-bit integer hash with full avalanche (C. Wellons' "lowbias32"): the source
    of stochastic rounding's bits, computed alike by the codec and the native kernels."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of one step's stochastic rounding: element ``i`` draws
    ``hash32(i ^ key)``; ``exp_avg`` uses its low 16 bits, ``exp_avg_sq`` its high ones."""
    return hash32(hash32(seed) ^ (step & MASK32) ^ 0x9E3779B9)
