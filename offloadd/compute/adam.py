"""Fused CPU Adam/AdamW over fp32 master weights, for the optimizer service.

`adam_step` updates master, exp_avg and exp_avg_sq in place (typically views
of the shared arena), or writes the state it reads from another copy into them
(out of place) with exactly the semantics of torch.optim.AdamW
(decoupled weight decay) or torch.optim.Adam (L2 weight decay), and can write
a bf16/fp16/fp32 copy of the updated master in the same pass. The moments
may be compact (bf16 or 8-bit block-wise, see offloadd.formats): they are
decoded, updated in fp32 and encoded again in the same pass.

The native kernel (offloadd._native) is one fused pass that reads every byte
once, chosen at runtime among AVX-512, AVX2+FMA and scalar code, spread over
a persistent thread pool with the GIL released.  Without the native module
the same update runs as torch ops (torch._fused_adam(w)_ where available).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch

from offloadd import formats, moment_codec
from offloadd.compute import native_adam

__all__ = ["KernelName", "active_kernel", "adam_step", "native_kernels"]

logger = logging.getLogger(__name__)

KernelName = Literal["avx512", "avx2", "scalar", "torch"]

_TORCH_SPAN_ELEMENTS = 1 << 20
"""The torch path updates compact moments this many elements at a time (a multiple of
the blockwise8 block), so its fp32 temporaries stay small whatever the unit's size."""


def native_kernels() -> list[str]:
    """Native kernels this CPU can run, best first; empty without the native module."""
    return native_adam.kernels()


def active_kernel() -> KernelName:
    """The kernel `adam_step` uses by default: the best native one, else "torch"."""
    kernels = native_kernels()
    return kernels[0] if kernels else "torch"  # type: ignore[return-value]


