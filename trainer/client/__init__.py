"""Clients of the offloadd daemon: ``OffloadClient`` (blocking) and ``AsyncOffloadClient``.

Both speak the message types of :mod:`offloadd.protocol` and map the job's arena (its fd
arrives with the hello reply over SCM_RIGHTS), so leased shards are plain views of shared
memory: nothing is copied between the daemon and the rank. The package may import
:mod:`trainer.lease_debug` and, of the daemon, only ``offloadd.protocol`` and
``offloadd.errors``.

Layers, each importing only those above it:

- ``wire``: dtype tags, the bytes of a put, replies turned into typed errors;
- ``leases``: ``ShardLease`` and ``LeaseGroup``, views of the arena;
- ``session``: connect, check the peer, hello, map the arena;
- ``core``: the state and request builders both clients share;
- ``blocking`` and ``aio``: the two clients, each its transport and its calls over ``core``.
"""

from __future__ import annotations

from offloadd.errors import (
    DaemonUnavailableError,
    OffloadError,
    ReplyTimeoutError,
    UnknownShardError,
)
from trainer.client.aio import AsyncOffloadClient
from trainer.client.blocking import OffloadClient, StepHandle, set_reply_timeout
from trainer.client.leases import LeaseGroup, ReleasedLeaseError, ShardLease
from trainer.client.session import connect_socket, handshake
from trainer.client.wire import TAG_TORCH_DTYPES, TORCH_DTYPE_TAGS, as_bytes
from trainer.lease_debug import StaleLeaseError

__all__ = [
    "TAG_TORCH_DTYPES",
    "TORCH_DTYPE_TAGS",
    "AsyncOffloadClient",
    "DaemonUnavailableError",
    "LeaseGroup",
    "OffloadClient",
    "OffloadError",
    "ReleasedLeaseError",
    "ReplyTimeoutError",
    "ShardLease",
    "StaleLeaseError",
    "StepHandle",
    "UnknownShardError",
    "as_bytes",
    "connect_socket",
    "handshake",
    "set_reply_timeout",
]
