"""The arena a job asks its daemon for (``trainer.offload.daemon_connect``): the working set
plus slack that never passes the node's DRAM, and a DRAM-tier working set larger than the
node's available memory refused at ``initialize`` with the knobs to change, where the OOM
killer used to take the daemon mid-initialisation (an 8-bit 10B model on a 128 GiB GPU box).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offloadd.formats import moment_nbytes
from trainer.config import parse_config
from trainer.dist.collectives import Collectives
from trainer.offload.daemon_connect import (
    MIB,
    arena_with_slack,
    available_memory_nbytes,
    default_arena_nbytes,
    estimate_rank_nbytes,
)


def _config(device: str, state_dtype: str = "8bit", **top: object) -> object:
    section = {"device": device, "state_dtype": state_dtype}
    if device == "nvme":
        section["nvme_path"] = "/tmp"
    return parse_config({
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "offload_optimizer": section,
                              "offload_param": {"device": "cpu"}}, **top,
    })


def _meta_model(numel: int) -> nn.Module:
    """A model of ``numel`` parameters that allocates nothing (the meta device)."""
    with torch.device("meta"):
        return nn.Linear(numel // 1024, 1024, bias=False)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 42), st.integers(1 << 26, 1 << 42))
def test_the_slack_never_leaves_less_than_a_tenth_of_dram_free(working: int, available: int
                                                                ) -> None:
    arena = arena_with_slack(working, available)
    assert working + 32 * MIB <= arena <= working + working // 4 + 32 * MIB
    if arena > working + 32 * MIB:  # slack given only where a tenth of DRAM stays free
        assert arena <= available * 9 // 10
    if working + working // 4 + 32 * MIB <= available * 9 // 10:
        assert arena == working + working // 4 + 32 * MIB  # the whole quarter where it fits


def test_the_estimate_counts_the_daemons_bytes_per_parameter() -> None:
    """The gradient is counted in the dtype the engine keeps it in: bf16 where the bf16
    reduce-scatter is taken once per step (no accumulation) or ``grad_accum_dtype`` asks
    for bf16 sums, fp32 where micro-batches are summed in fp32."""
    numel = 1 << 20
    model = _meta_model(numel)
    moments = 2 * moment_nbytes("blockwise8", numel)
    # fp32 master, the gradient, the bf16 param, two blockwise-8 moments
    with_bf16_grad = numel * (4 + 2 + 2) + moments  # 10.03 B/param
    with_fp32_grad = numel * (4 + 4 + 2) + moments  # 12.03 B/param
    assert 10.0 < with_bf16_grad / numel < 10.1 and 12.0 < with_fp32_grad / numel < 12.1
    assert estimate_rank_nbytes(model, _config("cpu"), 1) == with_bf16_grad
    summed = {"gradient_accumulation_steps": 4}
    assert estimate_rank_nbytes(model, _config("cpu", **summed), 1) == with_fp32_grad
    in_bf16 = {**summed, "data_types": {"grad_accum_dtype": "bf16"}}
    assert estimate_rank_nbytes(model, _config("cpu", **in_bf16), 1) == with_bf16_grad


def test_a_dram_working_set_past_the_nodes_memory_is_refused_naming_the_knobs() -> None:
    available = available_memory_nbytes()
    too_big = _meta_model(available // 10 + (1 << 30))  # > available at 10.03 B/param
    with pytest.raises(ValueError) as refused:
        default_arena_nbytes(too_big, _config("cpu"), Collectives())
    message = str(refused.value)
    assert "offload_optimizer.device" in message and '"nvme"' in message
    assert "state_dtype" in message and "available" in message
    # The gradient is already bf16 here; summed in fp32 it could be, and the refusal says so.
    assert "grad_accum_dtype" not in message
    with pytest.raises(ValueError, match=r'data_types\.grad_accum_dtype "bf16"'):
        default_arena_nbytes(too_big, _config("cpu", gradient_accumulation_steps=2),
                             Collectives())
    # On the NVMe tier the arena is a cache: the same model gets at most half of DRAM.
    arena = default_arena_nbytes(too_big, _config("nvme"), Collectives())
    noise = available // 100  # MemAvailable moves between the test's read and the engine's
    assert 64 * MIB <= arena <= available // 2 + 2 * MIB + noise


def test_a_working_set_that_fits_gets_its_arena_with_the_slack_cut_to_dram() -> None:
    available = available_memory_nbytes()
    collectives = Collectives()
    small = _meta_model(1 << 20)
    working = estimate_rank_nbytes(small, _config("cpu"), 1)
    arena = default_arena_nbytes(small, _config("cpu"), collectives)
    assert arena >= working + working // 4 + 32 * MIB  # the whole quarter: DRAM has it
    # 85% of DRAM: the working set fits, a quarter more would not, the slack is cut
    near = _meta_model(int(available * 0.85) // 10)  # 10.03 B/param
    working = estimate_rank_nbytes(near, _config("cpu"), 1)
    arena = default_arena_nbytes(near, _config("cpu"), collectives)
    noise = available // 100  # MemAvailable moves between the test's read and the engine's
    assert working < arena <= max(working + 32 * MIB, available * 9 // 10) + noise
    assert arena < working + working // 4
