"""2-rank gloo parity: ZeRO stages 0-3 x offload none/cpu/nvme against torch.optim.AdamW.

Each offload device is one process launch running every case in sequence
(spawn + init is the expensive part). With offload the ranks talk to a real
daemon process: one shared ``PrivateDaemon`` started by rank 0 for most
cases (each case its own job), and the engine's embedded default (local rank
0 starts a private daemon) for one case per device.
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import Any

import pytest
import torch
from _dist import (
    base_config,
    engine_train,
    max_relative_error,
    reference_train,
    run_ranks,
    shared_daemon,
    zero_section,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

STEPS = 10
WORLD = 2
HAS_NVME_TIER = importlib.util.find_spec("offloadd.swap.nvme") is not None


def parity_cases(device: str) -> list[dict[str, Any]]:
    cases = []
    for stage in (0, 1, 2, 3):
        cases.append(base_config(zero_optimization=zero_section(stage, device)))
        cases.append(base_config(zero_optimization=zero_section(stage, device),
                                 gradient_accumulation_steps=2, gradient_clipping=0.3))
    # Stage 3 freeing every unit after its forward: backward re-gathers with prefetch.
    regather = {**zero_section(3, device), "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": 1000}
    cases.append(base_config(zero_optimization=regather, gradient_accumulation_steps=2))
    return cases


def run_cases(rank: int, world: int, cases: list[dict[str, Any]], device: str,
              embedded_case: int) -> list[Any]:
    """Rank body: every case in order; offloaded cases use the shared daemon but one."""
    swap_dir = tempfile.mkdtemp(prefix="offloadd-swap-") if device == "nvme" else None
    results = []
    with shared_daemon(rank, swap_dir, enabled=device != "none") as socket_path:
        for index, config in enumerate(cases):
            config = dict(config)
            if device == "nvme":
                for key in ("offload_optimizer", "offload_param"):
                    if key in config["zero_optimization"]:
                        config["zero_optimization"][key]["nvme_path"] = swap_dir
            if device != "none" and index != embedded_case:
                config["offloadd"] = {"socket": socket_path, "job": f"case{index}",
                                      "arena_size": 16 << 20}
            steps = config.pop("_steps", STEPS)
            results.append(engine_train(rank, world, config, steps, cycle=config.pop("_cycle", 0)))
    return results


def _check_parity(device: str, extra: list[dict[str, Any]] | None = None) -> list[Any]:
    cases = parity_cases(device)
    results = run_ranks(run_cases, WORLD, cases + (extra or []), device, 1)[0]
    for config, (state, _losses) in zip(cases, results, strict=False):
        reference = reference_train(config, STEPS, WORLD)
        error = max_relative_error(state, reference)
        assert error < 1e-5, (device, config["zero_optimization"], error)
    return results[len(cases):]


def bf16_cases(device: str) -> list[dict[str, Any]]:
    """fp32 then bf16 stage 3 on a repeated batch: the loss must fall and track fp32."""
    fp32 = base_config(zero_optimization=zero_section(3, device), _steps=20, _cycle=1)
    bf16 = base_config(zero_optimization=zero_section(3, device), _steps=20, _cycle=1,
                       bf16={"enabled": True})
    return [fp32, bf16]


def _check_bf16(results: list[Any]) -> None:
    (_, fp32_losses), (_, bf16_losses) = results
    assert bf16_losses[-1] < 0.7 * bf16_losses[0]
    for ours, reference in zip(bf16_losses, fp32_losses, strict=True):
        assert abs(ours - reference) <= 0.05 * abs(reference) + 0.02


def test_parity_offload_none() -> None:
    _check_bf16(_check_parity("none", bf16_cases("none")))


def test_parity_offload_cpu_daemon() -> None:
    _check_bf16(_check_parity("cpu", bf16_cases("cpu")))


@pytest.mark.skipif(not HAS_NVME_TIER, reason="the daemon's NVMe tier (offloadd.swap.nvme) "
                    "is not in this tree yet")
def test_parity_offload_nvme_daemon() -> None:
    _check_parity("nvme")


def test_reference_is_deterministic() -> None:
    config = base_config()
    first = reference_train(config, 2, WORLD)
    second = reference_train(config, 2, WORLD)
    assert all(torch.equal(first[name], second[name]) for name in first)
