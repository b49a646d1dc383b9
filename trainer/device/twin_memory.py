"""The strict twin's device memory: a capacity, an allocated count and a peak, as CUDA's.

A GPU has a fixed memory; a model whose training state does not fit fails there with
``torch.OutOfMemoryError`` where a CPU run goes on. So the twin counts the bytes of every
storage behind its device tensors and refuses, with an error of that type, an allocation
that would take them past ``$OFFLOADD_TWIN_MEMORY`` (bytes, or ``512MiB``, ``8GiB``...;
unset: no limit, still counted). ``memory_allocated``, ``max_memory_allocated``,
``reset_peak_memory_stats`` and ``mem_get_info`` answer as ``torch.cuda``'s do.

How it counts: each storage is recorded once (by its StorageImpl, so views and aliases
share one record) with a weak reference, so a storage that autograd keeps for backward
after every Python tensor over it is gone still counts, as it does on a GPU; a storage
resized in place (``UntypedStorage.resize_``, how ZeRO-3 frees a gathered buffer) is
re-counted by that call. Frees are not announced, so the running figure is an upper
bound; it is made exact (dead storages dropped, sizes re-read) whenever it would cross
the capacity or the recorded peak, so both refusals and the peak are exact.

Hazard (what it cannot see): temporaries that live and die inside one C++ kernel or
backward node never reach Python; CUDA's caching allocator would hold them (and its
fragmentation) on top. The figures are a floor of what a GPU would need.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import torch

TWIN_MEMORY_ENV = "OFFLOADD_TWIN_MEMORY"
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SWEEP_MIN_RECORDS = 256
"""Dead records are swept once there are this many more records than live storages."""


class TwinOutOfMemoryError(torch.OutOfMemoryError):
    """The twin's device memory is full (caught by ``except torch.OutOfMemoryError``)."""


def parse_nbytes(text: str, *, knob: str = TWIN_MEMORY_ENV) -> int:
    """``"512MiB"`` -> 536870912; plain digits are bytes. (Not ``offloadd.config``'s
    ``parse_size``: the client side imports only the daemon's protocol and errors.)"""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{knob}={text!r}: expected a size such as 536870912, 512MiB or 8GiB")
    nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{knob}={text!r}: the twin's device memory must be > 0 bytes")
    return nbytes


def capacity_from_env() -> int | None:
    text = os.environ.get(TWIN_MEMORY_ENV, "").strip()
    return parse_nbytes(text) if text else None


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


