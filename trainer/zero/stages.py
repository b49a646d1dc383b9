"""ZeRO stages: where parameters live between uses and how gradients are reduced.

A stage is two small strategies:

- a *placement* (``Replicated`` for stages 0-2, ``Sharded`` for stage 3)
  says when a unit's full flat parameters exist and how they are refreshed
  after the optimizer step;
- a *reducer* (``AllReduceReducer`` for stages 0-1, ``ReduceScatterReducer``
  for stages 2-3) turns a unit's flat gradient into this rank's reduced
  gradient partition.

Stage 3 keeps each rank's parameter partition either resident in the rank
(``ResidentPartitions``) or in the offload backend (``OffloadedPartitions``,
shard ``u{N}.param``, all-gathered straight from the arena lease). Full
parameters live in ``trainer.zero.gather.FullParams``: all-gathered asynchronously
ahead of use in forward order (reverse order in backward) by
``PrefetchPlanner``'s recorded trace, kept from forward to backward while
``stage3_max_live_parameters`` has room or the unit's reuse distance allows it
(``stage3_max_reuse_distance``), and freed
after the unit's gradients are reduced, unless the next forward can use them
unchanged: within an accumulation window (and for frozen units, always) they
are held while ``stage3_max_live_parameters`` has room (``FullParams.hold``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Container, Iterable

import torch

from trainer.device.copy_engine import CopyEngine
from trainer.dist.collectives import Collectives, Pending
from trainer.offload.backend import StateBackend
from trainer.zero.gather import FullParams, PartitionLoader, ReleasePartition
from trainer.zero.partition import Unit

# ---------------------------------------------------------------------------
# stage-3 parameter partitions


class PartitionSource(PartitionLoader, abc.ABC):
    """Where a stage-3 rank keeps its parameter partition between gathers."""

    @abc.abstractmethod
    def lease(self, unit: Unit) -> tuple[torch.Tensor, ReleasePartition]:
        """This rank's partition of ``unit`` (training dtype) to all-gather from, and the
        callback that gives it back once the all-gather is done."""

    @abc.abstractmethod
    def refresh(self, unit: Unit) -> None:
        """The optimizer step rewrote the partition; pick it up (lazily) before next use."""

    def prefetch(self, units: list[Unit]) -> None:
        """Start bringing ``units``' partitions close ahead of use."""


def _nothing_to_release() -> None:
    return None


class ResidentPartitions(PartitionSource):
    """Partitions held as tensors in the rank (offload_param device none)."""

    def __init__(self, backend: StateBackend, dtype: torch.dtype) -> None:
        self.backend = backend
        self.dtype = dtype
        self.parts: dict[int, torch.Tensor] = {}
        self._stale: set[int] = set()

    def keep(self, unit: Unit, part: torch.Tensor) -> None:
        self.parts[unit.index] = part.clone()  # a view of the full flat, freed after setup

    def lease(self, unit: Unit) -> tuple[torch.Tensor, ReleasePartition]:
        part = self.parts[unit.index]
        if unit.index in self._stale:
            # Read at first use, not in step(): a daemon step can still be running.
            self._stale.discard(unit.index)
            self.backend.read_params(unit.index, part)
        return part, _nothing_to_release

    def refresh(self, unit: Unit) -> None:
        self._stale.add(unit.index)


class OffloadedPartitions(PartitionSource):
    """Partitions living in the backend (shard ``u{N}.param``), all-gathered in place."""

    def __init__(self, backend: StateBackend, dtype: torch.dtype) -> None:
        self.backend = backend
        self.dtype = dtype

    def keep(self, unit: Unit, part: torch.Tensor) -> None:
        """The backend already derived the partition from the master at registration."""

    def lease(self, unit: Unit) -> tuple[torch.Tensor, ReleasePartition]:
        return self.backend.lease_params(unit.index)

    def read_into(self, unit: Unit, out: torch.Tensor) -> bool:
        self.backend.read_params(unit.index, out)
        return True

    def refresh(self, unit: Unit) -> None:
        """The optimizer step writes ``u{N}.param`` in place; nothing to copy."""

    def prefetch(self, units: list[Unit]) -> None:
        self.backend.prefetch_params([unit.index for unit in units])


