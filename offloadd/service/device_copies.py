"""Daemon-driven device copies: the session side of ``staging_open`` / ``stage_in`` /
``stage_out`` / ``slot_done`` (design section 8, "daemon copies").

A rank that copies to a device sends ``staging_open`` once. With
``kind="none"`` it only reports (rank copies by configuration, and how its
arena pinning went: ``offloadd_arena_pinned_sessions_total{outcome}``);
otherwise the daemon opens a
``DeviceCopier`` (``offloadd.gpu.cuda``) on the rank's staging slots, or answers
``path="rank"`` with the reason it cannot (the rank then copies itself), and
counts the outcome in ``offloadd_device_copies_sessions_total{path,reason}``.
Afterwards the rank names shards by id and slots by index:

- ``stage_in(shard, slot)``: read-lease the shard (reading it in from NVMe if
  needed), issue its copy into the slot, release the lease after the copy
  completed. The reply goes out when the copy is *issued*: a ``Staged`` reply
  with the slot's fill sequence number, the "filled" event the rank's compute
  waits on at use. So a rank keeps several stage_ins in flight (its own
  prefetch, the gathers issued ahead of compute) instead of one at a time.
- ``stage_out(shard, slot, nbytes)``: write-lease the shard, copy the slot into
  it, commit (release dirty) only after the copy completed; a failed copy
  releases the lease torn, so nothing half-written is published.
- ``slot_done(slot)``: the rank consumed a staged slot.

Read-ahead (``staging_open(readahead_slots=n)``): the rank lends its last ``n``
slots to the daemon. The session learns the rank's stage_in order per step
(``offloadd.memory.trace.AccessTrace``, steps cut by ``step_begin``); after each
stage_in and slot_done it copies the next shards of that trace that fit a
slot and are resident (or being read in from NVMe) into free read-ahead slots.
A stage_in of a shard staged ahead is answered with that slot (``Staged``
reply: slot, version, outcome ``hit``); one written since (another version, or
another shard of the same id) is copied again into it (``stale``), never served
from old bytes; anything else is copied into the named slot (``miss``). The rank
consumes a read-ahead slot and sends ``slot_done`` as for its own; only then
may the daemon fill it again. Counted in
``offloadd_device_copies_readahead_total{outcome}``.

Hazard (a speculative copy must not refuse a writer): a read-ahead copy pins
its shard (no eviction, no drop, so the arena range stays valid until the copy
completed: invariant 6) instead of taking a read lease, which would make the
rank's next write of the shard (an optimizer step, a stage_out) fail with
LeaseConflictError. A writer that changes the shard during or after the copy
bumps its version (or tears it), which the stage_in that claims the slot sees.

Each slot is a small state machine (``SlotState``). A slot is reused only after
its last use finished: ``stage_in`` into a slot the rank has not reported
consumed, or any request on a slot whose copy is in flight, fails with
``SlotBusyError`` and the session serves on. slot_done may come before the
copy into the slot completed (the rank reports it when its consumer is
issued); the next copy into the slot waits on the copier's stream for the
rank's "consumed" event, never on the loop.

Read-ahead never stages a shard whose current version already sits in one of
the rank's slots (staged and not reported consumed): the rank has those bytes
on its GPU, and a second copy would only cost PCIe time and a slot.

The CPU twin (``kind="twin"``) is a test double: the daemon opens the rank's staging
memfd through ``/proc/<pid>/fd`` with its own credentials (root's, on a node daemon).
So it is served only by a daemon started for tests, with ``OFFLOADD_ACCEPT_TWIN_COPIES=1``
in its own environment (the test suite sets it); any other daemon answers
``path="rank"`` (reason ``gpu_not_visible``) and the rank copies itself. A client
cannot set a daemon's environment, so no client can turn it on.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from offloadd import protocol as p
from offloadd.errors import InvalidRequestError, SlotBusyError
from offloadd.gpu.cuda import (
    FALLBACK_REASONS,
    MAX_STAGING_NBYTES,
    MAX_STAGING_SLOTS,
    CopiesRefused,
    DeviceCopier,
    open_copier,
)
from offloadd.memory.shards import Lease, Shard, check_grantable
from offloadd.memory.trace import AccessTrace
from offloadd.metrics import Counters
from offloadd.service.jobs import Job
from offloadd.swap.scheduler import Priority

log = logging.getLogger(__name__)
TWIN_COPIES_ENV = "OFFLOADD_ACCEPT_TWIN_COPIES"
"""``1`` in the daemon's environment: it was started for tests and serves twin copies."""
PINNED_OUTCOMES = ("pinned", "failed", "skipped", "not_attempted")
"""What a rank reports of its cudaHostRegister of the arena (a metric label)."""


