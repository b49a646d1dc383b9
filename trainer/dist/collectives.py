"""Collectives over torch.distributed, with a world-of-one fallback.

Works under torchrun (the process group is initialised by
``trainer.init_distributed``, which ``initialize`` calls) and without any
process group (world 1, every collective is the identity). torch 2.13's gloo backend supports
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` on CPU; older gloo
builds do not, so both fall back to all_reduce + slice / list all_gather when
the fused op raises ``RuntimeError`` once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer.device.twin import check_collective
from trainer.device.compute import side_group


class Pending(Protocol):
    """An in-flight collective; ``wait()`` blocks until its output is valid."""

    def wait(self) -> Any: ...


class Done:
    """A collective that already finished (world of one, or a synchronous fallback)."""

    def wait(self) -> None:
        return None


class Collectives:
    """The data-parallel group: rank, size, and the three collectives ZeRO needs."""

    def __init__(self, compute: Any = None, *, group: Any = None,
                 object_group: Any = None) -> None:
        """``compute``: a ``trainer.device.compute.ComputeDevice`` (default: CPU with gloo);
        ``group``: the process group (None: the default group); ``object_group``: an
        existing gloo side group to share (None: make one)."""
        self.compute = compute
        self.group = group
        self.device = compute.device if compute is not None else torch.device("cpu")
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank if self.active else 0))
        self._fused_ops = True
        # gloo's reduce_scatter_tensor does a synchronous copy at issue and then runs
        # slower than an all-reduce of the same tensor (measured: 2.5 ms issue + 6.6 ms
        # wait vs 0.5 + 4.6 ms on 4.9 MB, 2 ranks), so on gloo partitions are slices of
        # an in-place all-reduce.
        self.reduce_by_all_reduce = self.active and dist.get_backend() == "gloo"
        # NCCL's fused ops exist; an error there is real and must not turn into a
        # different (fallback) collective on this rank only.
        self._may_fall_back = not self.active or dist.get_backend() == "gloo"
        if object_group is None and self.active:
            object_group = side_group()
        self.object_group = object_group
        """gloo group for object collectives and barriers (None: the default group)."""
        self.owns_group = False
        """``group`` was made for this object (``separate_group``); ``close`` destroys it."""

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Pending:
        """In-place sum over ranks."""
        check_collective(self.device, tensor)
        if self.world_size == 1:
            return Done()
        work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
        return work if work is not None else Done()

    def reduce_scatter_partition(self, flat: torch.Tensor, *,
                                 async_op: bool = False) -> tuple[Pending, torch.Tensor]:
        """Sum ``flat`` over ranks; this rank's slice of the sum, valid after ``wait()``.

        ``flat`` is scratch: on gloo it is reduced in place and the slice is a view of it.
        """
        part_numel = flat.numel() // self.world_size
        check_collective(self.device, flat)
        if self.world_size == 1:
            return Done(), flat
        if self.reduce_by_all_reduce:
            return self.all_reduce(flat, async_op=async_op), flat.narrow(
                0, self.rank * part_numel, part_numel)
        part = torch.empty(part_numel, dtype=flat.dtype, device=flat.device)
        return self.reduce_scatter(part, flat, async_op=async_op), part

    def _fused(self, op: Callable[..., Any], output: torch.Tensor, source: torch.Tensor,
               async_op: bool) -> Pending | None:
        """Run a flat-tensor collective (``reduce_scatter_tensor``, ``all_gather_into_tensor``);
        None once this backend has refused one, and the caller takes the list-based path."""
        if not self._fused_ops:
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                work = op(output, source, group=self.group, async_op=async_op)
            return work if work is not None else Done()
        except RuntimeError:
            if not self._may_fall_back:
                raise
            self._fused_ops = False
            return None

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, *,
                       async_op: bool = False) -> Pending:
        """Sum ``flat`` (numel = world * output.numel) over ranks; keep this rank's slice."""
        check_collective(self.device, output, flat)
        if self.world_size == 1:
            output.copy_(flat)
            return Done()
        fused = self._fused(dist.reduce_scatter_tensor, output, flat, async_op)
        if fused is not None:
            return fused
        dist.all_reduce(flat, group=self.group)
        output.copy_(flat.view(self.world_size, -1)[self.rank])
        return Done()

    def all_gather(self, flat: torch.Tensor, part: torch.Tensor, *,
                   async_op: bool = False) -> Pending:
        """Fill ``flat`` with every rank's ``part`` in rank order."""
        check_collective(self.device, flat, part)
        if self.world_size == 1:
            flat.copy_(part)
            return Done()
        fused = self._fused(dist.all_gather_into_tensor, flat, part, async_op)
        if fused is not None:
            return fused
        dist.all_gather(list(flat.view(self.world_size, -1).unbind(0)), part,
                        group=self.group)
        return Done()

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        """Overwrite ``tensor`` with ``source_rank``'s copy."""
        check_collective(self.device, tensor)
        if self.world_size > 1:
            dist.broadcast(tensor, source_rank, group=self.group)

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (small, picklable values only)."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.object_group)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.object_group)

    def separate_group(self) -> Collectives:
        """The same ranks on a process group of their own (collective: every rank calls it).

        Collectives pair by issue order *within* a group. Gradient reductions are issued
        in ``ReduceOrder``'s order and stage-3 gathers in the forward/backward trace's
        order; each is the same on every rank, but how they interleave is not (it depends
        on when this rank's units become ready), so they must not share a group.
        """
        if self.world_size == 1:
            return self
        separate = Collectives(self.compute,
                               group=dist.new_group(backend=dist.get_backend(self.group)),
                               object_group=self.object_group)
        separate.owns_group = True
        return separate

    def close(self) -> None:
        """Destroy the group ``separate_group`` made (no-op for any other): each holds
        connections, threads and fds (gloo: 5 fds; NCCL: a communicator and its device
        memory), so a process that builds engine after engine must not keep them.
        Local to this rank; nothing may be issued on the group afterwards."""
        if not self.owns_group:
            return
        self.owns_group = False
        if dist.is_initialized():
            with contextlib.suppress(ValueError):  # destroying the world took it already
                dist.destroy_process_group(self.group)
        # The group's fds close when the last reference goes, and an engine lives on in
        # reference cycles until the collector runs; a collective issued after this
        # fails in torch, naming this stand-in.
        self.group = ClosedGroup()

    def node_leader_value(self, value: Any) -> Any:
        """The ``value`` passed by local rank 0 of this rank's node."""
        entries = self.all_gather_object((node_key(), self.local_rank, value))
        node = node_key()
        for entry_node, entry_local_rank, entry_value in entries:
            if entry_node == node and entry_local_rank == 0:
                return entry_value
        raise RuntimeError(f"no local rank 0 found on node {node} (is LOCAL_RANK set right?)")


class ClosedGroup:
    """Stands in for a group ``Collectives.close`` destroyed."""

    def __repr__(self) -> str:
        return "<a stage-3 reduction group destroyed by Engine.close()>"


def node_key() -> str:
    """This rank's node: the host name, plus torchrun's node rank (``GROUP_RANK``) when set.

    Hazard: the host name alone merges "nodes" that share a host (two torchrun agents on
    one machine, as in tests or on a big box split in two): their ranks would all join
    one node's private daemon while the other's sat idle.
    """
    group_rank = os.environ.get("GROUP_RANK")
    host = socket.gethostname()
    return host if group_rank is None else f"{host}/node{group_rank}"
