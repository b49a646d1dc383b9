"""CPU Adam: every kernel against torch.optim.Adam/AdamW, element-wise.

Tolerances (torch.testing.assert_close, rtol=1e-5, atol=1e-6): the kernels
evaluate the same formulas as torch.optim but the SIMD kernels fuse
multiply-adds (one rounding instead of two) and torch's own vectorised ops
may fuse differently, so each intermediate can differ by a few ulps.  State
values here are O(1) (randn inputs), where an fp32 ulp is ~1.2e-7: atol=1e-6
covers ~8 ulps of absolute error after cancellation (e.g. grad - exp_avg),
rtol=1e-5 covers the compounding over several steps while still catching
any real formula error (a wrong bias correction or a missing term is off by
>= 1e-3 relative).  The bf16/fp16 param_out is compared bit for bit with
torch's conversion of our own fp32 master.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from offloadd.compute import adam, native_adam

NATIVE_KERNELS = adam.native_kernels()
ALL_KERNELS = [*NATIVE_KERNELS, "torch"]
SIZES = [1, 7, 15, 16, 17, 31, 1023, 4097, 10**6 + 3]
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
HYPER: dict[str, Any] = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def native_only(kernel: str) -> None:
    if kernel != "torch" and not NATIVE_KERNELS:
        pytest.skip("offloadd._native is not built")


def make_problem(numel: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "master": torch.randn(numel, generator=gen),
        "exp_avg": torch.randn(numel, generator=gen) * 0.1,
        "exp_avg_sq": torch.rand(numel, generator=gen) * 0.01,
        "grads": torch.randn(STEPS, numel, generator=gen),
    }


def torch_reference(
    problem: dict[str, torch.Tensor],
    grad_dtype: torch.dtype,
    grad_scale: float,
    weight_decay: float,
    decoupled: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW (decoupled) or Adam (L2) on copies, single-tensor path."""
    param = torch.nn.Parameter(problem["master"].clone())
    optimizer_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_cls(
        [param],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=weight_decay,
        foreach=False,
    )
    # Seed the optimizer's state with our initial moments (step counts from 0).
    state = optimizer.state[param]
    state["step"] = torch.tensor(0.0)
    state["exp_avg"] = problem["exp_avg"].clone()
    state["exp_avg_sq"] = problem["exp_avg_sq"].clone()
    for grad in problem["grads"]:
        param.grad = grad.to(grad_dtype).float() * grad_scale
        optimizer.step()
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def run_ours(
    problem: dict[str, torch.Tensor],
    kernel: str,
    grad_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    grad_scale: float,
    weight_decay: float,
    decoupled: bool,
    num_threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    master = problem["master"].clone()
    exp_avg = problem["exp_avg"].clone()
    exp_avg_sq = problem["exp_avg_sq"].clone()
    numel = master.numel()
    param_out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
    for step, grad in enumerate(problem["grads"], start=1):
        adam.adam_step(
            master,
            exp_avg,
            exp_avg_sq,
            grad.to(grad_dtype).contiguous(),
            step=step,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled,
            grad_scale=grad_scale,
            param_out=param_out,
            use_kernel=kernel,  # type: ignore[arg-type]
            num_threads=num_threads,
            **HYPER,
        )
    return master, exp_avg, exp_avg_sq, param_out


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-level equality (distinguishes -0.0 from 0.0, unlike ==)."""
    assert actual.dtype == expected.dtype
    int_dtype = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    mismatch = (actual.view(int_dtype) != expected.view(int_dtype)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} elements differ, first at {mismatch[:4]}"


@pytest.mark.parametrize("kernel", ALL_KERNELS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize(
    "out_dtype",
    [None, torch.bfloat16, torch.float16, torch.float32],
    ids=["noout", "outbf16", "outfp16", "outfp32"],
)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_matches_torch_optim(
    kernel: str,
    numel: int,
    grad_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    decoupled: bool,
) -> None:
    native_only(kernel)
    problem = make_problem(numel, seed=numel)
    grad_scale, weight_decay = 0.37, 0.05
    expected = torch_reference(problem, grad_dtype, grad_scale, weight_decay, decoupled)
    *state, param_out = run_ours(
        problem, kernel, grad_dtype, out_dtype, grad_scale, weight_decay, decoupled
    )
    names = ("master", "exp_avg", "exp_avg_sq")
    for name, ours, ref in zip(names, state, expected, strict=True):
        torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL, msg=f"{name} differs")
    if param_out is not None:
        assert_bits_equal(param_out, state[0].to(param_out.dtype))


@pytest.mark.parametrize("kernel", ALL_KERNELS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_param_out_rounding_is_bit_exact_on_edge_values(
    kernel: str, out_dtype: torch.dtype
) -> None:
    """Ties, subnormals, fp16 overflow and infinities, via lr=0 (master unchanged)."""
    native_only(kernel)
    gen = torch.Generator().manual_seed(7)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int32, generator=gen)
    # signed zeros, fp32/fp16 subnormals, fp16 max and its rounding boundary,
    # exact bf16/fp16 ties (1 + half an ulp), infinities
    edges = torch.tensor(
        [
            *(0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 5.9604645e-08, 2.9802322e-08),
            *(65504.0, 65519.996, 65520.0),
            *(1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11),
            *(math.inf, -math.inf),
        ]
    )
    master = torch.cat([random_bits.view(torch.float32), edges])
    master = master[torch.isfinite(master) | torch.isinf(master)].contiguous()
    numel = master.numel()
    param_out = torch.empty(numel, dtype=out_dtype)
    zeros = torch.zeros(numel)
    adam.adam_step(
        master,
        zeros.clone(),
        zeros.clone(),
        zeros.clone(),
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        param_out=param_out,
        use_kernel=kernel,  # type: ignore[arg-type]
    )
    assert_bits_equal(param_out, master.to(out_dtype))


@pytest.mark.skipif(not NATIVE_KERNELS, reason="offloadd._native is not built")
@pytest.mark.parametrize("kernel", NATIVE_KERNELS)
def test_thread_count_does_not_change_results(kernel: str) -> None:
    problem = make_problem(3 * (1 << 16) + 5, seed=3)
    one = run_ours(problem, kernel, torch.bfloat16, torch.bfloat16, 1.0, 0.01, True, num_threads=1)
    many = run_ours(problem, kernel, torch.bfloat16, torch.bfloat16, 1.0, 0.01, True, num_threads=3)
    for ours_one, ours_many in zip(one, many, strict=True):
        assert ours_one is not None and ours_many is not None
        assert_bits_equal(ours_one, ours_many)


def test_torch_fallback_without_fused_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain-ops fallback (torch builds without _fused_adam(w)_) agrees too."""
    monkeypatch.setattr(adam, "_FUSED_AVAILABLE", False)
    problem = make_problem(1023, seed=11)
    for decoupled in (True, False):
        expected = torch_reference(problem, torch.float32, 2.0, 0.1, decoupled)
        *state, _ = run_ours(problem, "torch", torch.float32, None, 2.0, 0.1, decoupled)
        for ours, ref in zip(state, expected, strict=True):
            torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)