class Session(Protocol):
    """What device copies use of a rank's session (``offloadd.service.session.Session``,
    which routes the staging requests here)."""

    job: Job | None
    rank: int
    peer_pid: int
    peer_uid: int
    closed: bool
    staging: SessionStaging | None
    staging_opening: bool
    """A staging_open is being served (its copier opens off the loop)."""

    def on_step_begin(self, req: p.StepBegin) -> None: ...

    def on_optimizer_step(self, req: p.OptimizerStep) -> Awaitable[None]: ...


class SlotState(enum.Enum):
    FREE = "free"  # the daemon may fill it (stage_in); the rank may write it (stage_out)
    COPYING = "copying"  # being leased for a copy, or drained by a stage_out: hands off
    STAGED = "staged"  # its stage_in copy is issued; the rank has not sent slot_done yet
    AHEAD = "ahead"  # a read-ahead slot filled ahead of use, not handed to the rank yet


READAHEAD_OUTCOMES = ("hit", "miss", "stale")
READAHEAD_SCAN = 8
"""Trace entries looked at per read-ahead slot when choosing what to stage next."""
READAHEAD_TRACE_MAX = 1 << 16
"""stage_ins a step's trace records at most (a rank that never sends step_begin would
grow it without end)."""


class DeviceCopiesMetrics:
    """The node-wide counters; registered as a metrics source of the daemon."""

    def __init__(self) -> None:
        self.sessions = Counters(
            "offloadd_device_copies_sessions",
            "Sessions that asked for daemon device copies, by the path they got "
            "(daemon, or rank with the fallback reason).", ["path", "reason"])
        self.arena_pinned = Counters(
            "offloadd_arena_pinned_sessions",
            "Ranks' cudaHostRegister of their arena mapping, as reported at staging_open.",
            ["outcome"])
        self.copied = Counters(
            "offloadd_device_copies_bytes",
            "Bytes the daemon copied between arenas and GPU staging slots.", ["direction"])
        self.readahead = Counters(
            "offloadd_device_copies_readahead",
            "stage_in requests of sessions with read-ahead slots, by outcome: hit (served "
            "from a slot staged ahead), miss, stale (staged ahead, written since: copied "
            "again).", ["outcome"])

    def families(self) -> Iterator[Any]:
        yield self.sessions.family()
        yield self.arena_pinned.family()
        yield self.copied.family()
        yield self.readahead.family()


class _Ahead:
    """A shard the daemon stages ahead of use into a read-ahead slot."""

    __slots__ = ("claimed", "issued", "seq", "settled", "shard", "slot", "task", "version")

    def __init__(self, shard: Shard, slot: int) -> None:
        self.shard, self.slot = shard, slot
        self.claimed = False
        """A stage_in took it: the slot is that request's, whatever the copy's outcome."""
        self.settled = False
        """The copy's end was accounted (pin back, slot state): once, by whoever sees it
        first (the task's done callback, or a stage_in that awaited the finished task)."""
        self.version = -1
        """The shard's version when the copy started (-1 until then)."""
        self.seq = 0
        """The slot's fill sequence number of the copy (0 until issued)."""
        self.issued: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        """True once the copy is issued, False when it will not be (gone, written)."""
        self.task: asyncio.Future[bool] | None = None
        """The copy; True once the slot holds the shard's bytes of ``version``."""


