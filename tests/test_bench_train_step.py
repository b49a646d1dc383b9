"""``bench/gpu_train_step.py`` at a CPU size on the twin copy engine: the big case's sizing
(``--gpt auto``), activation recomputation and compact moments train under our engine
beside the no-offload ceiling and beside ours waiting for the global norm (speculative
steps off), and the figures it prints agree with each other."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_train_step.py"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_train_step  # noqa: E402

from trainer.offload.daemon_connect import arena_with_slack, trainable_nbytes  # noqa: E402

pytestmark = pytest.mark.slow


def test_size_big_takes_the_smallest_moment_format_the_host_holds() -> None:
    gib = 1 << 30
    # The bytes per parameter are the engine's own arena estimate for bf16 training.
    per_param = gpu_train_step.host_bytes_per_param
    assert per_param("8bit", "fp32") == pytest.approx(
        trainable_nbytes(10**6, "blockwise8", 2, grad_itemsize=4) / 10**6, rel=1e-5)
    assert per_param("8bit", "bf16") == pytest.approx(
        trainable_nbytes(10**6, "blockwise8", 2, grad_itemsize=2) / 10**6, rel=1e-5)
    assert 10.0 < per_param("8bit", "bf16") < 10.1 < 12.0 < per_param("8bit", "fp32") < 12.1

    def size(device: float, host: float, grad_accum_dtype: str = "bf16"
             ) -> tuple[str, str, int]:
        return gpu_train_step.size_big(int(device), int(host), 10e9, 32000, 5120,
                                       grad_accum_dtype=grad_accum_dtype)

    # A 512 GiB host holds 10B (twice 80 GB at 16 B/param) with fp32 moments (16 B/param
    # with bf16 sums), at least the target, within a layer.
    _, state_dtype, params = size(80e9, 512 * gib)
    assert state_dtype == "fp32" and 10e9 <= params < 10e9 + 12 * 5120**2
    # The workplace's GPU box: 3/4 of 128 GiB is 103 GB. With gradients summed in bf16, 10B
    # in 8-bit moments (10.03 B/param) fits it: the target, past the GPU's 80 GB at 16
    # B/param, with the arena the engine asks for (with its slack) within the host.
    gpt, state_dtype, params = gpt_train = size(80e9, 128 * gib)
    assert state_dtype == "8bit" and params >= 10e9, gpt_train
    working_set = params * per_param("8bit", "bf16")
    assert working_set <= 0.75 * 128 * gib
    assert params * gpu_train_step.DEVICE_BYTES_PER_PARAM > 1.5 * 80 * 10**9
    assert arena_with_slack(int(working_set), 120 * 10**9) < 128 * gib
    # Summed in fp32 (12.03 B/param), the same box holds less than 10B: the largest model
    # it holds, within a layer of its 3/4.
    _, state_dtype, params = size(80e9, 128 * gib, "fp32")
    assert state_dtype == "8bit" and params < 10e9
    assert 0.95 < params * per_param("8bit", "fp32") / (0.75 * 128 * gib) <= 1
    # A host too small for the target: the largest model it holds in 8-bit moments.
    _, state_dtype, params = size(80e9, 64 * gib)
    assert state_dtype == "8bit"
    assert 0.9 < params * per_param("8bit", "bf16") / (0.75 * 64 * gib) <= 1
    # A bigger GPU asks for twice its capacity.
    _, _, params = size(141e9, 1024 * gib)
    assert params >= 2 * 141e9 / gpu_train_step.DEVICE_BYTES_PER_PARAM
    width, depth, heads = (int(part) for part in gpt.split(","))
    assert width == 5120 and heads == 40 and depth >= 1


def _run_big_case(tmp_path: Path, target_params: int, extra_env: dict[str, str],
                  *extra_args: str) -> dict:
    """``--gpt auto`` at a CPU size on the twin copy engine (params + optimizer offloaded
    to DRAM, recomputation, 2 x 2 micro-batches of 32 tokens); its JSON line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OFFLOADD_COPY_ENGINE": "twin",
           "OMP_NUM_THREADS": "1", **extra_env}
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--gpt", "auto",
               "--target-params", str(target_params), "--big-width", "64", "--vocab", "512",
               "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--steps", "2",
               "--warmup", "1", "--activation-checkpointing", "--offload-param", "cpu",
               "--offload-optimizer", "cpu", "--swap-dir", str(tmp_path), *extra_args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cpu_big_case_with_recomputation_and_the_ceiling(tmp_path: Path) -> None:
    result = _run_big_case(tmp_path, 300000, {}, "--state-dtype", "bf16",
                           "--contenders", "ours,ours-wait,none")
    width, depth, heads = (int(part) for part in result["gpt"].split(","))
    # the least depth that reaches the target
    assert (width, heads) == (64, 1)
    assert depth == math.ceil((300000 - 512 * 64) / (12 * 64 * 64))
    assert result["tier"]["state_dtype"] == "bf16" and result["activation_checkpointing"]
    # the big case sums gradients in bf16 (data_types.grad_accum_dtype), as sized
    assert result["tier"]["grad_accum_dtype"] == "bf16" and result["grad_dtype"] == "bfloat16"
    assert result["tokens_per_step"] == 2 * 32 * 2
    assert result["step_s_median"] == statistics.median(result["step_s"])
    per_token = gpu_train_step.model_flops_per_token(result["num_params"], depth, width, 32)
    assert result["model_tflops"] == pytest.approx(
        per_token * result["tokens_per_step"] / result["step_s_median"] / 1e12)
    assert result["ratio_vs_no_offload"] == pytest.approx(
        result["no_offload_step_s_median"] / result["step_s_median"], abs=1e-3)
    assert result["adam_s_per_step"] > 0 and result["peak_host_rss_bytes"] > 0
    # Clipping is on: ours started steps before the norm; ours-wait is the same run without.
    assert result["speculated_units"] > 0
    assert result["ratio_vs_waiting_for_norm"] == pytest.approx(
        result["waiting_for_norm_step_s_median"] / result["step_s_median"], abs=1e-3)


