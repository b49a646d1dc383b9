"""Stage-3 full parameters: one persistent buffer per unit, async all-gathers, prefetch.

Each unit owns one flat buffer of ``padded_numel`` elements for its whole
life. Freeing it shrinks its storage to zero bytes; gathering grows the same
storage back and all-gathers into it. Keeping the storage *object* matters:
autograd saves views of parameters (``weight.t()`` inside ``F.linear``) that
reference the storage the parameter had during forward, so a backward that
re-gathers into a *new* buffer would read the old one (kept alive, so no
memory is freed), and one that reuses a pooled buffer would read another
unit's values.

Gathers are deterministic on every rank (they depend only on the recorded
unit order and the config), because gloo pairs collectives by issue order.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Iterable

import torch

from trainer.device.copy_engine import CopyEngine, CopyEvent, InlineCopyEngine
from trainer.dist.collectives import Collectives, Done, Pending
from trainer.lease_debug import check_view
from trainer.zero.partition import Unit

ReleasePartition = Callable[[], None]


def _nothing() -> None:
    return None


class GatherState(enum.Enum):
    FREE = "free"
    """Storage is zero bytes; the parameters are empty tensors."""
    GATHERING = "gathering"
    """An all-gather writes the buffer; the partition it reads is still leased."""
    READY = "ready"
    """The buffer holds the full parameters and the parameters view it."""


class PartitionLoader:
    """What the gatherer needs from a partition source (see ``trainer.zero``)."""

    def lease(self, unit: Unit) -> tuple[torch.Tensor, ReleasePartition]:
        """This rank's partition to all-gather from, and how to give it back afterwards."""
        raise NotImplementedError

    def read_into(self, unit: Unit, out: torch.Tensor) -> bool:
        """Issue the copy of this rank's partition into device ``out`` on the current
        stream; False when this source can only lease it (a world of one then copies
        the lease)."""
        return False


class _UnitBuffer:
    __slots__ = ("flat", "nbytes", "part", "pending", "ready", "release_part", "state",
                 "storage", "unit")

    def __init__(self, unit: Unit, dtype: torch.dtype) -> None:
        self.unit = unit
        self.flat = torch.empty(unit.padded_numel, dtype=dtype, device=unit.device)
        self.storage = self.flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.storage.resize_(0)
        self.state = GatherState.FREE
        self.pending: Pending | None = None
        self.release_part: ReleasePartition | None = None
        self.part: torch.Tensor | None = None
        """The leased partition the all-gather reads (checked in debug-lease mode)."""
        self.ready: CopyEvent | None = None
        """The copy stream's event after this gather was issued (waited for at use)."""


