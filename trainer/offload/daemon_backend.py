"""``DaemonBackend``: the offload component over the offloadd client.

A thin adapter: every ``StateBackend`` call is one or two client calls on
the shards ``u{N}.master``, ``u{N}.exp_avg``, ``u{N}.exp_avg_sq``,
``u{N}.grad`` and ``u{N}.param`` of this rank (the session scopes ids by job
and rank). Gradients are accumulated straight into the leased arena memory
and the optimizer step runs in the daemon (``optimizer_step_async``), which
also rewrites ``u{N}.param`` in the training dtype. Queued steps live in
``trainer.offload.daemon_steps``; ``trainer.offload.daemon_connect`` finds the
daemon and builds this backend. Each rank closes its job when its engine
closes, or at interpreter exit (``_close_at_exit``).
"""

from __future__ import annotations

import atexit
import collections
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from offloadd import moment_codec
from offloadd.errors import LimitExceededError, OverBudgetError
from offloadd.formats import SHARD_DTYPES, MomentFormat, moment_nbytes
from offloadd.memory.node import pin_shortage
from offloadd.protocol import StepUndo
from trainer.client import OffloadError
from trainer.device.copy_engine import CopyEngine, InlineCopyEngine, ReleaseQueue, host_address
from trainer.dist.collectives import Collectives
from trainer.lease_debug import check_view
from trainer.offload.backend import (
    MOMENT_KINDS,
    STATE_KINDS,
    AdamHyper,
    GradientUnavailableError,
    StateBackend,
    StepHandle,
    StepRedo,
    UnitSpec,
    squared_norm,
)
from trainer.offload.daemon_copies import (
    DaemonCopies,
    open_daemon_copies,
    report_rank_copies,
)
from trainer.offload.daemon_steps import DaemonStepQueue, state_sizes, step_nbytes
from trainer.offload.sum_room import SumRoom

SHARD_KINDS = (*STATE_KINDS, "grad", "param")
NEXT_KINDS = tuple(f"next.{kind}" for kind in STATE_KINDS)
"""Where a speculative step writes the master and moments it steps to (the daemon's
``offloadd.compute.optimizer.NEXT_SUFFIXES``), until it is committed or not (allocated per
step)."""
UNDO_ARENA_SLACK_FRACTION = 8
"""Undo data leaves 1/8 of the rank's arena share free."""
GRAD_COPIES_IN_FLIGHT = 2
"""Gradient sums a rank keeps on the device for their D2H copies, the one being made
included. Each stays there until its copy lands: a backward that outruns the copies
(small micro-batches, a slow link) would otherwise hold every unit's at once (the timed
twin at 50 MB/s held four of twelve; 4 B per parameter of the model on a GPU). With two,
one unit's copy still overlaps the next one's reduction (``trainer.zero.estimate`` counts
two)."""
PIN_WAIT_WINDOW_S = 0.25
"""How often a rank about to pin the arena reads the daemon's backing progress."""
PIN_WAIT_HORIZON_S = 1.0
"""The span over which a rank reads the daemon's backing rate (at least)."""
PIN_WAIT_MIN_NBYTES_PER_S = 1 << 30
"""Backing progress under which the rank stops waiting and faults the rest in itself
(its own faults reach about that: cudaHostRegister 1.7 GB/s, a populate more)."""


