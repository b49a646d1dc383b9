"""Which device a rank computes on and which process-group backend goes with it.

DeepSpeed's behaviour: ``cuda:{LOCAL_RANK}`` with NCCL when CUDA is available,
CPU with gloo otherwise; config ``"device": "cpu"`` forces CPU even on a GPU
host, ``"device": "cuda"`` makes a missing GPU an error instead of a silent
CPU run. NCCL cannot carry Python objects on CPU tensors cheaply and barriers
on it need a device, so object collectives and barriers use a gloo side group
(``side_group``) created once on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from trainer.device import twin_memory
from trainer.device.copy_engine import COPY_ENGINE_ENV, CopyEngineUnavailableError, require_cuda
from trainer.device.twin import TWIN_DEVICE_ENV, TWIN_TYPE, twin_device, twin_device_mode

log = logging.getLogger("trainer.device")

DeviceChoice = Literal["auto", "cpu", "cuda"]


@dataclass(kw_only=True, frozen=True)
class ComputeDevice:
    """Where one rank computes."""

    device: torch.device
    """The module, flat buffers, gathered params and reduced grads live here."""
    dist_backend: Literal["nccl", "gloo"]
    """Backend of the data-parallel process group."""
    reason: str
    """Why this device was picked (logged once)."""


def resolve_device(choice: DeviceChoice = "auto", *,
                   local_rank: int | None = None) -> ComputeDevice:
    """The compute device for ``choice`` (config key ``device``)."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f'device must be "auto", "cpu" or "cuda", got {choice!r}')
    if choice == "cpu":
        return _cpu_compute('config "device": "cpu"')
    try:
        require_cuda()
    except CopyEngineUnavailableError as error:
        if choice == "cuda":
            raise CopyEngineUnavailableError(f'config "device": "cuda" but {error}') from error
        return _cpu_compute(f"no CUDA: {error}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"LOCAL_RANK={local_rank} but this host has {count} visible GPUs; "
                         "launch at most one rank per GPU (torchrun --nproc-per-node)")
    return ComputeDevice(device=torch.device("cuda", local_rank), dist_backend="nccl",
                         reason=f"CUDA available ({count} GPUs)")


def _cpu_compute(reason: str) -> ComputeDevice:
    """CPU compute; on the strict twin (``OFFLOADD_COPY_ENGINE=twin`` with
    ``OFFLOADD_TWIN_DEVICE=strict``) its tensors live on the twin's device ``twin:0``."""
    if os.environ.get(COPY_ENGINE_ENV) == "twin" and twin_device_mode() == "strict":
        return ComputeDevice(device=twin_device(), dist_backend="gloo",
                             reason=f"{reason}; strict device twin ({TWIN_DEVICE_ENV}=strict)")
    return ComputeDevice(device=torch.device("cpu"), dist_backend="gloo", reason=reason)


def free_memory_nbytes(device: torch.device) -> int | None:
    """Bytes free on a compute device of bounded memory: a GPU (``mem_get_info``) or the
    strict twin given a capacity (``OFFLOADD_TWIN_MEMORY``); None for the host."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == TWIN_TYPE and twin_memory.memory().capacity_nbytes is not None:
        return twin_memory.mem_get_info()[0]
    return None


@dataclass(kw_only=True, frozen=True)
class DeviceMemory:
    """A bounded compute device's memory now, as the caching allocator counts it."""

    allocated: int
    """Bytes held by live tensors."""
    peak: int
    """The most ``allocated`` has been since the process started or the peak was last
    reset (``torch.cuda.max_memory_allocated``)."""
    capacity: int
    """What the process's tensors could hold: its allocator's cache plus what the
    driver has free (the twin: its capacity)."""


def device_memory(device: torch.device) -> DeviceMemory | None:
    """``DeviceMemory`` of a GPU or of the strict twin given a capacity; None for the
    host, whose memory no device budget is kept for."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return DeviceMemory(allocated=torch.cuda.memory_allocated(device),
                            peak=torch.cuda.max_memory_allocated(device),
                            capacity=torch.cuda.memory_reserved(device) + int(free))
    capacity = twin_memory.memory().capacity_nbytes
    if device.type == TWIN_TYPE and capacity is not None:
        return DeviceMemory(allocated=twin_memory.memory_allocated(),
                            peak=twin_memory.max_memory_allocated(), capacity=capacity)
    return None


def activate(compute: ComputeDevice) -> None:
    """Make ``compute`` the current device (NCCL maps a rank to its GPU through it)."""
    if compute.device.type == "cuda":
        torch.cuda.set_device(compute.device)
    log.info("computing on %s with %s (%s)", compute.device, compute.dist_backend,
             compute.reason)


_side_groups: dict[int, Any] = {}


def side_group() -> Any:
    """A gloo group over the whole world for object collectives and barriers.

    ``None`` (the default group) when the default group already is gloo. Every rank
    must call this the first time in the same order (``new_group`` is collective)."""
    if not dist.is_initialized() or dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _side_groups:
        _side_groups[key] = dist.new_group(backend="gloo")
    return _side_groups[key]