# ---------------------------------------------------------------------------
# placements


class Placement(abc.ABC):
    """When full flat parameters exist, and how they follow the optimizer step."""

    sharded: bool = False

    def __init__(self, collectives: Collectives, dtype: torch.dtype) -> None:
        self.collectives = collectives
        self.dtype = dtype

    @abc.abstractmethod
    def setup(self, unit: Unit, flat: torch.Tensor) -> None:
        """Adopt the initial full flat parameters (identical on every rank)."""

    @abc.abstractmethod
    def after_step(self, unit: Unit) -> None:
        """Bring the unit's parameters up to date with the stepped master."""

    def gather(self, unit: Unit) -> None:  # noqa: B027 - replicated params are always there
        """Materialise the unit's full parameters."""

    def release(self, unit: Unit) -> None:  # noqa: B027 - replicated params are always there
        """Drop the unit's full parameters."""

    def pin(self, unit: Unit) -> None:  # noqa: B027 - replicated params are always there
        """Gather the unit and keep it gathered until ``unpin`` (``FullParams.pin``)."""

    def unpin(self, unit: Unit) -> None:  # noqa: B027 - replicated params are always there
        """End one ``pin``; the last one releases the unit."""

    def hold(self, unit: Unit, limit_numel: int) -> None:  # noqa: B027 - always there
        """Keep the unit's full parameters past its backward while everything gathered
        fits ``limit_numel`` elements, else drop them (``FullParams.hold``)."""

    def take(self, unit: Unit) -> None:  # noqa: B027 - replicated params are always there
        """A forward uses the unit again: it is no longer held."""

    @property
    def held(self) -> Container[int]:
        """Indices of the units held past their backward."""
        return ()

    @property
    def live_numel(self) -> int:
        """Elements of full parameters gathered or being gathered (replicated: none are
        gathered on demand)."""
        return 0

    def prefetch(self, upcoming: Iterable[Unit], budget_numel: int,  # noqa: B027
                 skip: Container[int] = ()) -> None:
        """Start gathering ``upcoming`` units ahead of use, except those whose index is in
        ``skip`` (replicated: always there)."""


class Replicated(Placement):
    """Stages 0-2: every rank keeps the full flat parameters."""

    def __init__(self, collectives: Collectives, dtype: torch.dtype,
                 backend: StateBackend) -> None:
        super().__init__(collectives, dtype)
        self.backend = backend

    def setup(self, unit: Unit, flat: torch.Tensor) -> None:
        unit.flat = flat
        unit.point_params_at(flat)

    def after_step(self, unit: Unit) -> None:
        assert unit.flat is not None
        if unit.part_numel == unit.padded_numel:
            self.backend.read_params(unit.index, unit.flat)
            return
        part = torch.empty(unit.part_numel, dtype=self.dtype, device=unit.device)
        self.backend.read_params(unit.index, part)
        self.collectives.all_gather(unit.flat, part)


class Sharded(Placement):
    """Stage 3: a rank keeps only its partition; full parameters exist around use."""

    sharded = True

    def __init__(self, collectives: Collectives, dtype: torch.dtype,
                 source: ResidentPartitions | OffloadedPartitions, *,
                 max_live_numel: int, copies: CopyEngine | None = None) -> None:
        super().__init__(collectives, dtype)
        self.source = source
        self.full = FullParams(collectives, source, dtype, max_live_numel=max_live_numel,
                               copies=copies)

    def setup(self, unit: Unit, flat: torch.Tensor) -> None:
        # a view: an offloaded source has the partition in the backend already, and a
        # device copy of it beside the full flat would double setup's device peak
        self.source.keep(unit, unit.part_slice(flat))
        unit.flat = None
        self.full.adopt(unit)

    def gather(self, unit: Unit) -> None:
        self.full.gather(unit)

    def prefetch(self, upcoming: Iterable[Unit], budget_numel: int,
                 skip: Container[int] = ()) -> None:
        self.full.prefetch(upcoming, budget_numel, skip)

    def release(self, unit: Unit) -> None:
        self.full.free(unit)

    def pin(self, unit: Unit) -> None:
        self.full.pin(unit)

    def unpin(self, unit: Unit) -> None:
        self.full.unpin(unit)

    def hold(self, unit: Unit, limit_numel: int) -> None:
        self.full.hold(unit, limit_numel)

    def take(self, unit: Unit) -> None:
        self.full.take(unit)

    @property
    def held(self) -> Container[int]:
        return self.full.held

    @property
    def live_numel(self) -> int:
        return self.full.live_numel

    def after_step(self, unit: Unit) -> None:
        self.full.free(unit, stale=True)  # gathered before this step: stale now
        self.source.refresh(unit)


