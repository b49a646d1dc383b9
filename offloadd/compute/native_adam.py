"""The native Adam kernels over flat buffers, without torch.

The daemon's optimizer steps run here: a unit's shards are spans of the shared arena,
each described by its address, dtype tag (``offloadd.protocol.DTYPES``) and size, and the
native kernels take exactly that. So a daemon with the native module built never imports
torch (~2.5 s of CPU and a few hundred MB of resident memory on its first step); only the
fallback without it, and the tensor API of ``offloadd.compute.adam``, need torch, and that
API describes its tensors as ``Flat`` buffers and calls ``step`` here.

Callers keep the memory behind every address alive (and unchanged by others) until the
call returns; the kernels release the GIL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from offloadd import formats
from offloadd.protocol import DTYPE_ITEMSIZE

try:
    import offloadd._native as _native
except ImportError:  # the package must work without its compiled part
    _native = None

__all__ = ["Flat", "check_hyperparameters", "check_source", "kernels", "moment_format",
           "round_into", "step"]

GRAD_DTYPE_CODES = {"float32": 0, "bfloat16": 1}
OUT_DTYPE_CODES = {None: 0, "float32": 1, "bfloat16": 2, "float16": 3}
MOMENT_FORMAT_CODES = {"bfloat16": 1, "blockwise8": 2}
MOMENT_FORMAT_OF_DTYPE = {dtype: fmt for fmt, dtype in formats.SHARD_DTYPES.items()}
"""Dtype tag of a moment's buffer -> its format (uint8: 8-bit block-wise)."""


@dataclass(frozen=True, slots=True)
class Flat:
    """A flat, contiguous buffer in this process's memory: where, of what, how many bytes."""

    address: int
    dtype: str
    nbytes: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        if self.nbytes < 0 or self.nbytes % DTYPE_ITEMSIZE[self.dtype]:
            raise ValueError(f"{self.nbytes} bytes is no whole number of {self.dtype} elements")
        if self.nbytes and self.address <= 0:
            raise ValueError(f"a buffer of {self.nbytes} bytes needs an address, got "
                             f"{self.address:#x}")

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPE_ITEMSIZE[self.dtype]


def kernels() -> list[str]:
    """Native kernels this CPU can run, best first; empty without the native module."""
    return list(_native.adam_kernels()) if _native is not None else []


def moment_format(dtype: str) -> formats.MomentFormat:
    """The format of a moment held in a buffer of dtype tag ``dtype``."""
    fmt = MOMENT_FORMAT_OF_DTYPE.get(dtype)
    if fmt is None:
        raise ValueError(f"no moment format is stored as {dtype}: expected float32, bfloat16 "
                         "or uint8 (blockwise8)")
    return fmt


def step(master: Flat, exp_avg: Flat, exp_avg_sq: Flat, grad: Flat, *, kernel: str,
         num_threads: int | None, rounding_seed: int, param_out: Flat | None = None,
         source: tuple[Flat, Flat, Flat] | None = None, **hyper: Any) -> None:
    """One Adam/AdamW step with native ``kernel`` (``offloadd.compute.adam.adam_step`` says
    what every argument means; ``hyper`` are its step, lr, betas, eps, weight decay and
    grad scale). The buffers' dtypes and sizes must agree with the master's element count;
    a mismatch raises ValueError naming the buffer, before any byte is written."""
    if _native is None:
        raise RuntimeError("offloadd._native is not built: use offloadd.compute.adam's torch "
                           "path")
    numel = _check_flats(master, exp_avg, exp_avg_sq, grad, param_out, source)
    if numel == 0:
        return
    fmt = moment_format(exp_avg.dtype)
    out_address = 0 if param_out is None else param_out.address
    out_code = OUT_DTYPE_CODES[None if param_out is None else param_out.dtype]
    threads = num_threads or 0
    if fmt == "float32":
        _native.adam_step(
            master.address, exp_avg.address, exp_avg_sq.address, grad.address,
            GRAD_DTYPE_CODES[grad.dtype], out_address, out_code, numel, kernel=kernel,
            num_threads=threads, source=[flat.address for flat in source or ()], **hyper)
        return
    (avg_codes, avg_scales), (sq_codes, sq_scales) = (
        _codes_and_scales(fmt, moment, numel) for moment in (exp_avg, exp_avg_sq))
    source_addresses = []
    if source is not None:  # the native order: master, both codes, both scales (blockwise8)
        source_master, *source_moments = source
        parts = [_codes_and_scales(fmt, moment, numel) for moment in source_moments]
        source_addresses = [source_master.address, *(codes for codes, _ in parts)]
        if fmt == "blockwise8":
            source_addresses += [scales for _, scales in parts]
    _native.adam_step_compact(
        master.address, grad.address, GRAD_DTYPE_CODES[grad.dtype], out_address, out_code,
        numel, MOMENT_FORMAT_CODES[fmt], avg_codes, sq_codes, avg_scales, sq_scales,
        formats.rounding_key(rounding_seed, hyper["step"]), kernel=kernel,
        num_threads=threads, source=source_addresses, **hyper)


