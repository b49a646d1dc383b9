"""Compute-device choice: cuda:LOCAL_RANK + NCCL when CUDA is there, else CPU + gloo."""

from __future__ import annotations

import pytest
import torch

from trainer.config import parse_config
from trainer.device.compute import resolve_device
from trainer.device.copy_engine import CopyEngineUnavailableError
from trainer.device.twin import twin_device


def test_device_cpu_forces_cpu_and_gloo(monkeypatch) -> None:
    monkeypatch.setenv("OFFLOADD_TWIN_DEVICE", "host")
    compute = resolve_device("cpu")
    assert compute.device == torch.device("cpu") and compute.dist_backend == "gloo"


def test_cpu_compute_on_the_strict_twin_is_its_device(monkeypatch) -> None:
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    monkeypatch.setenv("OFFLOADD_TWIN_DEVICE", "strict")
    compute = resolve_device("cpu")
    assert compute.device == twin_device() and compute.dist_backend == "gloo"
    assert "OFFLOADD_TWIN_DEVICE=strict" in compute.reason
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "inline")  # the device twin goes with the twin
    assert resolve_device("cpu").device == torch.device("cpu")
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    monkeypatch.setenv("OFFLOADD_TWIN_DEVICE", "gpu")
    with pytest.raises(ValueError, match="OFFLOADD_TWIN_DEVICE='gpu': expected one of"):
        resolve_device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_auto_without_cuda_falls_back_to_cpu_and_says_why(monkeypatch) -> None:
    monkeypatch.setenv("OFFLOADD_TWIN_DEVICE", "host")
    compute = resolve_device("auto")
    assert compute.device.type == "cpu" and compute.dist_backend == "gloo"
    assert "no CUDA" in compute.reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_device_cuda_without_cuda_is_a_typed_error_naming_the_fix() -> None:
    with pytest.raises(CopyEngineUnavailableError, match='"device": "cpu"'):
        resolve_device("cuda")


def test_config_device_key_is_validated() -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    assert parse_config({**base, "device": "cpu"}).device == "cpu"
    assert parse_config(base).device == "auto"
    with pytest.raises(ValueError, match="device"):
        parse_config({**base, "device": "gpu"})
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")  # type: ignore[arg-type]