# ---------------------------------------------------------------------------
# gradient reduction


class ReducedGrad:
    """A unit's gradient reduction in flight; ``wait()`` gives this rank's reduced
    partition (in the reducer's dtype)."""

    def __init__(self, pending: Pending, finish: Callable[[], torch.Tensor]) -> None:
        self._pending = pending
        self._finish = finish

    def done(self) -> bool:
        """True when ``wait()`` would not block."""
        is_completed = getattr(self._pending, "is_completed", None)
        return True if is_completed is None else bool(is_completed())

    def wait(self) -> torch.Tensor:
        self._pending.wait()
        return self._finish()


class Reducer(abc.ABC):
    """Turns a unit's flat gradient (summed over micro-batches) into this rank's partition."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives

    @abc.abstractmethod
    def reduce(self, unit: Unit, flat_grad: torch.Tensor, *, boundary: bool,
               async_op: bool) -> ReducedGrad | None:
        """Launch the reduction of one micro-batch's gradient; None: nothing to apply yet."""

    @property
    @abc.abstractmethod
    def accumulates_partitions(self) -> bool:
        """True: every micro-batch yields a partition the backend must accumulate."""


class AllReduceReducer(Reducer):
    """Stages 0-1: accumulate full gradients locally, all-reduce once at the boundary.

    The local sum and the all-reduce run in ``sum_dtype``: fp32, or bf16 when the config
    accumulates in bf16 (``data_types.grad_accum_dtype``): then the full gradient held on
    the device between micro-batches takes half the room, and the all-reduce rounds to
    bf16 as stages 2-3's reduce-scatter (and DeepSpeed's bf16 reduction) does."""

    accumulates_partitions = False

    def __init__(self, collectives: Collectives, sum_dtype: torch.dtype = torch.float32
                 ) -> None:
        super().__init__(collectives)
        self.sum_dtype = sum_dtype
        self._local: dict[int, torch.Tensor] = {}

    def reduce(self, unit: Unit, flat_grad: torch.Tensor, *, boundary: bool,
               async_op: bool) -> ReducedGrad | None:
        total = self._local.pop(unit.index, None)
        if total is None:
            total = flat_grad.to(self.sum_dtype, copy=True)
        else:
            total.add_(flat_grad)
        if not boundary:
            self._local[unit.index] = total
            return None
        pending = self.collectives.all_reduce(total, async_op=async_op)
        return ReducedGrad(pending, lambda: unit.part_slice(total))

    def local_sum(self, unit: Unit) -> torch.Tensor | None:
        """This rank's own gradient sum of the window so far (not reduced yet); None at
        the window's start and once its last micro-batch was reduced."""
        return self._local.get(unit.index)


class ReduceScatterReducer(Reducer):
    """Stages 2-3: reduce-scatter every micro-batch; the backend accumulates partitions."""

    accumulates_partitions = True

    def reduce(self, unit: Unit, flat_grad: torch.Tensor, *, boundary: bool,
               async_op: bool) -> ReducedGrad | None:
        pending, part = self.collectives.reduce_scatter_partition(flat_grad, async_op=async_op)
        # In the training dtype, as reduced: widening it here would only double the bytes
        # the backend moves (fp32 shards, D2H); backends that accumulate widen it there.
        return ReducedGrad(pending, lambda: part)