def test_cpu_big_case_outgrows_the_capped_twin_device(tmp_path: Path) -> None:
    """On the strict twin with a device capacity (``OFFLOADD_TWIN_MEMORY``), ``--gpt auto``
    sizes the model at twice what the device holds without offload: the ceiling (plain
    torch) runs out of device memory, as on a GPU, while ours trains within the capacity,
    built under zero.Init."""
    capacity = 2 << 20
    result = _run_big_case(tmp_path, 1000, {"OFFLOADD_TWIN_DEVICE": "strict",
                                            "OFFLOADD_TWIN_MEMORY": str(capacity)},
                           "--contenders", "ours,none")
    assert result["zero_init"] and result["device_capacity_bytes"] == capacity
    # twice the device's no-offload capacity at 16 B/param
    assert result["num_params"] >= 0.95 * 2 * capacity / gpu_train_step.DEVICE_BYTES_PER_PARAM
    assert 0 < result["peak_device_bytes"] <= capacity
    # The estimate (trainer.zero.estimate) beside the peak, activations not in it: the
    # model states of the case sized for this device fit it by the engine's own figure.
    assert 0 < result["estimated_device_bytes"] <= capacity
    assert "OFFLOADD_TWIN_MEMORY" in result["no_offload_oom"]
    assert result["ratio_vs_no_offload"] is None
    # bf16 parameters: every one comes to the device at least once a step, and every
    # gradient leaves it at least once a step
    assert result["h2d_bytes_per_step"] >= 2 * result["num_params"]
    assert result["d2h_bytes_per_step"] >= 2 * result["num_params"]
    # Units held from the first micro-batch to the second (--max-live-params auto: 3/10 of
    # the capacity) are not gathered again: fewer than one gather per unit per micro-batch.
    assert result["max_live_params"] == capacity * 3 // 20
    assert 1 <= result["gathers_per_unit_per_step"] < 2


def test_units_are_gathered_once_a_step_however_far_their_backward(tmp_path: Path) -> None:
    """The H200's 9.92B big case gathered each unit 4.6 times a step: every unit but the
    last few was further from its backward than DeepSpeed's default reuse distance, so it
    was freed after its forward though ``--max-live-params auto`` held the whole model. A
    distance of 0 makes the twin's small model look the same; with room in the live
    budget each unit is still gathered once a step, and the H2D bytes are the bf16
    parameters once."""
    capacity = 8 << 20
    result = _run_big_case(tmp_path, 1000, {"OFFLOADD_TWIN_DEVICE": "strict",
                                            "OFFLOADD_TWIN_MEMORY": str(capacity)},
                           "--contenders", "ours", "--max-reuse-distance", "0")
    assert result["max_reuse_distance"] == 0
    assert result["max_live_params"] == capacity * 3 // 20 > result["num_params"]
    assert result["gathers_per_unit_per_step"] == 1.0
    assert result["h2d_bytes_per_step"] == 2 * result["num_params"]


def test_a_peer_past_its_time_is_killed_and_reported(tmp_path: Path) -> None:
    """``--peer-timeout``: a peer that does not finish in time (here the ceiling, given
    less than its start-up) is killed with what it started, and the time-out is the result
    the JSON reports, while ours' figures stand."""
    result = _run_big_case(tmp_path, 1000, {}, "--contenders", "ours,none",
                           "--peer-timeout", "0.5")
    assert result["step_s_median"] > 0
    assert result["no_offload_step_s_median"] is None and result["ratio_vs_no_offload"] is None
    assert any(note.startswith("none: none timed out after 0.5 s") for note in result["notes"])
    leftovers = subprocess.run(["pgrep", "-f", "--contender none"], capture_output=True,
                               text=True, check=False)
    assert leftovers.stdout.strip() == ""
