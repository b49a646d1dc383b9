"""``deepspeed.accelerator.get_accelerator()`` and ``deepspeed.runtime.utils.see_memory_usage``
as scripts written for DeepSpeed call them (DeepSpeed-Chat's ``main.py``:
``get_accelerator().set_device(local_rank)``, ``device_name()``, ``manual_seed_all(seed)``,
``empty_cache()``; memory prints between phases).

The device is the rank's compute device (``trainer.device.compute.resolve_device``): a GPU,
the CPU, or the strict twin's device (one per process). Memory figures come from CUDA where
the device is a GPU; elsewhere there is no device memory to count (0).
"""

from __future__ import annotations

import logging

import torch

from trainer.device.compute import resolve_device
from trainer.dist.distributed import default_backend

logger = logging.getLogger("offloadd.deepspeed")


class Accelerator:
    """``deepspeed.accelerator.get_accelerator()``: the rank's compute device."""

    def _on_cuda(self) -> bool:
        return self.current_device().type == "cuda"

    def current_device(self) -> torch.device:
        return resolve_device("auto").device

    def current_device_name(self) -> str:
        return str(self.current_device())

    def device_name(self, device_index: int | None = None) -> str:
        """DeepSpeed's: the device type, or with an index (a local rank) that device,
        ``cuda:<index>``. A device of one per process (the strict twin's) or the CPU has no
        other index: its own name."""
        current = self.current_device()
        if device_index is None:
            return current.type
        return f"cuda:{device_index}" if current.type == "cuda" else str(current)

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        """A GPU rank's device; the CPU and the twin have one device per process."""
        if self._on_cuda():
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._on_cuda() else 1

    def is_available(self) -> bool:
        return True

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._on_cuda() else True

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._on_cuda():
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._on_cuda():
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds every CUDA device too, where there are any

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._on_cuda() else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._on_cuda() else 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._on_cuda() else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._on_cuda():
            torch.cuda.reset_peak_memory_stats(device_index)

    def communication_backend_name(self) -> str:
        return default_backend()


def get_accelerator() -> Accelerator:
    return Accelerator()


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's: with ``force``, rank 0 logs ``message``, the device memory allocated, its
    peak and reserved (GiB), and the host memory in use (``/proc/meminfo``); then the peak
    is reset. Without ``force``, nothing (as DeepSpeed)."""
    if not force:
        return
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    accelerator = get_accelerator()
    gib = float(1 << 30)
    logger.info("%s | MA %.2f GB Max_MA %.2f GB CA %.2f GB | host used %.2f GB", message,
                accelerator.memory_allocated() / gib, accelerator.max_memory_allocated() / gib,
                accelerator.memory_reserved() / gib, _host_used_nbytes() / gib)
    accelerator.reset_peak_memory_stats()


def _host_used_nbytes() -> int:
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return fields.get("MemTotal", 0) - fields.get("MemAvailable", 0)
