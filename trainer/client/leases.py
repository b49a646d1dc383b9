"""Leases on shards, as both clients hand them out: plain views of the shared arena.

A lease gives itself back through its owner (the client that took it): ``_release`` on
``with`` exit and ``release()``, ``_release_async`` on ``async with`` exit. Imports only
:mod:`trainer.client.wire` of the client package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from trainer.client.wire import TAG_TORCH_DTYPES


class ReleasedLeaseError(RuntimeError):
    """A lease's memory was used after the lease was released."""


class ShardLease:
    """A lease on one shard: ``view`` is the shard's bytes in the shared arena (no copy).

    ``view``, ``tensor()`` and ``numpy()`` are valid only while the lease is held: after
    ``release()`` the daemon may place another shard at the same bytes. Clone what must
    outlive the lease. ``trainer.lease_debug`` (``OFFLOADD_DEBUG_LEASES=1``) catches a view
    used after its release wherever the engine calls ``check_view``.
    """

    __slots__ = ("_owner", "_view", "dtype", "group", "mode", "nbytes", "offset", "shard_id",
                 "version")

    def __init__(self, owner: Any, shard_id: str, mode: str, offset: int, nbytes: int,
                 version: int, dtype: str, view: memoryview) -> None:
        self._owner = owner
        self.shard_id, self.mode, self.offset = shard_id, mode, offset
        self.nbytes, self.version, self.dtype = nbytes, version, dtype
        self._view: memoryview | None = view
        self.group: LeaseGroup | None = None
        """The batch this lease was taken in (``acquire_many``); None for ``acquire``."""

    @property
    def released(self) -> bool:
        """Given back, or its client closed (the daemon dropped the lease with the session)."""
        return self._view is None or self._owner.closed

    @property
    def view(self) -> memoryview:
        if self._view is None or self._owner.closed:
            raise ReleasedLeaseError(f"lease on {self.shard_id!r} was released; acquire it again")
        return self._view

    def tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 1-D tensor viewing the shard's arena bytes (default dtype: the shard's tag)."""
        target = dtype or TAG_TORCH_DTYPES.get(self.dtype, torch.uint8)
        if self.nbytes % target.itemsize:
            raise ValueError(f"{self.nbytes} bytes is not a whole number of {target} elements")
        if self.nbytes == 0:
            return torch.empty(0, dtype=target)
        return torch.frombuffer(self.view, dtype=target)

    def numpy(self, dtype: Any = np.uint8) -> np.ndarray:
        return np.frombuffer(self.view, dtype=dtype)

    def _forget(self) -> None:
        if self._view is not None and self._owner.lease_ranges is not None:
            self._owner.lease_ranges.give_back(self.offset)
        self._view = None

    def release(self, dirty: bool | None = None) -> None:
        """Give the lease back; a write lease is committed (dirty) unless told otherwise."""
        if self._view is None or self._owner.closed:  # released
            return
        self._owner._release([self], self.mode == "w" if dirty is None else dirty)

    def __enter__(self) -> ShardLease:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A write lease left by an exception publishes nothing: the daemon marks
        # the shard torn (reads raise TornShardError until it is written again),
        # and a flush keeps its previous version.
        if not self.released:
            self._owner._release([self], self.mode == "w", torn=_torn(self.mode, exc_type))

    async def __aenter__(self) -> ShardLease:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if not self.released:  # released inside the block already: nothing to give back
            await self._owner._release_async([self], self.mode == "w",
                                             torn=_torn(self.mode, exc_type))


class LeaseGroup(Sequence[ShardLease]):
    """Leases taken in one batched acquire and given back in one batched release."""

    def __init__(self, owner: Any, leases: list[ShardLease], mode: str) -> None:
        self._owner, self.leases, self.mode = owner, leases, mode

    def __getitem__(self, index):
        return self.leases[index]

    def __len__(self) -> int:
        return len(self.leases)

    def release(self, dirty: bool | None = None) -> None:
        live = [lease for lease in self.leases if not lease.released]
        if live:
            self._owner._release(live, self.mode == "w" if dirty is None else dirty)

    def __enter__(self) -> LeaseGroup:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        live = [lease for lease in self.leases if not lease.released]
        if live:  # torn on error, as ShardLease.__exit__
            self._owner._release(live, self.mode == "w", torn=_torn(self.mode, exc_type))

    async def __aenter__(self) -> LeaseGroup:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        live = [lease for lease in self.leases if not lease.released]
        if live:
            await self._owner._release_async(live, self.mode == "w",
                                              torn=_torn(self.mode, exc_type))


def _torn(mode: str, exc_type: object) -> bool:
    """A write lease left by an exception is torn (cancellation included)."""
    return mode == "w" and exc_type is not None
