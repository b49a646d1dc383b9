"""Daemon-driven device copies: the session side of ``staging_open`` / ``stage_in`` /
``stage_out`` / ``slot_done`` (design section 8, "daemon copies").

A rank that copies to a device sends ``staging_open`` once. With
``kind="none"`` it only reports (rank copies by configuration, and how its
arena pinning went: ``offloadd_arena_pinned_sessions_total{outcome}``);
otherwise the daemon opens a
``DeviceCopier`` (``offloadd.cuda``) on the rank's staging slots, or answers
``path="rank"`` with the reason it cannot (the rank then copies itself), and
counts the outcome in ``offloadd_device_copies_sessions_total{path,reason}``.
Afterwards the rank names shards by id and slots by index:

- ``stage_in(shard, slot)``: read-lease the shard (reading it in from NVMe if
  needed), copy it into the slot, release the lease after the copy; the reply
  is the slot's "filled" event.
- ``stage_out(shard, slot, nbytes)``: write-lease the shard, copy the slot into
  it, commit (release dirty) only after the copy completed; a failed copy
  releases the lease torn, so nothing half-written is published.
- ``slot_done(slot)``: the rank consumed a staged slot.

Each slot is a small state machine (``SlotState``). A slot is reused only after
its last use finished: ``stage_in`` into a slot the rank has not reported
consumed, or any request on a slot whose copy is in flight, fails with
``SlotBusyError`` and the session serves on.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from offloadd import protocol as p
from offloadd.cuda import (
    FALLBACK_REASONS,
    MAX_STAGING_NBYTES,
    MAX_STAGING_SLOTS,
    CopiesRefused,
    DeviceCopier,
    open_copier,
)
from offloadd.errors import InvalidRequestError, SlotBusyError
from offloadd.metrics import Counters
from offloadd.shards import Lease, Shard

if TYPE_CHECKING:
    from offloadd.jobs import Job
    from offloadd.session import Session

log = logging.getLogger(__name__)
PINNED_OUTCOMES = ("pinned", "failed", "not_attempted")
"""What a rank reports of its cudaHostRegister of the arena (a metric label)."""


class SlotState(enum.Enum):
    FREE = "free"  # the daemon may fill it (stage_in); the rank may write it (stage_out)
    COPYING = "copying"  # a daemon copy reads or writes it: nobody else may touch it
    STAGED = "staged"  # filled by stage_in; the rank has not reported slot_done yet


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

    def families(self) -> Iterator[Any]:
        yield self.sessions.family()
        yield self.arena_pinned.family()
        yield self.copied.family()


class SessionStaging:
    """One rank's staging slots and the copier that fills and drains them."""

    def __init__(self, copier: DeviceCopier, metrics: DeviceCopiesMetrics) -> None:
        self.copier = copier
        self.metrics = metrics
        self.states = [SlotState.FREE] * copier.num_slots
        self.in_flight = 0
        self.closed = False

    def _take(self, slot: int, want: SlotState, op: str) -> None:
        if not 0 <= slot < len(self.states):
            raise InvalidRequestError(f"{op}: slot {slot} out of range (the rank opened "
                                      f"{len(self.states)} slots)")
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

    def stage_in(self, job: Job, rank: int, req: p.StageIn) -> Awaitable[None]:
        self._take(req.slot, SlotState.FREE, "stage_in")
        shard = job.table.lookup(rank, [req.shard_id])[0]
        self._check_fits(shard.nbytes, req.shard_id)
        self.states[req.slot] = SlotState.COPYING
        return self._copy(job, rank, req.shard_id, req.slot, "r", SlotState.STAGED)

    def stage_out(self, job: Job, rank: int, req: p.StageOut) -> Awaitable[None]:
        self._take(req.slot, SlotState.FREE, "stage_out")
        shard = job.table.lookup(rank, [req.shard_id])[0]
        self._check_fits(req.nbytes, req.shard_id)
        if req.nbytes != shard.nbytes:
            raise InvalidRequestError(f"stage_out of {req.nbytes} B into shard "
                                      f"{req.shard_id!r} of {shard.nbytes} B", [req.shard_id])
        self.states[req.slot] = SlotState.COPYING
        return self._copy(job, rank, req.shard_id, req.slot, "w", SlotState.FREE)

    def slot_done(self, req: p.SlotDone) -> None:
        self._take(req.slot, SlotState.STAGED, "slot_done")
        self.states[req.slot] = SlotState.FREE
        self.copier.consumed(req.slot)

    async def _copy(self, job: Job, rank: int, shard_id: str, slot: int, mode: str,
                    after: SlotState) -> None:
        leases: dict[Shard, Lease] = {}
        try:
            placed = job.acquire(rank, [shard_id], mode, leases)
            if not isinstance(placed, p.Placed):
                placed = await placed
        except BaseException:
            self.states[slot] = SlotState.FREE
            raise
        arena = job.arena.slice(placed.offsets[0], placed.nbytes[0])
        if mode == "r":
            copy = self.copier.copy_in(slot, arena)
        else:
            copy = self.copier.copy_out(slot, arena)
        task = asyncio.ensure_future(copy)
        self.in_flight += 1
        # The lease goes back when the copy is done, also when this request is cancelled
        # (the client went away): the copy keeps running and still reads/writes its bytes.
        # Registered before shield()'s own callback, so the commit and the slot's new state
        # happen before the reply goes out (the rank acts on the reply at once).
        nbytes = placed.nbytes[0]
        task.add_done_callback(lambda done: self._copied(done, job, rank, shard_id, slot,
                                                         mode, after, leases, nbytes))
        await asyncio.shield(task)

    def _copied(self, task: asyncio.Future[None], job: Job, rank: int, shard_id: str, slot: int,
                mode: str, after: SlotState, leases: dict[Shard, Lease], nbytes: int) -> None:
        self.in_flight -= 1
        failed = task.cancelled() or task.exception() is not None
        if mode == "w":
            job.release(rank, [shard_id], not failed, leases, torn=failed)
        else:
            job.release(rank, [shard_id], False, leases)
        self.states[slot] = SlotState.FREE if failed else after
        if not failed:
            direction = "h2d" if mode == "r" else "d2h"
            self.metrics.copied.add((direction,), nbytes)
        if self.closed and not self.in_flight:
            self.copier.close()

    def close(self) -> None:
        """The session ended: unmap the slots once the copies in flight finished."""
        if self.closed:
            return
        self.closed = True
        if not self.in_flight:
            self.copier.close()


