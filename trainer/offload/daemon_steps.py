"""The daemon backend's optimizer-step queue: the steps a rank has queued in the daemon.

One handle per unit, waited for at the unit's next use. A step whose gradient copy is
still in flight is deferred and sent once the copy completed; sent steps are bounded by
the arena bytes they pin. What a step sends and which copies it waits for belong to the
backend (``trainer.offload.daemon_backend``), which hands them in as callables.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from offloadd.formats import MomentFormat, moment_nbytes
from trainer.offload.backend import StepHandle, UnitSpec

MIN_INFLIGHT_STEPS = 2
"""Optimizer steps one rank may always keep queued in the daemon: two keep the daemon's
worker busy back to back."""
INFLIGHT_STEPS_ARENA_FRACTION = 4
"""Beyond ``MIN_INFLIGHT_STEPS``, a rank's queued steps pin at most 1/4 of its share of the
arena. Each pins its unit's five shards (~18 B/param) until it runs, so an unbounded queue
can fill an arena with leases nothing can evict; what fits is bounded by arena room, not by
whether the state may swap."""


class WaitClock(Protocol):
    """Where the time a rank spends blocked on the daemon is booked."""

    wait_s: float


class DaemonStepQueue:
    """Optimizer steps in flight in the daemon, by unit."""

    def __init__(self, *, swaps: bool, arena_nbytes: int, local_ranks: int) -> None:
        self._steps: dict[int, StepHandle] = {}
        """Optimizer steps in flight, by unit; waited for at the unit's next use."""
        self.room_nbytes = (arena_nbytes // (INFLIGHT_STEPS_ARENA_FRACTION * local_ranks)
                            if swaps and arena_nbytes else 1 << 62)
        """Arena bytes this rank's queued optimizer steps may pin (beyond the first two);
        without NVMe the whole working set is resident and nothing needs bounding."""
        self._inflight_step_nbytes: dict[int, int] = {}
        self._drops: dict[int, bool] = {}
        """Units whose step in flight asked the daemon to drop its gradient shard (NVMe
        only, and not a speculative step's: its redo may still read the gradient)."""
        self.dropped_grads: set[int] = set()
        """Units whose ``u{N}.grad`` shard the daemon forgot after its step, or never made
        (NVMe only): the next gradient window re-creates it."""
        self.deferred_steps = 0
        """Optimizer steps held back until their gradient's D2H completed."""

    def __contains__(self, unit: int) -> bool:
        return unit in self._steps

    def settle(self, unit: int) -> None:
        """Wait for the unit's optimizer step, if one is in flight: its shards are leased."""
        handle = self._steps.pop(unit, None)
        if handle is not None:
            try:
                handle.wait()  # a deferred step is sent first
            finally:
                self._inflight_step_nbytes.pop(unit, None)
            if self._drops.pop(unit, False):  # the step asked the daemon to (``drop_grad``)
                self.dropped_grads.add(unit)

    def settle_all(self) -> None:
        """Wait for every step in flight; the first failure is raised once all finished."""
        failure: BaseException | None = None
        for unit in list(self._steps):
            try:
                self.settle(unit)
            except BaseException as error:  # wait for the rest before re-raising
                failure = failure or error
        if failure is not None:
            raise failure

    def submit(self, unit: int, send: Callable[[], StepHandle], *, defer: bool,
               drops_grad: bool) -> StepHandle:
        """Queue the unit's step: sent now, or, with ``defer`` (its gradient's D2H is in
        flight), by the first ``send_deferred`` that finds the copy done (or when waited for).
        ``drops_grad``: the step asks the daemon to drop the gradient shard."""
        handle: StepHandle
        if defer:
            handle = _DeferredStep(send)
            self.deferred_steps += 1
        else:
            handle = send()
        self._steps[unit] = handle
        self._drops[unit] = drops_grad
        return handle

    def chain(self, unit: int, send: Callable[[], StepHandle], *,
              drops_grad: bool) -> StepHandle:
        """Send a follow-up of the unit's step in flight (a speculative step's commit or
        revert) now, without waiting for it: the daemon runs a unit's requests in the order
        they came. A deferred step is sent first, so it comes first."""
        previous = self._steps.get(unit)
        if isinstance(previous, _DeferredStep):
            previous.send()
        handle: StepHandle = send()
        if previous is not None:
            handle = _ChainedSteps(previous, handle)
        self._steps[unit] = handle
        self._drops[unit] = drops_grad
        return handle

    def pending(self, unit: int) -> bool:
        """The unit's step is queued, deferred or running, as far as the replies read so far
        tell (``OffloadClient.poll_replies``)."""
        handle = self._steps.get(unit)
        return handle is not None and not _done(handle)

    def send_deferred(self, copied: Callable[[int], bool]) -> None:
        """Send the deferred steps whose gradient D2H completed (after a ``poll``)."""
        for unit, handle in list(self._steps.items()):
            if isinstance(handle, _DeferredStep) and not handle.sent and copied(unit):
                handle.send()

    def admit(self, unit: int, pinned_nbytes: int, send: Callable[[], StepHandle], *,
              clock: WaitClock) -> StepHandle:
        """Send the step once the queue has room for the arena bytes it pins; its handle
        books the time waited for it on ``clock``.

        The clock (the backend) is handed in per step, not kept: only handles in flight
        refer to the backend, so the queue it owns makes no reference cycle with it."""
        while len(self._inflight_step_nbytes) >= MIN_INFLIGHT_STEPS and (
                sum(self._inflight_step_nbytes.values()) + pinned_nbytes > self.room_nbytes):
            # The oldest sent step (steps finish in order); deferred ones pin nothing yet.
            self.settle(next(iter(self._inflight_step_nbytes)))
        self._inflight_step_nbytes[unit] = pinned_nbytes
        return _TimedHandle(send(), clock)


