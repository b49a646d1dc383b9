"""``DaemonBackend.register`` writes a unit's first state straight into its arena leases;
the bytes must be exactly those of the host copies it used to put: the fp32 master as
given, ``master.to(param_dtype)`` as the param copy, zero moments and gradient (over arena
bytes a dropped shard left dirty), in every moment format, batched and one shard at a time
(the swap tier's way)."""

from __future__ import annotations

import pytest
import torch

from offloadd import moment_codec
from offloadd.formats import MomentFormat
from trainer.dist.collectives import Collectives
from trainer.offload.backend import UnitSpec
from trainer.offload.daemon_backend import DaemonBackend

NUMEL = 4099
"""Not a multiple of blockwise8's block nor of a page's worth of elements."""


def reference(master: torch.Tensor, spec: UnitSpec, fmt: MomentFormat) -> dict[str, bytes]:
    """The bytes the host-copy registration put (its code, kept here as the reference)."""
    zeros = torch.zeros(spec.part_numel, dtype=torch.float32)
    moment = moment_codec.empty(fmt, spec.part_numel).zero_()
    tensors = {"master": master, "exp_avg": moment, "exp_avg_sq": moment,
               "grad": zeros.to(spec.grad_dtype), "param": master.to(spec.param_dtype)}
    return {kind: tensor.numpy().tobytes() if tensor.dtype != torch.bfloat16
            else tensor.view(torch.int16).numpy().tobytes() for kind, tensor in tensors.items()}


def awkward_master() -> torch.Tensor:
    """Values whose bf16 rounding is not trivial: ties, subnormals, +-0, large ones."""
    generator = torch.Generator().manual_seed(7)
    master = torch.randn(NUMEL, generator=generator) * 3
    master[:8] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38, 1.00390625, 1.01171875,
                               -2.5])
    return master


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "blockwise8"])
@pytest.mark.parametrize("swaps", [False, True])
def test_registered_bytes_match_the_host_copies(connect, fmt: MomentFormat,
                                                swaps: bool) -> None:
    client = connect()
    # A dropped shard full of 0xff bytes leaves its arena range dirty for the next ones.
    client.put("dirt", b"\xff" * (8 * NUMEL * 4))
    client.drop("dirt")
    backend = DaemonBackend(client, collectives=Collectives(), swaps=swaps, moment_format=fmt)
    spec = UnitSpec(index=3, part_numel=NUMEL, param_dtype=torch.bfloat16,
                    grad_dtype=torch.bfloat16)
    master = awkward_master()
    try:
        backend.register(spec, master)
        expected = reference(master, spec, fmt)
        kinds = [kind for kind in expected if not (swaps and kind == "grad")]
        for kind in kinds:
            assert client.get(f"u3.{kind}") == expected[kind], kind
        if swaps:
            assert 3 in backend.steps.dropped_grads
    finally:
        backend.close()


def test_a_frozen_unit_registers_its_param_copy_only(connect) -> None:
    client = connect()
    backend = DaemonBackend(client, collectives=Collectives())
    spec = UnitSpec(index=1, part_numel=NUMEL, param_dtype=torch.bfloat16, trainable=False)
    master = awkward_master()
    try:
        backend.register(spec, master)
        assert client.get("u1.param") == master.to(torch.bfloat16).view(torch.int16) \
            .numpy().tobytes()
        assert client.stats()["num_shards"] == 1
    finally:
        backend.close()
