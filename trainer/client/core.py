"""The state and request building both clients share; each adds only its transport.

``ClientCore`` holds the session (ids, arena, request ids, debug lease ranges), turns
``Placed`` replies into leases and builds every request whose arguments need more than a
constructor call, so ``OffloadClient`` and ``AsyncOffloadClient`` hold little beyond how
a request reaches the daemon and how its reply comes back. Imports :mod:`trainer.client.wire`,
:mod:`trainer.client.leases` and :mod:`trainer.client.session` of the client package.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from offloadd import protocol as p
from offloadd.errors import InvalidRequestError
from trainer import lease_debug
from trainer.client.leases import ShardLease
from trainer.client.session import Arena
from trainer.client.wire import as_bytes, as_list


class ClientCore:
    """State and request builders shared by the blocking and the asyncio client."""

    def __init__(self, hello: p.HelloOk, arena: Arena, job: str, rank: int) -> None:
        self.job, self.rank = job, rank
        self.session_id = hello.session_id
        self.daemon_pid = hello.daemon_pid
        self.arena = arena
        self._next_rid = 0
        self.closed = False
        self.lease_ranges = lease_debug.LeaseRanges(arena.view) if lease_debug.enabled() else None
        """Live lease ranges, kept only in debug-lease mode (see ``trainer.lease_debug``)."""

    def _rid(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def _mark_closed(self) -> None:
        """Closed from now on: leases read as released and debug lease ranges are dropped."""
        self.closed = True
        if self.lease_ranges is not None:
            self.lease_ranges.close()

    # -- leases -------------------------------------------------------------------

    def _lease(self, shard_id: str, mode: str, reply: p.Reply) -> ShardLease:
        """The lease of a single-shard acquire (``_leases`` for one id, without the lists)."""
        assert isinstance(reply, p.Placed)
        offset, nbytes = reply.offsets[0], reply.nbytes[0]
        if self.lease_ranges is not None:
            self.lease_ranges.hold(offset, nbytes, shard_id)
        return ShardLease(self, shard_id, mode, offset, nbytes, reply.versions[0],
                          reply.dtypes[0], self.arena.view[offset : offset + nbytes])

    def _leases(self, ids: list[str], mode: str, reply: p.Reply) -> list[ShardLease]:
        assert isinstance(reply, p.Placed)
        view = self.arena.view
        if self.lease_ranges is not None:
            for shard_id, offset, nbytes in zip(ids, reply.offsets, reply.nbytes):
                self.lease_ranges.hold(offset, nbytes, shard_id)
        return [
            ShardLease(self, shard_id, mode, offset, nbytes, version, dtype,
                       view[offset : offset + nbytes])
            for shard_id, offset, nbytes, version, dtype in zip(
                ids, reply.offsets, reply.nbytes, reply.versions, reply.dtypes)
        ]

    @staticmethod
    def _release_request(leases: list[ShardLease], dirty: bool, torn: bool) -> p.Release:
        """Forget ``leases`` (their views fail from now on) and build their release."""
        ids = [lease.shard_id for lease in leases]
        for lease in leases:
            lease._forget()
        return p.Release(0, ids, dirty, torn)

    # -- requests -----------------------------------------------------------------

    @staticmethod
    def _acquire_request(ids: list[str], mode: str) -> p.Acquire:
        return p.Acquire(0, ids, mode)  # type: ignore[arg-type]

    @staticmethod
    def _put_request(shard_id: str, data: Any) -> tuple[memoryview, p.Acquire]:
        """The bytes of ``data`` and the write acquire that creates or resizes their shard."""
        src, dtype = as_bytes(data)
        return src, p.Acquire(0, [shard_id], "w", [src.nbytes], [dtype])

    @staticmethod
    def _alloc_request(ids: str | Iterable[str], nbytes: int | Iterable[int],
                       dtype: str | Iterable[str]) -> p.Alloc:
        id_list = as_list(ids)
        sizes = [nbytes] * len(id_list) if isinstance(nbytes, int) else list(nbytes)
        dtypes = [dtype] * len(id_list) if isinstance(dtype, str) else list(dtype)
        if len(sizes) != len(id_list) or len(dtypes) != len(id_list):
            raise InvalidRequestError("alloc needs one size and one dtype per shard id")
        return p.Alloc(0, id_list, sizes, dtypes)

    @staticmethod
    def _step_request(unit: str, step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, decoupled_weight_decay: bool,
                      grad_scale: float, drop_grad: bool = False,
                      undo: p.StepUndo = "none") -> p.OptimizerStep:
        return p.OptimizerStep(0, unit, step, lr, beta1, beta2, eps, weight_decay,
                               decoupled_weight_decay, grad_scale, drop_grad, undo)

    @staticmethod
    def _stats_of(reply: p.Reply) -> dict[str, Any]:
        """The stats a Flush or Stats request answers with."""
        assert isinstance(reply, p.StatsOk)
        return reply.stats