class TwinMemory:
    """The twin device's byte count (one per process, as the twin has one device)."""

    def __init__(self, capacity_nbytes: int | None = None) -> None:
        self.capacity_nbytes = capacity_nbytes
        """None: unlimited (bytes are still counted)."""
        self.peak_nbytes = 0
        """Most bytes allocated at once since the last reset (exact)."""
        self._records: dict[int, list[int]] = {}
        """StorageImpl address -> [weak reference, bytes counted for it]."""
        self._upper_nbytes = 0
        """Sum of the counted bytes: >= the live bytes (frees are found by ``_settle``)."""
        self._live_records = 0
        self._lock = threading.Lock()

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once per storage); over capacity: OOM, not counted."""
        with torch._C.DisableTorchFunctionSubclass():  # a device tensor's own dispatch is slow
            if tensor.is_meta:
                return
            storage = tensor.untyped_storage()
        key = storage._cdata
        with self._lock:
            record = self._records.get(key)
            if record is not None and not torch.UntypedStorage._expired(record[0]):
                return
            if record is not None:  # a dead storage's address was reused
                self._forget(key)
            nbytes = storage.nbytes()
            self._records[key] = [int(storage._weak_ref()), nbytes]  # type: ignore[call-overload]
            self._upper_nbytes += nbytes
            try:
                self._bound(0, nbytes)
            except TwinOutOfMemoryError:
                self._forget(key)
                raise

    def resize(self, storage: torch.UntypedStorage, nbytes: int, resize: Any) -> Any:
        """``storage.resize_(nbytes)`` (by ``resize``), refused as CUDA would if it grows
        a device storage past the capacity."""
        key = storage._cdata
        with self._lock:
            record = self._records.get(key)
            if record is None or torch.UntypedStorage._expired(record[0]):
                return resize(storage, nbytes)
            grown = max(0, nbytes - storage.nbytes())
            self._bound(grown, grown)
            result = resize(storage, nbytes)
            self._upper_nbytes += nbytes - record[1]
            record[1] = nbytes
            return result

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is live device memory (whatever its Python type)."""
        with torch._C.DisableTorchFunctionSubclass():
            if tensor.is_meta:
                return False
            key = tensor.untyped_storage()._cdata
        with self._lock:
            record = self._records.get(key)
            return record is not None and not torch.UntypedStorage._expired(record[0])

    def allocated(self) -> int:
        """The bytes of live device storages now (exact)."""
        with self._lock:
            return self._settle()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_nbytes = self._settle()

    def _bound(self, pending: int, tried: int) -> None:
        """Before ``pending`` more bytes are counted (a growing resize; 0: they already
        are, a new storage of ``tried`` bytes): settle when the upper bound crosses the
        peak or the capacity, and refuse past the capacity."""
        upper = self._upper_nbytes + pending
        over_capacity = self.capacity_nbytes is not None and upper > self.capacity_nbytes
        sweep_due = len(self._records) > 2 * self._live_records + _SWEEP_MIN_RECORDS
        if not (over_capacity or sweep_due or upper > self.peak_nbytes):
            return
        live = self._settle() + pending
        if self.capacity_nbytes is not None and live > self.capacity_nbytes:
            raise TwinOutOfMemoryError(
                f"twin out of memory. Tried to allocate {_human(tried)}. The twin device has a "
                f"total capacity of {_human(self.capacity_nbytes)} ({TWIN_MEMORY_ENV}), of "
                f"which {_human(live - tried)} is allocated by tensors. "
                "Offload more (offload_param, offload_optimizer), recompute activations, or "
                "use a smaller micro-batch, as on a GPU of this size")
        self.peak_nbytes = max(self.peak_nbytes, live)

    def _settle(self) -> int:
        """Drop dead storages and re-read live sizes: the upper bound becomes exact."""
        live_nbytes = 0
        for key, record in list(self._records.items()):
            storage = torch.UntypedStorage._new_with_weak_ptr(record[0])
            if storage is None:
                self._forget(key)
                continue
            record[1] = storage.nbytes()
            live_nbytes += record[1]
        self._upper_nbytes = live_nbytes
        self._live_records = len(self._records)
        return live_nbytes

    def _forget(self, key: int) -> None:
        weak, nbytes = self._records.pop(key)
        self._upper_nbytes -= nbytes
        torch.UntypedStorage._free_weak_ref(weak)


_memory = TwinMemory()
_original_resize = torch.UntypedStorage.resize_


def memory() -> TwinMemory:
    return _memory


def install() -> None:
    """Take the capacity from the environment and watch in-place storage resizes (the
    twin's ``install`` calls this once)."""
    _memory.capacity_nbytes = capacity_from_env()

    def resize_(self: torch.UntypedStorage, nbytes: int) -> Any:
        return _memory.resize(self, nbytes, _original_resize)

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]


def memory_allocated() -> int:
    """Bytes held by the twin's device tensors now (``torch.cuda.memory_allocated``)."""
    return _memory.allocated()


def max_memory_allocated() -> int:
    """Peak of ``memory_allocated`` since the last reset (``torch.cuda``'s name)."""
    return _memory.peak_nbytes


def reset_peak_memory_stats() -> None:
    _memory.reset_peak()


def mem_get_info() -> tuple[int, int]:
    """``(free, total)`` bytes, as ``torch.cuda.mem_get_info``; unlimited: total is what the
    host has."""
    total = _memory.capacity_nbytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, total - memory_allocated()), total