def state_sizes(numel: int, moment_format: MomentFormat) -> list[int]:
    """Bytes of a unit's fp32 master and its two moments: what a speculative step writes
    beside the state (``u{N}.next.*``)."""
    return [4 * numel, *[moment_nbytes(moment_format, numel)] * 2]


def step_nbytes(spec: UnitSpec, moment_format: MomentFormat) -> int:
    """Arena bytes one step of the unit leases: master, moments, grad and param."""
    numel = spec.part_numel
    return (sum(state_sizes(numel, moment_format))
            + numel * (spec.grad_dtype.itemsize + spec.param_dtype.itemsize))


def _done(handle: StepHandle) -> bool:
    done = getattr(handle, "done", None)
    return True if done is None else bool(done())


class _DeferredStep:
    """An optimizer step not sent yet: its gradient's D2H was in flight at ``step_async``.
    Sent by the backend's poll once the copy completed, or by ``wait``."""

    def __init__(self, send: Callable[[], StepHandle]) -> None:
        self._send = send
        self._sent: StepHandle | None = None

    @property
    def sent(self) -> bool:
        return self._sent is not None

    def send(self) -> None:
        if self._sent is None:
            self._sent = self._send()

    def wait(self) -> None:
        self.send()
        assert self._sent is not None
        self._sent.wait()

    def done(self) -> bool:
        return self._sent is not None and _done(self._sent)


class _ChainedSteps:
    """A unit's step and its follow-up, waited for in order (the first failure re-raised
    once both ended)."""

    def __init__(self, first: StepHandle, then: StepHandle) -> None:
        self._first = first
        self._then = then

    def wait(self) -> None:
        try:
            self._first.wait()
        except BaseException:
            try:
                self._then.wait()
            except Exception:  # the first failure is the one raised
                pass
            raise
        self._then.wait()

    def done(self) -> bool:
        return _done(self._first) and _done(self._then)


class _TimedHandle:
    """A daemon step handle that books its blocking time on the backend."""

    def __init__(self, handle: StepHandle, clock: WaitClock) -> None:
        self._handle = handle
        self._clock = clock

    def wait(self) -> None:
        started = time.perf_counter()
        try:
            self._handle.wait()
        finally:
            self._clock.wait_s += time.perf_counter() - started

    def done(self) -> bool:
        return _done(self._handle)
