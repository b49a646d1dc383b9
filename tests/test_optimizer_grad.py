"""The optimizer service takes the gradient in the training dtype and, when asked,
forgets it after the step (the next gradient window re-creates it)."""

from __future__ import annotations

import pytest
import torch

from offloadd.compute import adam
from offloadd.errors import UnknownShardError

NUMEL = 4099  # not a multiple of any SIMD width: the kernel's tails run too
HYPER = {"step": 3, "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
         "weight_decay": 0.01, "grad_scale": 0.5}


def state(grad_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    out = {name: torch.rand(NUMEL, generator=generator)
           for name in ("master", "exp_avg", "exp_avg_sq")}
    out["grad"] = torch.randn(NUMEL, generator=generator).to(grad_dtype)
    out["param"] = out["master"].to(torch.bfloat16)
    return out


def stepped_in_daemon(client, values: dict[str, torch.Tensor], *, drop_grad: bool
                      ) -> dict[str, torch.Tensor]:
    client.put_many({f"u.{name}": tensor for name, tensor in values.items()})
    client.optimizer_step("u", drop_grad=drop_grad, **HYPER)
    return {name: torch.frombuffer(bytearray(client.get(f"u.{name}")), dtype=tensor.dtype)
            for name, tensor in values.items() if name != "grad"}


@pytest.mark.parametrize("drop_grad", [False, True])
def test_a_bf16_gradient_steps_exactly_as_its_fp32_widening(connect, drop_grad: bool) -> None:
    values = state(torch.bfloat16)
    ours = stepped_in_daemon(connect(), values, drop_grad=drop_grad)
    widened = {name: tensor.clone() for name, tensor in values.items()}
    widened["grad"] = widened["grad"].float()
    adam.adam_step(widened["master"], widened["exp_avg"], widened["exp_avg_sq"],
                   widened["grad"], param_out=widened["param"], **HYPER)
    for name in ("master", "exp_avg", "exp_avg_sq", "param"):
        assert torch.equal(ours[name], widened[name]), name


def test_drop_grad_forgets_only_the_gradient(connect) -> None:
    client = connect()
    stepped_in_daemon(client, state(torch.bfloat16), drop_grad=True)
    with pytest.raises(UnknownShardError):
        client.get("u.grad")
    assert client.stats()["num_shards"] == 4  # master, moments, param
    kept = connect()
    stepped_in_daemon(kept, state(torch.bfloat16), drop_grad=False)
    assert len(kept.get("u.grad")) == 2 * NUMEL