def build_stage(stage: int, collectives: Collectives, dtype: torch.dtype,
                backend: StateBackend, *, offload_params: bool, max_live_numel: int,
                reduce_collectives: Collectives | None = None,
                grad_dtype: torch.dtype = torch.float32) -> tuple[Placement, Reducer]:
    """The placement and reducer of a ZeRO stage (the reducer on ``reduce_collectives``
    when given: see ``Collectives.separate_group``). ``grad_dtype``: the dtype the
    reduced gradient is kept in (``Engine.grad_dtype``); stages 0-1 sum in it, stages 2-3
    reduce-scatter in the training dtype and the backend sums in it."""
    reducing = reduce_collectives or collectives
    reducer: Reducer = (ReduceScatterReducer(reducing) if stage >= 2
                        else AllReduceReducer(reducing, grad_dtype))
    if stage < 3:
        return Replicated(collectives, dtype, backend), reducer
    source = (OffloadedPartitions(backend, dtype) if offload_params
              else ResidentPartitions(backend, dtype))
    return Sharded(collectives, dtype, source, max_live_numel=max_live_numel,
                   copies=getattr(backend, "copies", None)), reducer


class PrefetchPlanner:
    """Remembers the order units ran in the last forward and names the next ones.

    It also measures each unit's *reuse distance*: the elements of the units
    whose forward starts after this unit's forward ends, counted twice (their
    forward and their backward run before this unit's backward).
    """

    def __init__(self, bucket_numel: int, max_live_numel: int) -> None:
        self.budget_numel = min(bucket_numel, max_live_numel)
        self._order: list[Unit] = []
        self._position: dict[int, int] = {}
        self._distance: dict[int, int] = {}
        self._ahead: list[list[Unit]] = []
        self._behind: list[list[Unit]] = []
        self._recording: list[Unit] = []
        self._ends: dict[int, int] = {}

    def record(self, unit: Unit, *, first_of_pass: bool) -> None:
        """Note that ``unit`` starts its forward; ``first_of_pass`` closes the last pass."""
        if first_of_pass and self._recording:
            self._freeze()
        self._recording.append(unit)

    def record_end(self, unit: Unit) -> None:
        """Note that ``unit``'s forward ended."""
        self._ends[unit.index] = len(self._recording)

    def _freeze(self) -> None:
        order, ends = self._recording, self._ends
        after = [0] * (len(order) + 1)
        for index in range(len(order) - 1, -1, -1):
            after[index] = after[index + 1] + order[index].padded_numel
        self._order = order
        self._position = {u.index: i for i, u in enumerate(order)}
        self._distance = {u.index: 2 * after[ends.get(u.index, 0)] for u in order}
        # Built once per pass so the per-unit hooks allocate nothing.
        self._ahead = [order[i + 1:] for i in range(len(order))]
        self._behind = [order[i - 1::-1] if i else [] for i in range(len(order))]
        self._recording, self._ends = [], {}

    def reuse_distance(self, unit: Unit) -> int | None:
        """Elements gathered between the unit's forward and its backward (None: unknown)."""
        return self._distance.get(unit.index)

    def following(self, unit: Unit, *, backward: bool) -> list[Unit]:
        """Units expected after ``unit`` (before it, in backward), nearest first."""
        position = self._position.get(unit.index)
        if position is None:
            return []
        return self._behind[position] if backward else self._ahead[position]

    def upcoming(self, unit: Unit, *, backward: bool,
                 skip: Container[int] = ()) -> list[Unit]:
        """``following`` cut at the element budget, less the units in ``skip`` (daemon
        prefetch hints)."""
        chosen: list[Unit] = []
        total = 0
        for candidate in self.following(unit, backward=backward):
            if candidate.index in skip:
                continue
            total += candidate.part_numel
            if total > self.budget_numel and (chosen or not self.budget_numel):
                break  # the next unit always, unless prefetch is off: see FullParams.prefetch
            chosen.append(candidate)
        return chosen