def check_hyperparameters(*, step: int, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, grad_scale: float,
                          decoupled_weight_decay: bool = True,
                          num_threads: int | None = None) -> None:
    """ValueError naming the first hyperparameter out of its range."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (1-based step count), got {step!r}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale must be finite, got {grad_scale}")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1 or None (all CPUs), got {num_threads}")


def round_into(master: Flat, out: Flat) -> None:
    """Write the fp32 ``master`` into ``out`` (fp32, bf16 or fp16), rounded to nearest, ties
    to even, as ``out.copy_(master)`` rounds: a reverted step's parameter."""
    if _native is None:
        raise RuntimeError("offloadd._native is not built: use torch's copy_")
    if master.dtype != "float32":
        raise ValueError(f"the master must be float32, got {master.dtype}")
    if out.dtype not in ("float32", "bfloat16", "float16") or out.numel != master.numel:
        raise ValueError(f"the parameter must be {master.numel} float32, bfloat16 or float16 "
                         f"elements, got {out.numel} {out.dtype}")
    if master.numel:
        _native.round_into(master.address, out.address, OUT_DTYPE_CODES[out.dtype], master.numel)


def _check_flats(master: Flat, exp_avg: Flat, exp_avg_sq: Flat, grad: Flat,
                 param_out: Flat | None, source: tuple[Flat, ...] | None) -> int:
    """The master's element count, once every buffer fits it (else ValueError)."""
    if master.dtype != "float32":
        raise ValueError(f"master must be float32, got {master.dtype}")
    numel = master.numel
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"exp_avg and exp_avg_sq must share one format, got {exp_avg.dtype} "
                         f"and {exp_avg_sq.dtype}")
    moment_nbytes = formats.moment_nbytes(moment_format(exp_avg.dtype), numel)
    for name, moment in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if moment.nbytes != moment_nbytes:
            raise ValueError(f"{name} has {moment.nbytes} bytes; a {exp_avg.dtype} moment of "
                             f"{numel} elements takes {moment_nbytes}")
    if grad.dtype not in GRAD_DTYPE_CODES or grad.numel != numel:
        raise ValueError(f"grad must be {numel} float32 or bfloat16 elements, got "
                         f"{grad.numel} {grad.dtype}")
    if param_out is not None and (param_out.dtype not in ("float32", "bfloat16", "float16")
                                  or param_out.numel != numel):
        raise ValueError(f"param_out must be {numel} float32, bfloat16 or float16 elements, "
                         f"got {param_out.numel} {param_out.dtype}")
    if source is not None:
        check_source(source, (master, exp_avg, exp_avg_sq))
    return numel


def check_source(source: tuple[Flat, ...], written: tuple[Flat, Flat, Flat]) -> None:
    """An out-of-place step's source (master, exp_avg, exp_avg_sq): each of its written
    buffer's dtype and size, sharing no byte with what the step writes (else ValueError)."""
    if len(source) != len(written):
        raise ValueError(f"source is master, exp_avg and exp_avg_sq, got {len(source)}")
    for name, copy, target in zip(("master", "exp_avg", "exp_avg_sq"), source, written,
                                  strict=True):
        if copy.dtype != target.dtype or copy.nbytes != target.nbytes:
            raise ValueError(f"the source {name} ({copy.nbytes} bytes of {copy.dtype}) "
                             f"must match the {name} the step writes ({target.nbytes} "
                             f"bytes of {target.dtype})")
        if (copy.address < target.address + target.nbytes
                and target.address < copy.address + copy.nbytes):
            raise ValueError(f"the source {name} overlaps the {name} the step writes: "
                             "pass source=None for an in-place step")


def _codes_and_scales(fmt: str, moment: Flat, numel: int) -> tuple[int, int]:
    """A compact moment's codes (bf16 bits or blockwise8 codes) and scales (0: none): a
    blockwise8 buffer holds its blocks' fp32 scales first, then one code per element."""
    if fmt == "blockwise8":
        return moment.address + 4 * formats.num_blocks(numel), moment.address
    return moment.address, 0