class DeviceCopiesService:
    """Daemon-wide: opens each session's staging and counts the paths sessions got."""

    def __init__(self) -> None:
        self.metrics = DeviceCopiesMetrics()

    def open(self, session: Session, req: p.StagingOpen) -> p.StagingOk:
        assert session.job is not None
        if req.arena_pinned in PINNED_OUTCOMES:
            self.metrics.arena_pinned.add((req.arena_pinned,))
        if session.staging is not None:
            raise InvalidRequestError("staging_open was already sent on this connection")
        if req.kind == "none":  # a report: the job copies on its ranks by configuration
            self.metrics.sessions.add(("rank", "configured"))
            return p.StagingOk(req.rid, "rank", "configured")
        try:
            copier = self._copier(session, req)
        except CopiesRefused as refused:
            self.metrics.sessions.add(("rank", refused.reason))
            log.warning("event=device_copies_fallback job=%s rank=%d reason=%s detail=%r",
                        session.job.name, session.rank, refused.reason, refused.message)
            return p.StagingOk(req.rid, "rank", refused.reason)
        session.staging = SessionStaging(copier, self.metrics)
        self.metrics.sessions.add(("daemon", "none"))
        log.info("event=device_copies_open job=%s rank=%d kind=%s device=%s slots=%d "
                 "slot_nbytes=%d", session.job.name, session.rank, copier.kind,
                 req.device_uuid, req.num_slots, req.slot_nbytes)
        return p.StagingOk(req.rid, "daemon", "")

    def _copier(self, session: Session, req: p.StagingOpen) -> DeviceCopier:
        if req.rank_reason:
            if req.rank_reason not in FALLBACK_REASONS:
                raise InvalidRequestError(f"rank_reason {req.rank_reason!r}: expected one of "
                                          f"{', '.join(FALLBACK_REASONS)}")
            raise CopiesRefused(req.rank_reason, "the rank cannot export its staging slots")
        if req.kind not in ("cuda", "twin"):
            raise InvalidRequestError(f"staging kind {req.kind!r}: expected cuda, twin or none")
        if not 1 <= req.num_slots <= MAX_STAGING_SLOTS or req.slot_nbytes < 1 \
                or req.num_slots * req.slot_nbytes > MAX_STAGING_NBYTES:
            raise InvalidRequestError(
                f"staging of {req.num_slots} x {req.slot_nbytes} B: need 1..{MAX_STAGING_SLOTS}"
                f" slots of >= 1 B, at most {MAX_STAGING_NBYTES} B in all")
        if req.ipc_offset < 0:
            raise InvalidRequestError(f"ipc_offset {req.ipc_offset}: must be >= 0")
        assert session.job is not None
        return open_copier(kind=req.kind, device_uuid=req.device_uuid, peer_pid=session.peer_pid,
                           peer_uid=session.peer_uid, staging_fd=req.staging_fd,
                           ipc_handle=req.ipc_handle,
                           ipc_offset=req.ipc_offset, event_handles=req.event_handles,
                           num_slots=req.num_slots, slot_nbytes=req.slot_nbytes,
                           arena=session.job.arena.view)


def _staging(session: Session) -> SessionStaging:
    staging = session.staging
    if staging is None:
        raise InvalidRequestError("send staging_open (and get path \"daemon\") before "
                                  "stage_in/stage_out/slot_done")
    return staging


def handlers(session: Session) -> dict[type, Callable[[Any], Any]]:
    """The session's handlers for the device-copy requests."""

    def staging_open(req: p.StagingOpen) -> p.StagingOk:
        service: DeviceCopiesService = session.daemon.device_copies
        return service.open(session, req)

    def stage_in(req: p.StageIn) -> Awaitable[None]:
        assert session.job is not None
        return _staging(session).stage_in(session.job, session.rank, req)

    def stage_out(req: p.StageOut) -> Awaitable[None]:
        assert session.job is not None
        return _staging(session).stage_out(session.job, session.rank, req)

    return {
        p.StagingOpen: staging_open,
        p.StageIn: stage_in,
        p.StageOut: stage_out,
        p.SlotDone: lambda req: _staging(session).slot_done(req),
    }


def session_closed(session: Session) -> None:
    """The session ended or left its job: its staging goes after the copies in flight."""
    staging = session.staging
    if staging is not None:
        session.staging = None
        staging.close()