def adam_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True,
    grad_scale: float = 1.0,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
    use_native: bool | None = None,
    use_kernel: KernelName | None = None,
    rounding_seed: int = 0,
    source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One Adam/AdamW step over flat state, in place (or out of place, see ``source``).

    master is fp32. exp_avg and exp_avg_sq are both fp32, both bf16, or both uint8
    (blockwise8 buffers of offloadd.formats); compact moments are decoded, updated in
    fp32 and stored again, bf16 with stochastic rounding keyed by rounding_seed and
    step (the same seed and step round alike in every kernel and thread split).

    grad (fp32 or bf16) is multiplied by grad_scale before use, which folds
    loss-scale unscaling and gradient clipping into this pass.  step is the
    1-based step count used for bias correction.  param_out, if given,
    receives the updated master rounded to its dtype (round-to-nearest-even,
    bit-identical to ``master.to(param_out.dtype)``).

    source (master, exp_avg, exp_avg_sq of the same dtypes and sizes) makes the step
    out of place: the state is read from it, left unchanged, and the updated state is
    written to master, exp_avg and exp_avg_sq (a speculative step keeps the state it
    stepped from). The native kernels read and write every byte once either way; out
    of place they stream the state's stores (no read of the destination first).

    use_native=None picks native when built; False forces the torch path.
    use_kernel forces one kernel ("avx512", "avx2", "scalar" or "torch"),
    mainly for tests.  num_threads=None uses every CPU this process may run on.
    """
    _check_state(master, exp_avg, exp_avg_sq, grad, param_out)
    native_adam.check_hyperparameters(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay, grad_scale=grad_scale,
                                      num_threads=num_threads)
    read_from = _check_source((master, exp_avg, exp_avg_sq), source)
    kernel = _choose_kernel(use_native, use_kernel)
    if master.numel() == 0:
        return
    if kernel == "torch" and read_from is not None:  # the same step, after a copy
        for state, copy in zip((master, exp_avg, exp_avg_sq), read_from, strict=True):
            state.copy_(copy)
        read_from = None
    hyper: dict[str, Any] = dict(
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        grad_scale=grad_scale,
    )
    if kernel != "torch":
        _native_step(master, exp_avg, exp_avg_sq, grad, param_out, kernel, num_threads,
                     rounding_seed, read_from, **hyper)
    elif moment_codec.format_of(exp_avg.dtype) != "float32":
        key = formats.rounding_key(rounding_seed, step)
        _torch_compact_step(master, exp_avg, exp_avg_sq, grad, param_out, key, **hyper)
    else:
        _torch_step(master, exp_avg, exp_avg_sq, grad, param_out, **hyper)


def _check_source(state: tuple[torch.Tensor, ...], source: Any
                  ) -> tuple[torch.Tensor, ...] | None:
    """The state an out-of-place step reads, each tensor of its written tensor's dtype and
    size, sharing no memory with what is written; None for an in-place step."""
    if source is None:
        return None
    source = tuple(source)
    if len(source) != len(state):
        raise ValueError(f"source is master, exp_avg and exp_avg_sq, got {len(source)} tensors")
    for name, copy, tensor in zip(("master", "exp_avg", "exp_avg_sq"), source, state,
                                  strict=True):
        _check_tensor(f"the source {name}", copy, (tensor.dtype,), tensor.numel())
    native_adam.check_source(tuple(_flat(copy) for copy in source),
                             (_flat(state[0]), _flat(state[1]), _flat(state[2])))
    return source


def _check_tensor(name: str, tensor: Any, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {tensor.device}")
    if tensor.dtype not in dtypes:
        accepted = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({accepted}), got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements, master has {numel}")


def _check_state(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
) -> None:
    if not isinstance(master, torch.Tensor):
        raise ValueError(f"master must be a torch.Tensor, got {type(master).__name__}")
    numel = master.numel()
    _check_tensor("master", master, (torch.float32,), numel)
    _check_moments(exp_avg, exp_avg_sq, numel)
    _check_tensor("grad", grad, (torch.float32, torch.bfloat16), numel)
    if param_out is not None:
        out_dtypes = (torch.bfloat16, torch.float16, torch.float32)
        _check_tensor("param_out", param_out, out_dtypes, numel)


def _check_moments(exp_avg: Any, exp_avg_sq: Any, numel: int) -> None:
    """fp32, bf16 or blockwise8 (uint8) moments, both in one format, sized for numel."""
    moment_dtypes = (torch.float32, torch.bfloat16, torch.uint8)
    for name, moment in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(moment, torch.Tensor) or moment.dtype not in moment_dtypes:
            _check_tensor(name, moment, moment_dtypes, numel)  # raises the type error
        fmt = moment_codec.format_of(moment.dtype)
        _check_tensor(name, moment, moment_dtypes,
                      formats.moment_nbytes(fmt, numel) // moment.element_size())
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"exp_avg and exp_avg_sq must share one format, got {exp_avg.dtype} "
                         f"and {exp_avg_sq.dtype}")


def _choose_kernel(use_native: bool | None, use_kernel: KernelName | None) -> KernelName:
    if use_kernel is not None:
        if use_kernel != "torch" and use_kernel not in native_kernels():
            raise ValueError(
                f"use_kernel={use_kernel!r} is not available here; "
                f"choose from {[*native_kernels(), 'torch']}"
            )
        return use_kernel
    if use_native is False:
        return "torch"
    if use_native and not native_kernels():
        raise ValueError("use_native=True but offloadd._native is not built")
    return active_kernel()


def _native_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    kernel: str,
    num_threads: int | None,
    rounding_seed: int,
    source: tuple[torch.Tensor, ...] | None,
    **hyper: Any,
) -> None:
    # Addresses are only valid while the tensors live: they are all
    # arguments of this call, so the caller keeps them alive throughout.
    native_adam.step(
        _flat(master), _flat(exp_avg), _flat(exp_avg_sq), _flat(grad), kernel=kernel,
        num_threads=num_threads, rounding_seed=rounding_seed,
        param_out=None if param_out is None else _flat(param_out),
        source=None if source is None else (_flat(source[0]), _flat(source[1]),
                                            _flat(source[2])),
        **hyper)


def _flat(tensor: torch.Tensor) -> native_adam.Flat:
    """A contiguous CPU tensor as the native kernels take it (checked by the caller)."""
    return native_adam.Flat(tensor.data_ptr(), str(tensor.dtype).removeprefix("torch."),
                            tensor.nbytes)


def _torch_compact_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    key: int,
    **hyper: Any,
) -> None:
    """The reference: decode a span's moments, run the fp32 step, encode them again."""
    numel = master.numel()
    for begin in range(0, numel, _TORCH_SPAN_ELEMENTS):
        end = min(numel, begin + _TORCH_SPAN_ELEMENTS)
        exp_avg_span = moment_codec.decode_span(exp_avg, numel, begin, end, signed=True)
        exp_avg_sq_span = moment_codec.decode_span(exp_avg_sq, numel, begin, end, signed=False)
        _torch_step(master[begin:end], exp_avg_span, exp_avg_sq_span, grad[begin:end],
                    None if param_out is None else param_out[begin:end], **hyper)
        moment_codec.encode_span_(exp_avg, numel, begin, end, exp_avg_span, signed=True, key=key)
        moment_codec.encode_span_(exp_avg_sq, numel, begin, end, exp_avg_sq_span, signed=False,
                             key=key)


def _torch_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    grad_scale: float,
) -> None:
    # Hazard: grad.float() is grad itself for fp32, so nothing below may write to it.
    scaled = grad.float() if grad_scale == 1.0 else grad.float() * grad_scale
    if _FUSED_AVAILABLE:
        fused = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        fused(
            [master],
            [scaled],
            [exp_avg],
            [exp_avg_sq],
            [],
            [torch.tensor(float(step))],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
    else:
        _torch_unfused_step(
            master, exp_avg, exp_avg_sq, scaled, step, lr, beta1, beta2, eps, weight_decay,
            decoupled_weight_decay,
        )
    if param_out is not None:
        param_out.copy_(master)


def _torch_unfused_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
) -> None:
    """torch.optim's single-tensor Adam(W) update (grad is read-only here)."""
    if weight_decay != 0.0:
        if decoupled_weight_decay:
            master.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(master, alpha=weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)


# torch._fused_adam(w)_ runs on CPU since torch 2.4; older builds use the unfused ops.
_FUSED_AVAILABLE = hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_adam_")

logger.info(
    "cpu adam: %s",
    f"native kernel {active_kernel()} (available: {native_kernels()})"
    if native_kernels()
    else "offloadd._native not built, using torch ops",
)