class SessionStaging:
    """One rank's staging slots and the copier that fills and drains them."""

    def __init__(self, copier: DeviceCopier, metrics: DeviceCopiesMetrics,
                 readahead_slots: int = 0) -> None:
        self.copier = copier
        self.metrics = metrics
        self.states = [SlotState.FREE] * copier.num_slots
        self.in_flight = 0
        self.closed = False
        self.own_slots = copier.num_slots - readahead_slots
        """Slots ``[0, own_slots)`` are the rank's; the rest are lent for read-ahead."""
        self.trace = AccessTrace() if readahead_slots else None
        """The rank's stage_in order, step by step (at most READAHEAD_TRACE_MAX a step)."""
        self.ahead: dict[str, _Ahead] = {}
        """Shard id -> its read-ahead copy not claimed by a stage_in yet."""
        self.writes: dict[str, int] = {}
        """Shard id -> the rank's writes of it in flight (optimizer steps, stage_outs): not
        staged ahead until they are done, as the copy would be stale before its use."""
        self.holding: list[tuple[Shard, int] | None] = [None] * copier.num_slots
        self.reading: dict[str, set[asyncio.Future[Any]]] = {}
        """Copies out of each shard still holding their read lease (replied at issue): a
        stage_out of the shard waits for them, as the same stream would order it."""
        """Per slot, the shard and version a stage_in put there, until the rank's slot_done:
        bytes on the rank's GPU, which read-ahead does not copy again."""

    @property
    def readahead(self) -> bool:
        return self.own_slots < len(self.states)

    def _take(self, slot: int, want: SlotState, op: str) -> None:
        if not 0 <= slot < len(self.states):
            raise InvalidRequestError(f"{op}: slot {slot} out of range (the rank opened "
                                      f"{len(self.states)} slots)")
        if slot >= self.own_slots and op != "slot_done":
            raise InvalidRequestError(
                f"{op}: slot {slot} is lent to the daemon for read-ahead (slots "
                f"{self.own_slots}..{len(self.states) - 1}); name one of the rank's own slots")
        state = self.states[slot]
        if state is not want:
            raise SlotBusyError(
                f"{op}: slot {slot} is {state.value}, not {want.value}: a slot is reused only "
                "after its consumer event (send slot_done after using a staged slot, and "
                "wait for each stage_in/stage_out reply)")

    def _check_fits(self, nbytes: int, shard_id: str) -> None:
        if nbytes > self.copier.slot_nbytes:
            raise InvalidRequestError(
                f"shard {shard_id!r} has {nbytes} B, a staging slot {self.copier.slot_nbytes} B;"
                " open the staging slots as large as the largest shard", [shard_id])

    def stage_in(self, job: Job, rank: int, req: p.StageIn) -> Awaitable[p.Reply | None]:
        self._take(req.slot, SlotState.FREE, "stage_in")
        shard = job.table.lookup(rank, [req.shard_id])[0]
        self._check_fits(shard.nbytes, req.shard_id)
        if not self.readahead:
            self.states[req.slot] = SlotState.COPYING
            return self._staged(self._copy(job, rank, req.shard_id, req.slot, "r"), req.slot,
                                "")
        if self.trace is not None and len(self.trace.current) < READAHEAD_TRACE_MAX:
            self.trace.record(shard, time.monotonic())
        entry = self.ahead.pop(req.shard_id, None)
        if entry is None:
            self.states[req.slot] = SlotState.COPYING
            # Started before the read-ahead below, so the demand copy goes first.
            copy = asyncio.ensure_future(self._copy(job, rank, req.shard_id, req.slot, "r"))
            reply = self._staged(copy, req.slot, "miss")
        else:
            entry.claimed = True
            reply = self._claim(job, rank, entry)
        self.read_ahead(job, rank)
        return reply

    async def _staged(self, copy: Awaitable[tuple[int, int]], slot: int,
                      outcome: str) -> p.Staged:
        version, seq = await copy
        if outcome:
            self.metrics.readahead.add((outcome,))
        return p.Staged(0, slot, version, outcome, seq)

    async def _claim(self, job: Job, rank: int, entry: _Ahead) -> p.Staged:
        """A stage_in of a shard staged ahead: its slot once the copy is issued, if the shard
        is unchanged since (a copy still in flight keeps a read lease until it completed);
        otherwise the shard is copied into that slot again."""
        assert entry.task is not None
        shard_id, slot = entry.shard.shard_id, entry.slot
        try:
            issued = await asyncio.shield(entry.issued)
        finally:
            # A task already done when awaited returns at once, before its done callbacks.
            if entry.task.done():
                self._ahead_copied(entry.task, job, entry)
        current = job.table.shards.get((rank, shard_id))
        failed = entry.task.done() and not entry.task.cancelled() and (
            entry.task.exception() is not None or not entry.task.result())
        if issued and not failed and current is entry.shard and current.version == entry.version:
            try:
                check_grantable([current], "r")  # torn, or being written: as a stage_in
                self._lease_until_copied(job, rank, entry)
            except BaseException:
                self.states[slot] = SlotState.FREE
                raise
            self.states[slot] = SlotState.STAGED
            self.holding[slot] = (current, entry.version)
            self.metrics.readahead.add(("hit",))
            return p.Staged(0, slot, entry.version, "hit", entry.seq)
        if not entry.task.done():  # the slot is refilled on the same stream, after it
            await asyncio.shield(entry.task)
        self.states[slot] = SlotState.COPYING
        outcome = "stale" if issued and not failed else "miss"
        return await self._staged(self._copy(job, rank, shard_id, slot, "r"), slot, outcome)

    def _lease_until_copied(self, job: Job, rank: int, entry: _Ahead) -> None:
        """A claimed read-ahead copy still reading the arena: from now on the shard is the
        rank's to read, so a read lease keeps writers off it until the DMA is done (the pin
        alone would let a write tear the bytes being copied)."""
        assert entry.task is not None
        if entry.task.done():
            return
        leases: dict[Shard, Lease] = {}
        shard_id = entry.shard.shard_id
        placed = job.acquire(rank, [shard_id], "r", leases)
        assert isinstance(placed, p.Placed), "a pinned shard in the arena is leased at once"

        def release() -> None:
            job.release(rank, [shard_id], False, leases)

        self._reading(shard_id, entry.task, release)

    def _reading(self, shard_id: str, copy: asyncio.Future[Any],
                 release: Callable[[], None]) -> None:
        """``copy`` reads the shard under a read lease that ``release`` gives back."""
        self.reading.setdefault(shard_id, set()).add(copy)

        def done(_: object) -> None:
            readers = self.reading.get(shard_id)
            if readers is not None:
                readers.discard(copy)
                if not readers:
                    del self.reading[shard_id]
            release()

        copy.add_done_callback(done)

    async def _wait_readers(self, shard_id: str) -> None:
        """Until no copy of ours still reads the shard (a write lease would be refused)."""
        while readers := self.reading.get(shard_id):
            await asyncio.wait(list(readers))

    async def writing(self, job: Job, rank: int, shard_id: str,
                      pending: Awaitable[Any]) -> Any:
        """Await a request that writes ``shard_id``; read-ahead skips the shard meanwhile,
        drops a copy made before it, and looks again afterwards."""
        self.writes[shard_id] = self.writes.get(shard_id, 0) + 1
        entry = self.ahead.get(shard_id)
        if entry is not None and self.states[entry.slot] is SlotState.AHEAD:
            del self.ahead[shard_id]  # about to be stale: the slot can hold something else
            self.states[entry.slot] = SlotState.FREE
        try:
            return await pending
        finally:
            left = self.writes.pop(shard_id) - 1
            if left:
                self.writes[shard_id] = left
            self.read_ahead(job, rank)

    def step_begin(self, job: Job, rank: int) -> None:
        """A new step: the last one's stage_in order is the trace; stage its start."""
        if self.trace is not None:
            self.trace.begin_step()
            self.read_ahead(job, rank)

    def read_ahead(self, job: Job, rank: int) -> None:
        """Fill free read-ahead slots with the next shards of the rank's learned trace."""
        if self.closed or self.trace is None or not self.trace.known:
            return
        count = len(self.states) - self.own_slots
        wanted: list[str] = []
        upcoming = self.trace.upcoming(1 << 62, float("inf"))
        for scanned, (seen, _due) in enumerate(upcoming):
            if scanned >= READAHEAD_SCAN * count or len(wanted) == count:
                break
            if seen.shard_id not in wanted and not self._on_device(seen):
                wanted.append(seen.shard_id)  # the rank's staged bytes are not copied again
        for shard_id in wanted:
            if shard_id in self.ahead or shard_id in self.writes:
                continue
            shard = job.table.shards.get((rank, shard_id))
            if shard is None or shard.nbytes > self.copier.slot_nbytes or shard.writer \
                    or shard.torn or not (shard.in_arena or shard.io is not None):
                continue  # gone, too large, being written, or on NVMe with no read in flight
            slot = self._ahead_slot(wanted)
            if slot is None:
                return
            self._start_ahead(job, shard, slot)

    def _on_device(self, shard: Shard) -> bool:
        """The shard's current bytes sit in a slot the rank has not reported consumed."""
        return any(held is not None and held[0] is shard and held[1] == shard.version
                   for held in self.holding)

    def _ahead_slot(self, wanted: list[str]) -> int | None:
        """A free read-ahead slot, or one holding a shard the trace does not want soon."""
        for slot in range(self.own_slots, len(self.states)):
            if self.states[slot] is SlotState.FREE:
                return slot
        for shard_id, entry in list(self.ahead.items()):
            if shard_id not in wanted and self.states[entry.slot] is SlotState.AHEAD:
                del self.ahead[shard_id]
                self.states[entry.slot] = SlotState.FREE
                return entry.slot
        return None

    def _start_ahead(self, job: Job, shard: Shard, slot: int) -> None:
        entry = _Ahead(shard, slot)
        self.ahead[shard.shard_id] = entry
        self.states[slot] = SlotState.COPYING
        shard.pins += 1  # no eviction or drop under the copy (see the module's Hazard)
        job.table.note_changed(shard)
        self.in_flight += 1
        entry.task = asyncio.ensure_future(self._ahead_copy(job, shard, entry))
        entry.task.add_done_callback(lambda task: self._ahead_copied(task, job, entry))

    async def _ahead_copy(self, job: Job, shard: Shard, entry: _Ahead) -> bool:
        try:
            if not shard.in_arena and job.tier is not None:
                await job.tier.read_in(job.table, shard, Priority.PREFETCH)
            alive = job.table.shards.get((shard.rank, shard.shard_id)) is shard
            if not alive or not shard.in_arena or shard.writer or shard.torn:
                entry.issued.set_result(False)
                return False
            assert shard.offset is not None
            entry.version = shard.version
            arena = job.arena.slice(shard.offset, shard.nbytes)
            entry.seq, done = self.copier.copy_in(entry.slot, arena)
        except BaseException:
            if not entry.issued.done():
                entry.issued.set_result(False)
            raise
        entry.issued.set_result(True)
        await done
        return True

    def _ahead_copied(self, task: asyncio.Future[bool], job: Job, entry: _Ahead) -> None:
        if entry.settled:
            return
        entry.settled = True
        self.in_flight -= 1
        shard = entry.shard
        shard.pins -= 1
        job.table.note_changed(shard)
        copied = not task.cancelled() and task.exception() is None and task.result()
        if not task.cancelled() and task.exception() is not None:
            log.warning("event=readahead_failed job=%s shard=%s error=%r", job.name,
                        shard.shard_id, task.exception())
        if copied:
            self.metrics.copied.add(("h2d",), shard.nbytes)
        if entry.claimed:
            pass  # the slot is its stage_in's: handed to the rank, or filled again
        elif copied:
            self.states[entry.slot] = SlotState.AHEAD
        else:
            self.states[entry.slot] = SlotState.FREE
        if not copied and self.ahead.get(shard.shard_id) is entry:
            del self.ahead[shard.shard_id]
        if self.closed and not self.in_flight:
            self._close_copier()

    def stage_out(self, job: Job, rank: int, req: p.StageOut) -> Awaitable[None]:
        self._take(req.slot, SlotState.FREE, "stage_out")
        shard = job.table.lookup(rank, [req.shard_id])[0]
        self._check_fits(req.nbytes, req.shard_id)
        if req.nbytes != shard.nbytes:
            raise InvalidRequestError(f"stage_out of {req.nbytes} B into shard "
                                      f"{req.shard_id!r} of {shard.nbytes} B", [req.shard_id])
        self.states[req.slot] = SlotState.COPYING
        self.copier.consumed(req.slot)  # the rank recorded it after writing the slot
        copy = self._copy(job, rank, req.shard_id, req.slot, "w")
        if not self.readahead:
            return self._committed(copy)
        return self.writing(job, rank, req.shard_id, self._committed(copy))

    @staticmethod
    async def _committed(copy: Awaitable[tuple[int, int]]) -> None:
        await copy

    def slot_done(self, req: p.SlotDone, job: Job | None = None, rank: int = 0) -> None:
        self._take(req.slot, SlotState.STAGED, "slot_done")
        self.states[req.slot] = SlotState.FREE
        self.holding[req.slot] = None
        self.copier.consumed(req.slot)
        if req.slot >= self.own_slots and job is not None:
            self.read_ahead(job, rank)  # a read-ahead slot came back

    async def _copy(self, job: Job, rank: int, shard_id: str, slot: int,
                    mode: str) -> tuple[int, int]:
        """Lease the shard and issue its copy; (version, fill sequence number) once a copy
        into the slot is issued ("r"), or once a copy out of it committed ("w")."""
        leases: dict[Shard, Lease] = {}
        try:
            if mode == "w":
                await self._wait_readers(shard_id)
            placed = job.acquire(rank, [shard_id], mode, leases)
            if not isinstance(placed, p.Placed):
                placed = await placed
        except BaseException:
            self.states[slot] = SlotState.FREE
            raise
        arena = job.arena.slice(placed.offsets[0], placed.nbytes[0])
        seq = 0
        if mode == "r":
            seq, done = self.copier.copy_in(slot, arena)
            self.states[slot] = SlotState.STAGED
            self.holding[slot] = (job.table.lookup(rank, [shard_id])[0], placed.versions[0])
        else:
            done = self.copier.copy_out(slot, arena)
        self.in_flight += 1
        # The lease goes back when the copy is done, also when this request is cancelled
        # (the client went away): the copy keeps running and still reads/writes its bytes.
        # Registered before shield()'s own callback, so a stage_out's commit and its slot's
        # new state happen before its reply goes out (the rank acts on the reply at once).
        nbytes = placed.nbytes[0]
        done.add_done_callback(lambda finished: self._copied(finished, job, rank, shard_id,
                                                             slot, mode, leases, nbytes))
        if mode == "r":  # _copied gives its lease back
            self._reading(shard_id, done, _nothing)
        if mode == "w":
            await asyncio.shield(done)
        return placed.versions[0], seq

    def _copied(self, task: asyncio.Future[None], job: Job, rank: int, shard_id: str, slot: int,
                mode: str, leases: dict[Shard, Lease], nbytes: int) -> None:
        self.in_flight -= 1
        failed = task.cancelled() or task.exception() is not None
        if mode == "w":
            job.release(rank, [shard_id], not failed, leases, torn=failed)
            self.states[slot] = SlotState.FREE
        else:  # the slot is the rank's since the issue; a failure is in its "filled" event
            job.release(rank, [shard_id], False, leases)
        if failed and not task.cancelled():
            log.warning("event=device_copy_failed job=%s shard=%s mode=%s error=%r", job.name,
                        shard_id, mode, task.exception())
        if not failed:
            direction = "h2d" if mode == "r" else "d2h"
            self.metrics.copied.add((direction,), nbytes)
        if self.closed and not self.in_flight:
            self._close_copier()

    def close(self) -> None:
        """The session ended: unmap the slots once the copies in flight finished (copies
        waiting for the gone rank's events stop waiting)."""
        if self.closed:
            return
        self.closed = True
        self.copier.abandon()
        if not self.in_flight:
            self._close_copier()

    def _close_copier(self) -> None:
        # Off the loop (invariant 5): a CUDA copier synchronizes its stream and unpins
        # the arena when it closes.
        try:
            closing = asyncio.get_running_loop().run_in_executor(None, self.copier.close)
        except RuntimeError:  # the daemon is shutting its loop down: nothing left to block
            self.copier.close()
            return
        closing.add_done_callback(_log_close_failure)