class FullParams:
    """Gathers, prefetches and frees the units' full parameters."""

    def __init__(self, collectives: Collectives, loader: PartitionLoader, dtype: torch.dtype,
                 *, max_live_numel: int, max_inflight: int = 2,
                 copies: CopyEngine | None = None) -> None:
        self.collectives = collectives
        self.loader = loader
        self.copies = copies or InlineCopyEngine()
        """Gathers are issued ahead of compute on its copy stream and waited for at use."""
        self.dtype = dtype
        self.max_live_numel = max_live_numel
        """Elements gathered or being gathered, at most (the unit in use is always allowed)."""
        self.max_inflight = max_inflight
        """Prefetched all-gathers in flight at once (DeepSpeed hard-codes 2)."""
        self._buffers: dict[int, _UnitBuffer] = {}
        self.before_gather: Callable[[Unit], None] | None = None
        """Called before each all-gather is issued (``trainer.zero.trace`` checks the order)."""
        self.live_numel = 0
        self.num_gathers = 0
        self.num_prefetched = 0
        self._held: dict[int, None] = {}
        """Indices of the units kept gathered past their backward (``hold``), oldest first
        (a dict as an ordered set)."""
        self._pins: dict[int, int] = {}
        """Unit index -> open ``pin`` calls (``zero.GatheredParameters`` contexts)."""

    def adopt(self, unit: Unit) -> None:
        unit.release_params()
        self._buffers[unit.index] = _UnitBuffer(unit, self.dtype)

    def state(self, unit: Unit) -> GatherState:
        return self._buffers[unit.index].state

    def gather(self, unit: Unit) -> None:
        """Make the unit's full parameters valid (waits for its all-gather)."""
        buffer = self._buffers[unit.index]
        if buffer.state is GatherState.FREE:
            self._start(buffer)
        if buffer.state is GatherState.GATHERING:
            self._finish(buffer)

    def prefetch(self, upcoming: Iterable[Unit], budget_numel: int,
                 skip: Container[int] = ()) -> None:
        """Start all-gathers for the first free units of ``upcoming`` within the budgets;
        units whose index is in ``skip`` are passed over."""
        inflight = sum(1 for b in self._buffers.values() if b.state is GatherState.GATHERING)
        spent = 0
        for unit in upcoming:
            buffer = self._buffers[unit.index]
            if buffer.state is not GatherState.FREE or unit.index in skip:
                continue
            # The next unit is always gathered ahead, however large: the budget (DeepSpeed's
            # stage3_prefetch_bucket_size) limits how far beyond it prefetch reaches; 0 is off.
            over_budget = budget_numel == 0 or (spent > 0
                                                and spent + unit.padded_numel > budget_numel)
            spent += unit.padded_numel
            if (inflight >= self.max_inflight or over_budget
                    or self.live_numel + unit.padded_numel > self.max_live_numel):
                return
            self._start(buffer)
            self.num_prefetched += 1
            inflight += 1

    def pin(self, unit: Unit) -> None:
        """Gather ``unit`` and keep it gathered until as many ``unpin`` calls: the forward
        and backward hooks' releases pass it over (a generation inside
        ``GatheredParameters`` over every parameter gathers nothing again, and a nested
        context's exit leaves the outer one's parameters in place)."""
        self._pins[unit.index] = self._pins.get(unit.index, 0) + 1
        self.gather(unit)

    def unpin(self, unit: Unit) -> None:
        left = self._pins.pop(unit.index) - 1
        if left:
            self._pins[unit.index] = left
        else:
            self.free(unit)

    def free(self, unit: Unit, *, stale: bool = False) -> None:
        """Drop the full parameters (after any all-gather into them completes); a pinned
        unit's stay, unless ``stale`` (its partition was stepped: the next use gathers the
        new values, and they stay while pinned)."""
        if unit.index in self._pins and not stale:
            return
        buffer = self._buffers[unit.index]
        if buffer.state is GatherState.GATHERING:
            self._finish(buffer)
        self._held.pop(unit.index, None)
        if buffer.state is GatherState.READY:
            unit.release_params()
            self.copies.hand_back(buffer.flat)
            buffer.storage.resize_(0)
            buffer.state = GatherState.FREE
            self.live_numel -= unit.padded_numel

    @property
    def held(self) -> Container[int]:
        """Indices of the units kept gathered past their backward (see ``hold``)."""
        return self._held.keys()

    def hold(self, unit: Unit, limit_numel: int) -> None:
        """Leave ``unit``'s gathered parameters in place past its backward for the next
        forward, while everything gathered stays within ``limit_numel`` elements; free it
        otherwise.

        A unit's partition only changes at the optimizer step (which frees its full
        parameters first), so the next micro-batch of an accumulation window, or any later
        step for a frozen unit, can use the same values without gathering them again.
        Backward runs the forward's order in reverse, so the unit held last is the first
        the next forward needs: older held units are freed first to make room."""
        buffer = self._buffers[unit.index]
        if buffer.state is GatherState.FREE or unit.index in self._pins:
            return
        self._held.pop(unit.index, None)
        while self.live_numel > limit_numel and self._held:
            self.free(self._buffers[next(iter(self._held))].unit)
        if self.live_numel > limit_numel:
            self.free(unit)
            return
        self._held[unit.index] = None

    def take(self, unit: Unit) -> None:
        """The forward uses ``unit`` again: it is no longer held, only gathered."""
        self._held.pop(unit.index, None)

    def free_all(self) -> None:
        for buffer in self._buffers.values():
            self.free(buffer.unit)

    def _start(self, buffer: _UnitBuffer) -> None:
        if self.before_gather is not None:
            self.before_gather(buffer.unit)
        with self.copies.ahead_of_compute():
            buffer.storage.resize_(buffer.nbytes)
            if self.collectives.world_size == 1 and self.loader.read_into(buffer.unit,
                                                                          buffer.flat):
                # A world of one gathers nothing: the partition's copy fills the buffer.
                buffer.pending, buffer.release_part = Done(), _nothing
            else:
                part, buffer.release_part = self.loader.lease(buffer.unit)
                buffer.part = part
                self.copies.before_collective()
                buffer.pending = self.collectives.all_gather(buffer.flat, part, async_op=True)
            buffer.ready = self.copies.ready()
        buffer.state = GatherState.GATHERING
        self.live_numel += buffer.unit.padded_numel
        self.num_gathers += 1

    def _finish(self, buffer: _UnitBuffer) -> None:
        assert buffer.pending is not None and buffer.release_part is not None
        pending, release_part = buffer.pending, buffer.release_part
        buffer.pending = buffer.release_part = None
        try:
            pending.wait()
            if buffer.ready is not None:
                self.copies.wait_on_compute(buffer.ready)
                self.copies.recycle(buffer.ready)
                buffer.ready = None
            if buffer.part is not None:
                check_view(buffer.part)  # the gather read a partition still leased
        finally:
            buffer.part = None
            release_part()
        buffer.unit.point_params_at(buffer.flat)
        buffer.state = GatherState.READY
