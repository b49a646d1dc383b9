"""Debug leases: catch a view of a shard used after its lease was given back.

``lease.tensor()``, ``lease.numpy()`` and ``lease.view`` are views of the job's
shared arena, valid only while the lease is held: after ``release()`` the daemon
may evict the shard and place another one at the same offset, so a kept view
silently reads (or writes!) another shard's bytes. Nothing in the view itself can
tell; so in debug mode each client records which arena ranges its live leases
cover, and ``check_view`` (called by the engine on every access to leased memory)
raises ``StaleLeaseError`` for a view of this process's arena that no live lease
covers. Outside debug mode ``check_view`` is one global read.

Turn it on with ``OFFLOADD_DEBUG_LEASES=1`` in the environment of the ranks (the
test suite does, in ``tests/conftest.py``) or ``enable(True)`` before connecting.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np
import torch

ENV_VAR = "OFFLOADD_DEBUG_LEASES"
_enabled = os.environ.get(ENV_VAR, "") not in ("", "0")
_registries: weakref.WeakSet[LeaseRanges] = weakref.WeakSet()


class StaleLeaseError(RuntimeError):
    """A view of a leased shard was used after the lease was released."""


def enabled() -> bool:
    return _enabled


def enable(on: bool) -> None:
    """Debug leases for clients connected from now on (default: ``$OFFLOADD_DEBUG_LEASES``)."""
    global _enabled
    _enabled = on


class LeaseRanges:
    """The arena ranges one client's live leases cover, by arena offset."""

    def __init__(self, arena_view: memoryview) -> None:
        self.nbytes = arena_view.nbytes
        self.base = _address(arena_view) if self.nbytes else 0
        self.live: dict[int, list[Any]] = {}
        """offset -> [nbytes, holds, shard id] of each shard leased now."""
        self.released: dict[int, str] = {}
        """offset -> shard id of the last lease given back there (for the error message)."""
        _registries.add(self)

    def hold(self, offset: int, nbytes: int, shard_id: str) -> None:
        entry = self.live.get(offset)
        if entry is None:
            self.live[offset] = [nbytes, 1, shard_id]
        else:
            entry[1] += 1

    def give_back(self, offset: int) -> None:
        entry = self.live.get(offset)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[offset]
            self.released[offset] = entry[2]

    def close(self) -> None:
        """The client closed: its mapping may go and its addresses be reused elsewhere."""
        self.live.clear()
        _registries.discard(self)

    def check(self, address: int, nbytes: int) -> None:
        offset = address - self.base
        if not 0 <= offset < self.nbytes:
            return
        for start, (size, _holds, _shard_id) in self.live.items():
            if start <= offset and offset + nbytes <= start + max(size, 1):
                return
        stale = [shard_id for start, shard_id in self.released.items() if start <= offset]
        name = repr(stale[-1]) if stale else "a shard"
        raise StaleLeaseError(
            f"a view of {name} (arena offset {offset}, {nbytes} bytes) was used after its "
            "lease was released; keep the lease until the last use of its tensor, or copy "
            "the tensor out (.clone()) before releasing")


def _address(buffer: Any) -> int:
    if isinstance(buffer, torch.Tensor):
        return int(buffer.data_ptr())
    if isinstance(buffer, np.ndarray):
        return int(buffer.__array_interface__["data"][0])
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def check_view(buffer: torch.Tensor | np.ndarray | memoryview) -> None:
    """Raise StaleLeaseError if ``buffer`` views arena memory no live lease covers."""
    if not _enabled:
        return
    nbytes = buffer.nbytes if not isinstance(buffer, torch.Tensor) else (
        buffer.numel() * buffer.element_size())
    if nbytes == 0:
        return
    address = _address(buffer)
    for ranges in list(_registries):
        ranges.check(address, nbytes)