class DaemonBackend(StateBackend):
    """Optimizer state as daemon shards; Adam runs in the daemon."""

    def __init__(self, client: Any, *, collectives: Collectives,
                 private_daemon: Any | None = None, swaps: bool = False,
                 copies: CopyEngine | None = None, device_copies: str = "rank",
                 staging_slots: int = 4, local_rank: int = 0,
                 staging_readahead_slots: int = 0,
                 moment_format: MomentFormat = "float32") -> None:
        self.client = client
        self.moment_format: MomentFormat = moment_format
        """How exp_avg / exp_avg_sq shards are stored (``offload_optimizer.state_dtype``)."""
        self.copies = copies or InlineCopyEngine()
        """Moves lease bytes to/from the compute device (see trainer.device.copy_engine)."""
        self.device_copies_path = "rank"
        """Who copies shards to/from the device: rank | daemon (trainer.offload.daemon_copies)."""
        self.device_copies_reason = ""
        """Why the rank copies although "daemon" was asked for."""
        self._daemon_copies: DaemonCopies | None = None
        self._daemon_copies_pending = device_copies == "daemon"
        """Opened at the first copy, once every unit is registered (slots fit the largest)."""
        self._staging_slots, self._local_rank = staging_slots, local_rank
        self._readahead_slots = staging_readahead_slots
        self.releases = ReleaseQueue(self.copies)
        """Leases whose copies are in flight: released/committed only after their event."""
        self._leased_for_copy: set[str] = set()
        """Shard ids with a release waiting in ``releases``."""
        self._grad_copies: collections.deque[str] = collections.deque()
        """Gradient shards written by D2H copies maybe still in flight, oldest first."""
        self.arena_pinned = "not_attempted"
        """cudaHostRegister of this rank's arena mapping: pinned | failed | skipped (the
        node has no memory for the pages pinning would fault in) | not_attempted."""
        self.arena_pin_s = 0.0
        """Seconds pinning the arena took, the wait for the daemon's backing included."""
        self._pinned_address = 0
        self._pin_arena()
        if device_copies == "rank" and not self.copies.zero_copy:
            report_rank_copies(self.client, self.arena_pinned)
        self.swaps = swaps
        """The state may live on NVMe: prefetch hints are worth their round trip."""
        self.collectives = collectives
        self.private_daemon = private_daemon
        """The private daemon this rank started (local rank 0), else None. Not stopped by
        this rank: it ends by itself after the node's last rank (see
        trainer.offload.daemon_connect)."""
        self._specs: dict[int, UnitSpec] = {}
        self._names: dict[int, tuple[str, str, str]] = {}
        """Per unit: the step's unit name, the grad shard id, the param shard id."""
        arena_nbytes = getattr(getattr(client, "arena", None), "nbytes", 0)
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", collectives.world_size)))
        self.steps = DaemonStepQueue(swaps=swaps, arena_nbytes=arena_nbytes,
                                     local_ranks=local_ranks)
        """Optimizer steps in flight in the daemon, by unit (trainer.offload.daemon_steps)."""
        self._arena_share_nbytes = arena_nbytes // local_ranks
        self._state_nbytes = 0
        """Arena bytes of the registered units' shards."""
        self._undoable: dict[int, StepRedo] = {}
        """Units with a speculative step not committed or reverted yet, and its arguments."""
        self._device_sums: dict[int, torch.Tensor] = {}
        """Running gradient sums of open accumulation windows, on the compute device."""
        self.sum_room = SumRoom(self.copies.device, zero_copy=self.copies.zero_copy)
        """Device memory the running sums may take (``trainer.offload.sum_room``)."""
        self._windows_accumulate = False
        """A window of more than one micro-batch was seen: running sums need room."""
        self.moved_nbytes = 0
        """Bytes this rank copied into or out of arena leases."""
        self.wait_s = 0.0
        """Seconds this rank spent blocked on the daemon (leases, step completion)."""
        _OPEN_BACKENDS.add(self)

    @property
    def device_sum_room_nbytes(self) -> int:
        """Bytes of running sums this rank may keep on the compute device now."""
        return self.sum_room.nbytes

    @device_sum_room_nbytes.setter
    def device_sum_room_nbytes(self, nbytes: int) -> None:
        self.sum_room.nbytes = nbytes

    def end_window(self) -> None:
        self.sum_room.window_done()

    def lend_device_room(self) -> int:
        """Measured device memory the running sums of every unit here leave over, handed
        out (``SumRoom.lend``): 0 before the first window was measured, or on the host."""
        sums = sum(spec.part_numel * spec.grad_dtype.itemsize
                   for spec in self._specs.values() if spec.trainable)
        return self.sum_room.lend(sums if self._windows_accumulate else 0)

    def hand_over(self, unit: int) -> dict[str, torch.Tensor]:
        """The unit's state (``get_state``), and the unit is no longer here: its shards
        are dropped from the arena (and swap). Every step in flight is waited for first."""
        self.wait_steps()
        assert unit not in self._undoable and unit not in self._device_sums
        state = self.get_state(unit)
        spec = self._specs.pop(unit)
        ids = self._ids(unit, *SHARD_KINDS)
        if unit in self.steps.dropped_grads:
            self.steps.dropped_grads.discard(unit)
            ids.remove(self._names[unit][1])
        del self._names[unit]
        self.client.drop(ids)
        self._state_nbytes -= step_nbytes(spec, self.moment_format)
        return state

    @staticmethod
    def _ids(unit: int, *kinds: str) -> list[str]:
        return [f"u{unit}.{kind}" for kind in kinds]

    def register(self, spec: UnitSpec, master: torch.Tensor) -> None:
        """Create the unit's shards and write their first values straight into the arena
        (no host copies on the way): the fp32 ``master`` (copied from wherever it lives),
        zero moments and gradient, and the param copy converted on the host from the fp32
        master, as ``master.cpu().to(param_dtype)`` would."""
        self._specs[spec.index] = spec
        self._names[spec.index] = (f"u{spec.index}", f"u{spec.index}.grad",
                                   f"u{spec.index}.param")
        param_nbytes = spec.part_numel * spec.param_dtype.itemsize
        self._state_nbytes += (step_nbytes(spec, self.moment_format) if spec.trainable
                               else param_nbytes)
        if not spec.trainable:  # frozen: the parameter partition only, no optimizer state
            self.client.alloc([self._names[spec.index][2]], [param_nbytes],
                              [_dtype_tag(spec.param_dtype)])
            self.client.put(self._names[spec.index][2], master.cpu().to(spec.param_dtype))
            return
        layout = self._state_layout(spec)
        if self.swaps:  # made by the first gradient window: zeros would only be written out
            del layout[self._names[spec.index][1]]
            self.steps.dropped_grads.add(spec.index)
        self.client.alloc(list(layout), [size for size, _ in layout.values()],
                          [tag for _, tag in layout.values()])
        if not self.swaps:
            with self.client.acquire_many(list(layout), "w") as leases:
                views = {lease.shard_id: lease for lease in leases}
                host_master = _write_shard(views[f"u{spec.index}.master"], master, spec)
                for shard_id, lease in views.items():
                    if not shard_id.endswith(".master"):
                        _write_shard(lease, host_master, spec)
            return
        # Hazard: leasing the unit's whole state at once, two ranks registering a large
        # unit together against an arena capped below the working set (GPT-2's root unit:
        # 270 MB each against a 512 MiB arena) are refused OverBudgetError; one shard at a
        # time, each rank leases at most one shard.
        host_master = master.cpu()
        for shard_id in layout:
            with self.client.acquire(shard_id, "w") as lease:
                _write_shard(lease, host_master, spec)

    def _state_layout(self, spec: UnitSpec) -> dict[str, tuple[int, str]]:
        """Shard id -> (bytes, dtype tag) of a trainable unit's master, moments, grad and
        param, in ``SHARD_KINDS`` order."""
        numel = spec.part_numel
        moment = (moment_nbytes(self.moment_format, numel), SHARD_DTYPES[self.moment_format])
        sizes = [(4 * numel, _dtype_tag(torch.float32)), moment, moment,
                 (numel * spec.grad_dtype.itemsize, _dtype_tag(spec.grad_dtype)),
                 (numel * spec.param_dtype.itemsize, _dtype_tag(spec.param_dtype))]
        return dict(zip(self._ids(spec.index, *SHARD_KINDS), sizes, strict=True))

    def part_numel(self, unit: int) -> int:
        return self._specs[unit].part_numel

    def param_dtype(self, unit: int) -> torch.dtype:
        return self._specs[unit].param_dtype

    def wait_steps(self) -> None:
        self._drain_copies()
        self.steps.settle_all()

    def _acquire(self, shard_id: str, mode: str) -> Any:
        started = time.perf_counter()
        self._settle_copies_of(shard_id)
        lease = self.client.acquire(shard_id, mode)
        self.wait_s += time.perf_counter() - started
        return lease

    # -------------------------------------------------- copies through the engine

    def _pin_arena(self) -> None:
        """Register the arena mapping for DMA so copies from lease views are truly async.

        Hazard, start-up time: pinning pages the daemon has not backed yet allocates them
        from this rank's faults, racing the daemon's backing threads for the same pages.
        On a 16-core H200 host, 32 GiB pinned that way while the daemon backed it took
        14-18 s; waiting for the daemon's backing (7-8 s), then mapping and pinning the
        backed pages (2 s), took 9-10 s. So the rank waits while the daemon backs fast."""
        arena = getattr(self.client, "arena", None)
        if self.copies.zero_copy or arena is None or not arena.nbytes:
            return
        started = time.perf_counter()
        why_not = self._pin_would_take_missing_memory(self._await_arena_backing(), arena.nbytes)
        if why_not:
            self.arena_pinned = "skipped"
            warnings.warn(f"not pinning the {arena.nbytes} B offloadd arena for DMA: "
                          f"cudaHostRegister faults in every page of it, and {why_not}; copies "
                          "fall back to staged, slower transfers (lower the arena, or free "
                          "memory on the node)", RuntimeWarning, stacklevel=3)
            return
        address = host_address(arena.view)
        pinned = self.copies.register_host(address, arena.nbytes)
        self.arena_pin_s = time.perf_counter() - started
        if pinned:
            self.arena_pinned, self._pinned_address = "pinned", address
            return
        self.arena_pinned = "failed"
        warnings.warn(f"could not pin the {arena.nbytes} B offloadd arena for DMA "
                      "(cudaHostRegister failed; raise the memlock limit: ulimit -l unlimited or "
                      "LimitMEMLOCK=infinity); copies fall back to staged, slower transfers",
                      RuntimeWarning, stacklevel=3)

    @staticmethod
    def _pin_would_take_missing_memory(stats: dict[str, Any], arena_nbytes: int) -> str:
        """Why pinning the arena now would take memory the node does not have ("" when it
        would not). Pinning faults in every page, and the pages nobody backed yet are then
        allocated by this rank, where the daemon's backing watch cannot stop them: past
        the node's room that is the OOM killer, for this rank or another process."""
        return pin_shortage(arena_nbytes - int(stats.get("arena_allocated_nbytes", 0)),
                            hugepages=bool(stats.get("arena_hugepages")),
                            backing_error=str(stats.get("arena_backing_error", "")))

    def _await_arena_backing(self) -> dict[str, Any]:
        """Return the job's stats once the daemon's backing threads are done with the
        arena, or back it slower than ``PIN_WAIT_MIN_NBYTES_PER_S`` (a throttled or lazy
        prefault)."""
        # The rate is read over the last PIN_WAIT_HORIZON_S, not one poll's window: the
        # backed prefix moves a chunk at a time, and on a loaded host one window can see no
        # chunk complete while the backing goes on.
        samples: collections.deque[tuple[float, int]] = collections.deque()
        while True:
            stats: dict[str, Any] = self.client.stats()
            if stats.get("arena_backing") != "backing":
                return stats
            now, backed = time.monotonic(), int(stats.get("arena_backed_nbytes", 0))
            while len(samples) > 1 and now - samples[1][0] >= PIN_WAIT_HORIZON_S:
                samples.popleft()
            if samples and now - samples[0][0] >= PIN_WAIT_HORIZON_S and \
                    backed - samples[0][1] < PIN_WAIT_MIN_NBYTES_PER_S * (now - samples[0][0]):
                return stats
            samples.append((now, backed))
            time.sleep(PIN_WAIT_WINDOW_S)

    def _unpin_arena(self) -> None:
        """Before the client unmaps the arena (unregistering unmapped memory is an error)."""
        if self._pinned_address:
            address, self._pinned_address = self._pinned_address, 0
            self.copies.unregister_host(address)

    def _drain_copies(self) -> None:
        """Wait for every copy in flight and run the releases they held back."""
        try:
            if self._daemon_copies is not None:
                self._daemon_copies.drain()
            self.releases.drain()
        finally:
            self._leased_for_copy.clear()

    def _settle_copies_of(self, shard_id: str) -> None:
        """Our own lease on ``shard_id`` may still be held by a copy: wait for the copies up
        to that one (in issue order), not for every copy in flight."""
        while shard_id in self._leased_for_copy and len(self.releases):
            self.releases.finish_oldest()
        if shard_id in self._leased_for_copy:  # held by a daemon copy
            self._drain_copies()

    def _release_after(self, event: Any, lease: Any) -> None:
        shard_id = lease.shard_id
        self._leased_for_copy.add(shard_id)

        def release() -> None:
            # Once the copy's release ran, acquiring the shard again needs no drain.
            self._leased_for_copy.discard(shard_id)
            lease.release()

        self.releases.release_after(event, release)

    def _device_copier(self) -> DaemonCopies | None:
        """The daemon copies of this rank, opened at the first call (None: rank copies)."""
        if self._daemon_copies_pending:
            self._daemon_copies_pending = False
            slot_nbytes = max((spec.part_numel * max(spec.param_dtype.itemsize,
                                                     spec.grad_dtype.itemsize * spec.trainable)
                               for spec in self._specs.values()), default=1)
            self._daemon_copies, self.device_copies_reason = open_daemon_copies(
                self.client, self.copies, num_slots=self._staging_slots,
                slot_nbytes=slot_nbytes, local_rank=self._local_rank,
                arena_pinned=self.arena_pinned, readahead_slots=self._readahead_slots)
            if self._daemon_copies is not None:
                self.device_copies_path = "daemon"
        return self._daemon_copies

    def _stage_in(self, lease: Any, out: torch.Tensor) -> None:
        """Copy the lease into device ``out``; the lease goes back after the copy's event."""
        try:
            event = self.copies.h2d(out, lease.tensor(out.dtype), guard=lease)
        except BaseException:
            lease.release()
            raise
        self.copies.wait_on_compute(event)
        self._release_after(event, lease)
        self.moved_nbytes += out.nbytes

    def _accumulate_staged(self, unit: int, grad: torch.Tensor, *, first: bool,
                           want_sq_norm: bool) -> torch.Tensor | None:
        """``accumulate_grad`` for a device gradient: the sum is formed on the device and
        copied into the write lease, which commits only after that copy's event."""
        daemon_copies = self._device_copier()
        if daemon_copies is not None:
            return self._accumulate_by_daemon(daemon_copies, unit, grad, first=first,
                                              want_sq_norm=want_sq_norm)
        grad_dtype = self._specs[unit].grad_dtype
        self._await_grad_copy_room()  # before this sum takes its device buffer
        lease = self._acquire(self._names[unit][1], "w")
        try:
            target = lease.tensor(grad_dtype)
            if first:
                # A copy, not ``grad`` itself: the D2H reads it after this call returns,
                # while the reducer may already reuse grad's buffer.
                total = grad.to(grad_dtype, copy=True)
            else:
                total = self.copies.empty(target.numel(), grad_dtype)
                self.copies.wait_on_compute(self.copies.h2d(total, target, guard=lease))
                total.add_(grad)
            event = self.copies.d2h(target, total, guard=lease)
        except BaseException:
            lease.release()
            raise
        self._release_after(event, lease)
        self.moved_nbytes += target.nbytes
        self._grad_copies.append(self._names[unit][1])
        self._poll_copies()
        return squared_norm(total) if want_sq_norm else None

    def _await_grad_copy_room(self) -> None:
        """Wait for the oldest gradient copies until fewer than ``GRAD_COPIES_IN_FLIGHT``
        are in flight, so a new sum makes at most that many on the device."""
        while True:
            inflight = [shard for shard in self._grad_copies if shard in self._leased_for_copy]
            self._grad_copies = collections.deque(inflight)
            if len(inflight) < GRAD_COPIES_IN_FLIGHT:
                return
            started = time.perf_counter()
            self._settle_copies_of(inflight[0])
            self.wait_s += time.perf_counter() - started

    def _accumulate_by_daemon(self, daemon_copies: DaemonCopies, unit: int, grad: torch.Tensor,
                              *, first: bool, want_sq_norm: bool) -> torch.Tensor | None:
        """The sum is formed on the device; the daemon copies it into the gradient shard."""
        grad_id, grad_dtype = self._names[unit][1], self._specs[unit].grad_dtype
        if first:
            total = grad.to(grad_dtype, copy=True)
        else:
            total = self.copies.empty(self._specs[unit].part_numel, grad_dtype)
            daemon_copies.read_into(grad_id, total)
            total.add_(grad)
        daemon_copies.write_from(grad_id, total)
        self.moved_nbytes += total.nbytes
        return squared_norm(total) if want_sq_norm else None

    # ------------------------------------------------------------------ grads

    def _sum_on_device(self, unit: int, grad: torch.Tensor, *, first: bool,
                       last: bool) -> tuple[torch.Tensor, bool] | None:
        """Gradient accumulation on the compute device: the window's running sum stays
        there and crosses to the arena once, at the window's last micro-batch, instead of
        a D2H + H2D + add per micro-batch. Returns what to write then (and whether it is
        the whole window: ``first``); None while the window goes on. Sums beyond
        ``sum_room`` take the per-micro-batch path. A sum is kept in the
        unit's ``grad_dtype`` (fp32, or bf16 with ``data_types.grad_accum_dtype`` bf16,
        where it takes half the room), rounded as the arena's sum would be."""
        self._windows_accumulate |= not last
        held = self._device_sums.pop(unit, None)
        if held is not None and not first:
            held.add_(grad)
            if last:
                return held, True
            self._device_sums[unit] = held
            return None
        # A held sum met by first=True is a window that ended without its last micro-batch:
        # it was popped above and is dropped. A sum starts only with its window: one begun
        # later would lack the micro-batches the arena summed before it.
        grad_dtype = self._specs[unit].grad_dtype
        held_nbytes = sum(total.nbytes for total in self._device_sums.values())
        if (last or not first
                or held_nbytes + grad.numel() * grad_dtype.itemsize > self.sum_room.nbytes):
            return grad, first
        self._device_sums[unit] = grad.to(grad_dtype, copy=True)
        return None

    def accumulate_grad(self, unit: int, grad: torch.Tensor, *, first: bool,
                        want_sq_norm: bool, last: bool = True) -> torch.Tensor | None:
        if not self.copies.zero_copy:
            summed = self._sum_on_device(unit, grad, first=first, last=last)
            if summed is None:
                return None
            grad, first = summed
        self.steps.settle(unit)
        if not self.copies.zero_copy:
            if unit in self.steps.dropped_grads:  # re-create the dropped shard; the copy fills it
                assert first, "a gradient window starts with first=True after each step"
                spec = self._specs[unit]
                self.client.alloc([self._names[unit][1]],
                                  [spec.part_numel * spec.grad_dtype.itemsize],
                                  [_dtype_tag(spec.grad_dtype)])
                self.steps.dropped_grads.discard(unit)
            return self._accumulate_staged(unit, grad, first=first, want_sq_norm=want_sq_norm)
        if unit in self.steps.dropped_grads:
            assert first, "a gradient window starts with first=True after each step"
            started = time.perf_counter()
            grad = grad.to(self._specs[unit].grad_dtype)
            self.client.put(self._names[unit][1], grad)  # re-creates the shard
            self.wait_s += time.perf_counter() - started
            self.steps.dropped_grads.discard(unit)
            self.moved_nbytes += grad.nbytes
            return squared_norm(grad) if want_sq_norm else None
        with self._acquire(self._names[unit][1], "w") as lease:
            target = lease.tensor(self._specs[unit].grad_dtype)
            if first:
                target.copy_(grad)
            else:
                target.add_(grad)
            check_view(target)
            self.moved_nbytes += target.nbytes
            return squared_norm(target) if want_sq_norm else None

    def read_grad(self, unit: int) -> torch.Tensor:
        """The window's running sum where it is: on the compute device while the window
        goes on there (``_sum_on_device``), else in the gradient shard, read once the
        unit's step in flight (which reads it too) and our copies into it are done."""
        held = self._device_sums.get(unit)
        if held is not None:
            return held.clone()
        self.steps.settle(unit)
        if unit in self.steps.dropped_grads:
            raise GradientUnavailableError(
                f"the gradient of unit {unit} is gone: its optimizer step already ran (it "
                "starts during backward when nothing global is needed first) and the NVMe "
                "tier frees a gradient once its step consumed it. Read gradients between "
                "backward and step with gradient_clipping set (steps then wait for the "
                "global norm) or with offload_optimizer.device \"cpu\"")
        self._drain_copies()
        with self._acquire(self._names[unit][1], "r") as lease:
            return lease.tensor(self._specs[unit].grad_dtype).clone()

    def step_async(self, unit: int, *, step: int, hyper: AdamHyper, grad_scale: float,
                   undoable: bool = False) -> StepHandle:
        """Start the step; it is waited for at the unit's next use (or ``wait_steps``).

        The step reads the committed gradient: while the gradient's D2H is in flight the
        step is deferred, and sent at the first poll that finds the copy done (or when it
        is waited for), so the host goes on issuing compute instead of blocking on it."""
        self.steps.settle(unit)
        redo = StepRedo(step=step, hyper=hyper, grad_scale=grad_scale)
        undo: StepUndo = "none"
        if undoable:
            self._undoable[unit], undo = redo, "keep"
        return self.steps.submit(unit, lambda: self._send_step(unit, redo, undo),
                                 defer=not self._grad_copied(unit),
                                 drops_grad=self._drops_grad(undo))

    def step_runs_async(self, unit: int) -> bool:
        return True

    def undo_nbytes(self, unit: int) -> int:
        return sum(state_sizes(self._specs[unit].part_numel, self.moment_format))

    @property
    def undo_budget_nbytes(self) -> int:  # type: ignore[override]
        """The rank's share of the arena beyond its registered state and a slack. None
        where the state does not fit (NVMe with a smaller cache): the speculative steps'
        second copies would then push state out to disk, or be written there themselves."""
        slack = self._arena_share_nbytes // UNDO_ARENA_SLACK_FRACTION
        return max(0, self._arena_share_nbytes - self._state_nbytes - slack)

    def prepare_undo(self, unit: int) -> bool:
        """Allocate ``u{N}.next.*`` for the step to write out of place (the state stays
        as it was, so the step can be undone); a full arena or a limit means no speculation."""
        moment_tag = SHARD_DTYPES[self.moment_format]
        try:
            self.client.alloc(self._ids(unit, *NEXT_KINDS),
                              state_sizes(self._specs[unit].part_numel, self.moment_format),
                              ["float32", moment_tag, moment_tag])
        except (OverBudgetError, LimitExceededError):
            return False
        return True

    def steps_behind(self, units: list[int]) -> int:
        self.client.poll_replies()
        return sum(self.steps.pending(unit) for unit in units)

    def commit_step(self, unit: int) -> None:
        """Sent without waiting: the daemon runs it after the unit's speculative step."""
        redo = self._undoable.pop(unit)
        self.steps.chain(unit, lambda: self._step_request(unit, redo, "commit"),
                         drops_grad=self._drops_grad("commit"))

    def revert_step(self, unit: int, redo: StepRedo | None) -> StepHandle:
        kept = self._undoable.pop(unit)
        self._before_param_write(unit)
        undo: StepUndo = "redo" if redo is not None else "revert"
        return self.steps.chain(unit, lambda: self._step_request(unit, redo or kept, undo),
                                drops_grad=self._drops_grad(undo))

    def _grad_copied(self, unit: int) -> bool:
        """No copy in flight holds the unit's gradient lease: a step reads the committed grad."""
        return self._names[unit][1] not in self._leased_for_copy

    def _poll_copies(self) -> None:
        """Run the releases of completed copies, then send the steps they held back."""
        self.releases.poll()
        self.steps.send_deferred(self._grad_copied)

    def _before_param_write(self, unit: int) -> None:
        """A request that reads the committed grad and rewrites the param is about to go."""
        self._settle_copies_of(self._names[unit][1])
        self._settle_copies_of(self._names[unit][2])
        if self._daemon_copies is not None:
            self._daemon_copies.settle(self._names[unit][1])
            self._daemon_copies.discard(self._names[unit][2])

    def _send_step(self, unit: int, redo: StepRedo, undo: StepUndo) -> StepHandle:
        self._before_param_write(unit)
        return self.steps.admit(unit, step_nbytes(self._specs[unit], self.moment_format),
                                lambda: self._step_request(unit, redo, undo), clock=self)

    def _step_request(self, unit: int, redo: StepRedo, undo: StepUndo) -> StepHandle:
        hyper = redo.hyper
        # The step consumes the gradient and the next window overwrites it: dropped once no
        # later request of the window needs it, it frees arena room and is never written
        # back or read in dead (a speculative step's redo still reads it).
        return self.client.optimizer_step_async(
            self._names[unit][0], step=redo.step, lr=hyper.lr, beta1=hyper.beta1,
            beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
            decoupled_weight_decay=hyper.decoupled_weight_decay, grad_scale=redo.grad_scale,
            drop_grad=self._drops_grad(undo), undo=undo)

    def _drops_grad(self, undo: StepUndo) -> bool:
        """The request frees the gradient shard once it ran: on the NVMe tier (the next
        window re-creates it), unless a redo may still read it (a speculative step)."""
        return self.swaps and undo != "keep"

    def read_params(self, unit: int, out: torch.Tensor) -> None:
        self.steps.settle(unit)
        daemon_copies = None if self.copies.zero_copy else self._device_copier()
        if daemon_copies is not None:
            daemon_copies.read_into(self._names[unit][2], out)
            self.moved_nbytes += out.nbytes
            return
        if not self.copies.zero_copy:
            self._stage_in(self._acquire(self._names[unit][2], "r"), out)
            self._poll_copies()
            return
        with self._acquire(self._names[unit][2], "r") as lease:
            part = lease.tensor(self._specs[unit].param_dtype)
            out.copy_(part)
            check_view(part)
            self.moved_nbytes += out.nbytes

    def host_params(self, unit: int) -> torch.Tensor:
        """Staged through the compute device where a copy engine moves the bytes: it takes
        only device destinations, as CUDA would (the strict twin refuses a host one)."""
        if self.copies.zero_copy:
            return super().host_params(unit)
        part = self.copies.empty(self._specs[unit].part_numel, self._specs[unit].param_dtype)
        self.read_params(unit, part)
        return part.cpu()

    def lease_params(self, unit: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A read lease on ``u{N}.param``: collectives read the arena directly (no copy);
        with a device copy engine, a device copy of it (the lease returns after the copy)."""
        self.steps.settle(unit)
        if not self.copies.zero_copy:
            part = self.copies.empty(self._specs[unit].part_numel, self._specs[unit].param_dtype)
            self.read_params(unit, part)
            return part, _nothing
        lease = self._acquire(self._names[unit][2], "r")
        self.moved_nbytes += lease.nbytes
        return lease.tensor(self._specs[unit].param_dtype), lease.release

    def prefetch_params(self, units: list[int]) -> None:
        daemon_copies = None if self.copies.zero_copy else self._device_copier()
        if daemon_copies is not None:  # the daemon stages them ahead into free slots
            daemon_copies.prefetch([self._names[unit][2] for unit in units
                                    if unit not in self.steps])
        if self.swaps and units:
            self.client.prefetch([self._names[unit][2] for unit in units])

    def begin_step(self) -> None:
        self._poll_copies()
        if self.swaps or self._daemon_copies is not None:
            # The access order steers the NVMe tier's prefetch and the daemon's read-ahead.
            self.client.step_begin()

    def get_state(self, unit: int) -> dict[str, torch.Tensor]:
        if not self._specs[unit].trainable:
            return {}
        self.steps.settle(unit)
        self._drain_copies()
        with self.client.acquire_many(self._ids(unit, *STATE_KINDS), "r") as leases:
            return {kind: lease.tensor().clone()  # the shard's own dtype: moments as stored
                    for kind, lease in zip(STATE_KINDS, leases, strict=True)}

    def set_state(self, unit: int, state: dict[str, torch.Tensor]) -> None:
        self.steps.settle(unit)
        if not self._specs[unit].trainable:
            self._drain_copies()  # a copy in flight may still hold our read lease on it
            self.client.put(self._names[unit][2], state["param"])
            return
        param = state.get("param")
        if param is None:
            param = state["master"].to(self._specs[unit].param_dtype)
        numel = self._specs[unit].part_numel
        moments = [moment_codec.convert(state[kind].cpu(), self.moment_format,
                                        signed=kind == "exp_avg", numel=numel)
                   for kind in MOMENT_KINDS]
        values = [state["master"].cpu(), *moments, param.cpu()]
        self._drain_copies()
        self.client.put_many(dict(zip(self._ids(unit, *STATE_KINDS, "param"), values,
                                      strict=True)))

    def flush(self, tag: str | None) -> None:
        self.wait_steps()
        self.client.flush(tag)

    def stats(self) -> dict[str, Any]:
        rank_side = {"rank_moved_nbytes": self.moved_nbytes, "rank_wait_s": self.wait_s,
                     "rank_copy_engine": self.copies.kind,
                     "rank_h2d_nbytes": self.copies.h2d_nbytes,
                     "rank_d2h_nbytes": self.copies.d2h_nbytes,
                     "rank_releases_deferred": self.releases.deferred,
                     "rank_deferred_steps": self.steps.deferred_steps,
                     "rank_arena_pinned": self.arena_pinned,
                     "rank_arena_pin_s": self.arena_pin_s,
                     "rank_device_copies": self.device_copies_path,
                     "rank_device_copies_reason": self.device_copies_reason}
        if self._daemon_copies is not None:
            rank_side["rank_staged_ahead"] = self._daemon_copies.staged_ahead
            rank_side["rank_staged_hits"] = self._daemon_copies.prefetch_hits
            for outcome, count in self._daemon_copies.readahead.items():
                rank_side[f"rank_readahead_{outcome}"] = count
        try:
            return {**self.client.stats(), **rank_side}
        except OffloadError as error:  # diagnostics only: never fail training over them
            return {"stats_error": str(error), **rank_side}

    def close(self) -> None:
        _OPEN_BACKENDS.discard(self)
        if self.client.closed:
            return
        failure: BaseException | None = None
        try:
            self.wait_steps()
        except BaseException as error:  # still release the connection and the daemon
            failure = error
        if self._daemon_copies is not None:
            try:
                self._daemon_copies.close()
            except BaseException as error:
                failure = failure or error
        self.copies.synchronize()
        self._unpin_arena()
        try:
            self.client.close_job()  # nothing to reattach to: free the job without lingering
        except OffloadError:
            self.client.close()
        if self.private_daemon is not None:
            self.private_daemon.detach()  # it ends after the node's last rank; reap it then
        self.copies.close()
        if failure is not None:
            raise failure


_OPEN_BACKENDS: weakref.WeakSet[DaemonBackend] = weakref.WeakSet()
"""Backends not closed yet: what ``_close_at_exit`` closes."""


def _close_at_exit() -> None:
    """Close the job of every engine the script never closed (DeepSpeed-style scripts end
    without ``engine.close()``): the daemon gives its arena and swap back now instead of
    keeping them ``job_linger_s`` for a rank that will not come back.

    Registered at import, after torch: atexit runs it before torch's own exit handlers,
    while the connection and the copy engine still work. No collectives here: peers may
    already be gone."""
    for backend in list(_OPEN_BACKENDS):
        try:
            backend.close()
        except Exception as error:  # exiting anyway: say why the job may linger
            warnings.warn(f"could not close offloadd job {backend.client.job!r} at exit "
                          f"(the daemon frees it after job_linger_s): {error}",
                          RuntimeWarning, stacklevel=1)


atexit.register(_close_at_exit)


def _nothing() -> None:
    return None


def _write_shard(lease: Any, source: torch.Tensor, spec: UnitSpec) -> torch.Tensor:
    """A freshly registered shard's first bytes, written in place through torch (its
    copies and fills run on all intra-op threads): the master is ``source`` (fp32, any
    device), the param copy ``source`` (a host fp32 master) in the training dtype, the
    moments and gradient zero bytes, which are zeros in every format (blockwise8: zero
    scales and codes). Returns the shard as a host tensor."""
    kind = lease.shard_id.rpartition(".")[2]
    if kind == "master":
        return lease.tensor(torch.float32).copy_(source)
    if kind == "param":
        return lease.tensor(spec.param_dtype).copy_(source)
    return lease.tensor(torch.uint8).zero_()


def _dtype_tag(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16",
            torch.float16: "float16", torch.uint8: SHARD_DTYPES["blockwise8"]}[dtype]