def test_grad_is_never_modified() -> None:
    problem = make_problem(257, seed=5)
    for kernel in ALL_KERNELS:
        grad = problem["grads"][0].clone()
        adam.adam_step(
            problem["master"].clone(),
            problem["exp_avg"].clone(),
            problem["exp_avg_sq"].clone(),
            grad,
            step=1,
            weight_decay=0.1,
            decoupled_weight_decay=False,
            use_kernel=kernel,  # type: ignore[arg-type]
            **HYPER,
        )
        assert_bits_equal(grad, problem["grads"][0])


def test_works_without_native_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_adam, "_native", None)
    assert adam.active_kernel() == "torch"
    assert adam.native_kernels() == []
    problem = make_problem(33, seed=2)
    expected = torch_reference(problem, torch.float32, 1.0, 0.0, True)
    master, exp_avg, exp_avg_sq, _ = run_ours(
        problem, None, torch.float32, None, 1.0, 0.0, True  # type: ignore[arg-type]
    )
    torch.testing.assert_close(master, expected[0], rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="use_native"):
        adam.adam_step(master, exp_avg, exp_avg_sq, master, step=1, use_native=True, **HYPER)


def test_active_kernel_is_best_available() -> None:
    assert adam.active_kernel() == (NATIVE_KERNELS[0] if NATIVE_KERNELS else "torch")


def _valid_args(numel: int = 8) -> dict[str, Any]:
    return {
        "master": torch.zeros(numel),
        "exp_avg": torch.zeros(numel),
        "exp_avg_sq": torch.zeros(numel),
        "grad": torch.zeros(numel),
    }


@pytest.mark.parametrize(
    ("argument", "bad_value", "message"),
    [
        ("master", torch.zeros(8, dtype=torch.float64), "master must have dtype"),
        ("exp_avg", torch.zeros(9), "exp_avg has 9 elements"),
        ("exp_avg_sq", torch.zeros(16)[::2], "exp_avg_sq must be contiguous"),
        ("grad", torch.zeros(8, dtype=torch.float16), "grad must have dtype"),
        ("grad", torch.zeros(8, device="meta"), "grad must be on the CPU"),
        ("param_out", torch.zeros(8, dtype=torch.int32), "param_out must have dtype"),
        ("master", [0.0] * 8, "master must be a torch.Tensor"),
    ],
)
def test_rejects_bad_tensors(argument: str, bad_value: object, message: str) -> None:
    args = _valid_args()
    args[argument] = bad_value
    param_out = args.pop("param_out", None)
    with pytest.raises(ValueError, match=message):
        adam.adam_step(**args, step=1, param_out=param_out, **HYPER)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"step": 0}, "step must be"),
        ({"beta1": 1.0}, "beta1 must be"),
        ({"lr": -1.0}, "lr must be"),
        ({"grad_scale": math.nan}, "grad_scale must be"),
        ({"num_threads": 0}, "num_threads must be"),
        ({"use_kernel": "avx9000"}, "use_kernel='avx9000'"),
    ],
)
def test_rejects_bad_hyperparameters(overrides: dict[str, object], message: str) -> None:
    kwargs: dict[str, Any] = {"step": 1, **HYPER, **overrides}
    with pytest.raises(ValueError, match=message):
        adam.adam_step(**_valid_args(), **kwargs)