class DeviceCopiesService:
    """Daemon-wide: opens each session's staging and counts the paths sessions got."""

    def __init__(self) -> None:
        self.metrics = DeviceCopiesMetrics()
        self.twin_accepted = os.environ.get(TWIN_COPIES_ENV) == "1"
        """Twin copies are served (a daemon started for tests; see the module note)."""
        if self.twin_accepted:
            log.warning("event=twin_copies_accepted env=%s note=%r", TWIN_COPIES_ENV,
                        "test mode: the CPU twin's staging memfds are opened via /proc")

    async def open(self, session: Session, req: p.StagingOpen) -> p.StagingOk:
        assert session.job is not None
        if req.arena_pinned in PINNED_OUTCOMES:
            self.metrics.arena_pinned.add((req.arena_pinned,))
        if session.staging is not None or session.staging_opening:
            raise InvalidRequestError("staging_open was already sent on this connection")
        if req.kind == "none":  # a report: the job copies on its ranks by configuration
            self.metrics.sessions.add(("rank", "configured"))
            return p.StagingOk(req.rid, "rank", "configured")
        session.staging_opening = True
        try:
            # Off the loop (invariant 5): opening the IPC handle and pinning a whole arena
            # with cudaHostRegister take as long as the arena is large.
            copier = await asyncio.get_running_loop().run_in_executor(
                None, self._copier, session, req)
        except CopiesRefused as refused:
            session.staging_opening = False
            self.metrics.sessions.add(("rank", refused.reason))
            log.warning("event=device_copies_fallback job=%s rank=%d reason=%s detail=%r",
                        session.job.name, session.rank, refused.reason, refused.message)
            return p.StagingOk(req.rid, "rank", refused.reason)
        except BaseException:
            session.staging_opening = False
            raise
        session.staging_opening = False
        if session.closed:  # the rank went away meanwhile: nobody will close it later
            await asyncio.get_running_loop().run_in_executor(None, copier.close)
            raise InvalidRequestError("the connection closed during staging_open")
        session.staging = SessionStaging(copier, self.metrics, req.readahead_slots)
        self.metrics.sessions.add(("daemon", "none"))
        log.info("event=device_copies_open job=%s rank=%d kind=%s device=%s slots=%d "
                 "slot_nbytes=%d readahead_slots=%d", session.job.name, session.rank,
                 copier.kind, req.device_uuid, req.num_slots, req.slot_nbytes,
                 req.readahead_slots)
        return p.StagingOk(req.rid, "daemon", "", req.readahead_slots)

    def _copier(self, session: Session, req: p.StagingOpen) -> DeviceCopier:
        if req.rank_reason:
            if req.rank_reason not in FALLBACK_REASONS:
                raise InvalidRequestError(f"rank_reason {req.rank_reason!r}: expected one of "
                                          f"{', '.join(FALLBACK_REASONS)}")
            raise CopiesRefused(req.rank_reason, "the rank cannot export its staging slots")
        if req.kind not in ("cuda", "twin"):
            raise InvalidRequestError(f"staging kind {req.kind!r}: expected cuda, twin or none")
        if req.kind == "twin" and not self.twin_accepted:
            raise CopiesRefused("gpu_not_visible", "twin staging is a test double: this "
                                f"daemon serves it only when started with {TWIN_COPIES_ENV}=1")
        if not 1 <= req.num_slots <= MAX_STAGING_SLOTS or req.slot_nbytes < 1 \
                or req.num_slots * req.slot_nbytes > MAX_STAGING_NBYTES:
            raise InvalidRequestError(
                f"staging of {req.num_slots} x {req.slot_nbytes} B: need 1..{MAX_STAGING_SLOTS}"
                f" slots of >= 1 B, at most {MAX_STAGING_NBYTES} B in all")
        if req.ipc_offset < 0:
            raise InvalidRequestError(f"ipc_offset {req.ipc_offset}: must be >= 0")
        if not 0 <= req.readahead_slots < req.num_slots:
            raise InvalidRequestError(
                f"readahead_slots {req.readahead_slots} of {req.num_slots} slots: lend the "
                "daemon 0..num_slots-1 (the rank keeps at least one slot of its own)")
        assert session.job is not None
        why_not = session.job.arena.pin_shortage()
        if why_not:
            log.warning("event=arena_pin_skipped job=%s rank=%d reason=%r hint='daemon copies "
                        "run from pageable memory, slower'", session.job.name, session.rank,
                        why_not)
        return open_copier(kind=req.kind, device_uuid=req.device_uuid, peer_pid=session.peer_pid,
                           peer_uid=session.peer_uid, staging_fd=req.staging_fd,
                           ipc_handle=req.ipc_handle,
                           ipc_offset=req.ipc_offset, event_handles=req.event_handles,
                           num_slots=req.num_slots, slot_nbytes=req.slot_nbytes,
                           arena=session.job.arena.view,
                           device_pci_bus_id=req.device_pci_bus_id, pin_arena=not why_not)


def _log_close_failure(closing: asyncio.Future[None]) -> None:
    if not closing.cancelled() and closing.exception() is not None:
        log.error("event=device_copier_close_failed error=%r", closing.exception())


def _staging(session: Session) -> SessionStaging:
    staging = session.staging
    if staging is None:
        raise InvalidRequestError("send staging_open (and get path \"daemon\") before "
                                  "stage_in/stage_out/slot_done")
    return staging


def handlers(session: Session) -> dict[type, Callable[[Any], Any]]:
    """The session's handlers for the device-copy requests of an open staging (staging_open
    itself goes to the daemon's ``DeviceCopiesService.open``)."""

    def stage_in(req: p.StageIn) -> Awaitable[p.Reply | None]:
        assert session.job is not None
        return _staging(session).stage_in(session.job, session.rank, req)

    def stage_out(req: p.StageOut) -> Awaitable[None]:
        assert session.job is not None
        return _staging(session).stage_out(session.job, session.rank, req)

    def slot_done(req: p.SlotDone) -> None:
        assert session.job is not None
        _staging(session).slot_done(req, session.job, session.rank)

    def optimizer_step(req: p.OptimizerStep) -> Awaitable[None]:
        step = session.on_optimizer_step(req)
        staging = session.staging
        if staging is None or not staging.readahead:
            return step
        assert session.job is not None  # the step rewrites the unit's parameter shard
        return staging.writing(session.job, session.rank, f"{req.unit}.param", step)

    def step_begin(req: p.StepBegin) -> None:
        session.on_step_begin(req)  # the swap tier's trace
        if session.staging is not None:  # and the read-ahead's
            assert session.job is not None
            session.staging.step_begin(session.job, session.rank)

    return {
        p.StageIn: stage_in,
        p.StageOut: stage_out,
        p.SlotDone: slot_done,
        p.StepBegin: step_begin,
        p.OptimizerStep: optimizer_step,
    }


def session_closed(session: Session) -> None:
    """The session ended or left its job: its staging goes after the copies in flight."""
    staging = session.staging
    if staging is not None:
        session.staging = None
        staging.close()


def _nothing() -> None:
    return None
