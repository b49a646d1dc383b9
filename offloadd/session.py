"""One connected rank: framing, authentication, hello, and dispatch of its requests.

A session is an ``asyncio.Protocol`` rather than a stream pair: frames are
cut out of ``data_received`` and answered inline when the operation needs no
IO, so a small request costs one decode, one table lookup and one write.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from offloadd import device_copies
from offloadd import protocol as p
from offloadd.batches import SLICE_IDS
from offloadd.errors import (
    BadFrameError,
    InternalError,
    InvalidRequestError,
    LimitExceededError,
    NoSessionError,
    OffloadError,
    PermissionDeniedError,
    VersionMismatchError,
)
from offloadd.shards import Lease, Shard

if TYPE_CHECKING:
    from offloadd.jobs import Job
    from offloadd.server import Daemon

log = logging.getLogger(__name__)
_PEERCRED = struct.Struct("3i")
_encode = msgspec.msgpack.Encoder().encode


def peer_credentials(transport: asyncio.BaseTransport) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a unix socket."""
    sock = transport.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def send_with_fd(transport: asyncio.BaseTransport, frame: bytes, fd: int) -> None:
    """Send ``frame`` with ``fd`` attached (SCM_RIGHTS) on the transport's socket.

    The transport object does not expose sendmsg, so we send on a duplicate of
    its descriptor. This is safe only because hello is the first reply: the
    transport has nothing buffered that our frame could overtake.
    """
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    try:
        sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    finally:
        sock.setblocking(False)  # the duplicate shares the file status flags with the transport
        sock.close()


class Session(asyncio.Protocol):
    """Server side of one client connection."""

    def __init__(self, daemon: Daemon, session_id: int) -> None:
        self.daemon = daemon
        self.session_id = session_id
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.job: Job | None = None
        self.rank = -1
        self.peer_pid = 0
        self.peer_uid = -1
        self.counted = False  # in the LimitGuard's session counts
        self.hello_timer: asyncio.TimerHandle | None = None
        self.leases: dict[Shard, Lease] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self.hello_pending = False
        """A new job's arena is being made: frames after the hello wait in the buffer."""
        self.handlers: dict[type, Callable[[Any], Any]] = {
            p.Alloc: self.on_alloc,
            p.Acquire: self.on_acquire,
            p.Release: self.on_release,
            p.Drop: self.on_drop,
            p.Prefetch: self.on_prefetch,
            p.StepBegin: self.on_step_begin,
            p.Flush: self.on_flush,
            p.Stats: self.on_stats,
            p.OptimizerStep: self.on_optimizer_step,
            p.CloseJob: self.on_close_job,
        }
        self.staging: device_copies.SessionStaging | None = None
        """Daemon-driven device copies into this rank's GPU staging slots, once opened."""
        self.staging_opening = False
        """A staging_open is being served (its copier opens off the loop)."""
        self.handlers.update(device_copies.handlers(self))

    # -- connection lifecycle -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        pid, uid, _gid = peer_credentials(transport)
        self.peer_pid, self.peer_uid = pid, uid
        if uid != 0 and uid not in self.daemon.config.allowed_uids:
            self.daemon.metrics.sessions_opened.add(("denied",))
            log.warning("event=peer_denied pid=%d uid=%d", pid, uid)
            self.fail_and_close(0, PermissionDeniedError(
                f"uid {uid} is not allowed; add it to allowed_uids in the daemon config"))
            return
        try:
            self.daemon.limits.session_opened(uid)
        except LimitExceededError as exc:
            log.warning("event=session_refused pid=%d uid=%d reason=%r", pid, uid, exc.message)
            self.fail_and_close(0, exc)
            return
        self.counted = True
        self.daemon.sessions.add(self)
        self.hello_timer = asyncio.get_running_loop().call_later(
            self.daemon.config.hello_timeout_s, self.hello_timed_out)

    def hello_timed_out(self) -> None:
        self.hello_timer = None
        if self.job is None and not self.closed:
            self.fail_and_close(0, self.daemon.limits.reject(
                "hello_timeout_s", f"no hello within {self.daemon.config.hello_timeout_s} s"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.daemon.sessions.discard(self)
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if self.counted:
            self.counted = False
            self.daemon.limits.session_closed(self.peer_uid)
        for task in self.tasks:
            task.cancel()
        device_copies.session_closed(self)
        if self.job is not None:
            freed = self.job.release_all(self.leases)
            self.job.num_sessions -= 1
            log.info("event=session_closed session=%d job=%s rank=%d leases_freed=%d",
                     self.session_id, self.job.name, self.rank, freed)
            self.daemon.lifecycle.detached(self.job)

    # Backpressure: a client that sends requests but never reads its replies would grow
    # our write buffer without bound; stop reading from it until it drains them.
    def pause_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def fail_and_close(self, rid: int, error: OffloadError) -> None:
        self.send(p.ErrorReply(rid, error.code.value, error.message, error.shard_ids))
        if self.transport is not None:
            self.transport.close()

    def send(self, reply: p.Reply) -> None:
        if self.transport is not None and not self.closed:
            payload = _encode(reply)
            self.transport.write(p.HEADER.pack(len(payload)) + payload)

    # -- framing ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        if not buffer:
            # Fast path: whole frames straight out of ``data``, no copy into the buffer.
            consumed = self.handle_frames(data)
            if consumed < len(data) and not self.closed:
                buffer += memoryview(data)[consumed:]
            return
        buffer += data
        with memoryview(buffer) as view:
            consumed = self.handle_frames(view)
        del buffer[:consumed]

    def handle_frames(self, data: bytes | memoryview) -> int:
        """Answer every complete frame in ``data``; returns how many bytes were consumed."""
        start, end = 0, len(data)
        unpack_from = p.HEADER.unpack_from
        while end - start >= p.HEADER_NBYTES and not self.closed and not self.hello_pending:
            (length,) = unpack_from(data, start)
            if length > p.MAX_FRAME_NBYTES:
                self.daemon.metrics.bad_frames.add(("oversize",))
                self.fail_and_close(0, BadFrameError(
                    f"frame length {length} exceeds {p.MAX_FRAME_NBYTES} bytes; closing"))
                self.closed = True
                return end
            if length > self.daemon.config.max_partial_frame_nbytes:
                self.fail_and_close(0, self.daemon.limits.reject(
                    "max_partial_frame_nbytes", f"a frame of {length} bytes; closing"))
                self.closed = True
                return end
            stop = start + p.HEADER_NBYTES + length
            if stop > end:
                break
            self.handle_frame(data[start + p.HEADER_NBYTES : stop])
            start = stop
        return start

    def handle_frame(self, payload: bytes | memoryview) -> None:
        started = time.perf_counter()
        try:
            request = p.request_decoder.decode(payload)
        except p.DECODE_ERRORS as exc:
            self.daemon.metrics.bad_frames.add(("decode",))
            self.send(p.ErrorReply(p.peek_rid(payload), "bad_frame",
                                   f"cannot decode request: {exc}"))
            return
        finally:
            if isinstance(payload, memoryview):
                payload.release()  # the buffer cannot shrink while a view of it lives
        self.dispatch(request, started)

    # -- dispatch -------------------------------------------------------------------

    def dispatch(self, request: p.Request, started: float) -> None:
        kind = type(request)
        op = _OP_NAMES.get(kind) or _op_name(kind)
        try:
            ids = getattr(request, "ids", None)
            if ids is not None:
                self.daemon.limits.check_ids(len(ids))
            handler = self.handlers.get(kind) if self.job is not None else None
            if handler is not None:  # the hot path: a data-plane request of a live session
                result: Any = handler(request)
            elif isinstance(request, p.Hello):
                self.on_hello(request)  # replies itself: the arena fd rides on its reply
                self.daemon.metrics.observe_request(op, "ok", time.perf_counter() - started)
                return
            elif isinstance(request, p.NodeStatus):  # admin query: uid checked at connect
                result = self.on_node_status(request)
            elif self.job is None:
                raise NoSessionError("send hello before any other request")
            else:
                result = self.handlers[type(request)](request)
        except OffloadError as exc:
            self.reply_error(request.rid, op, exc, started)
            return
        except Exception as exc:  # a daemon bug must cost one request, not the daemon
            log.exception("event=handler_failed op=%s", op)
            self.reply_error(request.rid, op, InternalError(f"{op} failed: {exc!r}"), started)
            return
        if result is None or isinstance(result, p.Reply):
            self.reply_ok(request.rid, op, result, started)
        else:
            self.spawn(self.finish_async(request.rid, op, result, started))

    def reply_ok(self, rid: int, op: str, reply: p.Reply | None, started: float) -> None:
        if reply is None:
            reply = p.Ok(rid)
        else:
            reply.rid = rid
        if self.transport is not None and not self.closed:
            payload = _encode(reply)
            self.transport.write(p.HEADER.pack(len(payload)) + payload)
        self.daemon.metrics.observe_request(op, "ok", time.perf_counter() - started)

    def reply_error(self, rid: int, op: str, error: OffloadError, started: float) -> None:
        self.send(p.ErrorReply(rid, error.code.value, error.message, error.shard_ids))
        self.daemon.metrics.observe_request(op, error.code.value, time.perf_counter() - started)

    async def finish_async(self, rid: int, op: str, pending: Awaitable[p.Reply | None],
                           started: float) -> None:
        try:
            reply = await pending
        except OffloadError as exc:
            self.reply_error(rid, op, exc, started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("event=handler_failed op=%s", op)
            self.reply_error(rid, op, InternalError(f"{op} failed: {exc!r}"), started)
        else:
            self.reply_ok(rid, op, reply, started)

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- handlers -------------------------------------------------------------------

    def on_hello(self, req: p.Hello) -> None:
        if self.job is not None:
            raise InvalidRequestError("hello was already sent on this connection")
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"client speaks protocol {req.protocol_version}, daemon speaks "
                f"{p.PROTOCOL_VERSION}; install matching offloadd versions")
        check_identity(req)
        self.daemon.auth.check_hello(req.job, self.peer_uid, req.job_secret)
        job = self.daemon.jobs.jobs.get(req.job)
        if job is None:
            self.hello_pending = True
            if self.transport is not None:
                self.transport.pause_reading()
            self.spawn(self.hello_after_arena(req))
            return
        self.finish_hello(req, job)

    async def hello_after_arena(self, req: p.Hello) -> None:
        """Hello of a job whose arena is new: made off the loop, then answered as usual."""
        try:
            job = await self.daemon.open_job_async(req.job, req.arena_nbytes)
            if not self.closed:
                self.finish_hello(req, job)
        except OffloadError as exc:
            self.reply_error(req.rid, "hello", exc, time.perf_counter())
        except Exception as exc:
            log.exception("event=handler_failed op=hello")
            self.reply_error(req.rid, "hello", InternalError(f"hello failed: {exc!r}"),
                             time.perf_counter())
        self.hello_pending = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
            if self.buffer:
                self.data_received(b"")  # requests pipelined behind the hello

    def finish_hello(self, req: p.Hello, job: Job) -> None:
        # Checked again: another uid may have claimed a new job while its arena was made.
        self.daemon.auth.check_hello(req.job, self.peer_uid, req.job_secret)
        self.daemon.auth.claim(req.job, self.peer_uid, req.job_secret)
        self.job, self.rank = job, req.rank
        job.num_sessions += 1
        self.daemon.lifecycle.attached(job)
        if self.hello_timer is not None:
            self.hello_timer.cancel()
            self.hello_timer = None
        self.daemon.metrics.sessions_opened.add(("ok",))
        reply = p.HelloOk(req.rid, p.PROTOCOL_VERSION, job.arena.nbytes, self.session_id,
                          os.getpid())
        payload = _encode(reply)
        assert self.transport is not None
        send_with_fd(self.transport, p.HEADER.pack(len(payload)) + payload, job.arena.fd)
        log.info("event=session_opened session=%d job=%s rank=%d pid=%d arena_nbytes=%d",
                 self.session_id, req.job, req.rank, self.peer_pid, job.arena.nbytes)

    def on_alloc(self, req: p.Alloc) -> p.Reply | Awaitable[p.Reply]:
        assert self.job is not None
        self.daemon.limits.check_new_shards(self.job, self.rank, req.ids)
        return self.job.alloc(self.rank, req.ids, req.nbytes, req.dtypes)

    def on_acquire(self, req: p.Acquire) -> p.Reply | Awaitable[p.Reply]:
        assert self.job is not None
        if req.create_nbytes is not None:
            self.daemon.limits.check_new_shards(self.job, self.rank, req.ids)
            dtypes = req.create_dtypes or ["uint8"] * len(req.ids)
            return self.job.alloc(self.rank, req.ids, req.create_nbytes, dtypes,
                                  self.leases, req.mode)
        return self.job.acquire(self.rank, req.ids, req.mode, self.leases)

    def on_release(self, req: p.Release) -> Awaitable[None] | None:
        assert self.job is not None
        return self.job.release(self.rank, req.ids, req.dirty, self.leases, torn=req.torn)

    def on_drop(self, req: p.Drop) -> Awaitable[None] | None:
        assert self.job is not None
        return self.job.drop(self.rank, req.ids)

    def on_prefetch(self, req: p.Prefetch) -> None:
        assert self.job is not None
        self.daemon.limits.check_prefetch(self.job, len(req.ids))
        self.job.prefetch(self.rank, req.ids, req.deadline_s)

    def on_step_begin(self, req: p.StepBegin) -> None:
        assert self.job is not None
        self.job.step_begin(self.rank)

    async def on_flush(self, req: p.Flush) -> p.Reply:
        assert self.job is not None
        persisted = await self.job.flush(req.tag_name)
        return p.StatsOk(req.rid, {"persisted_shards": persisted})

    def on_stats(self, req: p.Stats) -> p.Reply | Awaitable[p.Reply]:
        job = self.job
        assert job is not None
        if len(job.table.shards) > SLICE_IDS:  # counted a slice per loop turn
            return self.stats_reply(req, job.name, job.stats_sliced())
        stats = job.stats()
        stats.update(self.daemon.node_stats())
        stats["rank"] = self.rank
        stats["job"] = job.name
        return p.StatsOk(req.rid, stats)

    async def stats_reply(self, req: p.Stats, name: str,
                          pending: Awaitable[dict[str, object]]) -> p.Reply:
        stats = await pending
        stats.update(self.daemon.node_stats())
        stats["rank"] = self.rank
        stats["job"] = name
        return p.StatsOk(req.rid, stats)

    def on_node_status(self, req: p.NodeStatus) -> p.Reply | Awaitable[p.Reply]:
        if self.hello_timer is not None:  # an admin connection: it never says hello
            self.hello_timer.cancel()
            self.hello_timer = None
        auth, uid = self.daemon.auth, self.peer_uid
        visible = [job for name, job in list(self.daemon.jobs.jobs.items())
                   if auth.visible(name, uid)]
        if sum(len(job.table.shards) for job in visible) > SLICE_IDS:
            return self.node_status_sliced(req, visible)
        return self.node_status_reply(req, {job.name: job.stats() for job in visible})

    async def node_status_sliced(self, req: p.NodeStatus, visible: list[Job]) -> p.Reply:
        """Each job's per-shard counts a slice per loop turn (offloadd.batches)."""
        return self.node_status_reply(req, {job.name: await job.stats_sliced()
                                            for job in visible})

    def node_status_reply(self, req: p.NodeStatus, jobs: dict[str, object]) -> p.Reply:
        auth, uid = self.daemon.auth, self.peer_uid
        swap_dirs = list(self.daemon.config.swap_dirs)
        return p.StatsOk(req.rid, {"node": self.daemon.node_stats(), "jobs": jobs,
                                   "swap_dirs": swap_dirs, "scope": auth.scope(uid)})

    def on_close_job(self, req: p.CloseJob) -> None:
        job = self.job
        assert job is not None
        # A finished task leaves self.tasks a loop turn after its reply: count the pending.
        in_flight = sum(1 for task in self.tasks if not task.done())
        if in_flight:  # their leases would land on a job that is being freed
            raise InvalidRequestError(
                f"close_job with {in_flight} request(s) of this session in flight; "
                "wait for their replies first")
        device_copies.session_closed(self)
        job.release_all(self.leases)
        job.num_sessions -= 1
        self.job = None
        log.info("event=close_job session=%d job=%s rank=%d", self.session_id, job.name,
                 self.rank)
        self.daemon.lifecycle.close_requested(job)

    def on_optimizer_step(self, req: p.OptimizerStep) -> Awaitable[None]:
        assert self.job is not None
        return self.daemon.optimizer.step(self.job, self.rank, req)


_OP_NAMES: dict[type, str] = {}


def _op_name(kind: type) -> str:
    """The wire tag of a request type (the metrics' ``op`` label), cached per type."""
    name = _OP_NAMES[kind] = kind.__struct_config__.tag  # type: ignore[attr-defined]
    return name


def check_identity(req: p.Hello) -> None:
    if not req.job or len(req.job) > 128 or "/" in req.job or req.job.startswith("."):
        raise InvalidRequestError(f"job name must be 1..128 chars without '/', got {req.job!r}")
    if req.world_size < 1 or not 0 <= req.rank < req.world_size:
        raise InvalidRequestError(
            f"need 0 <= rank < world_size, got rank={req.rank} world_size={req.world_size}")
    if req.local_rank < 0 or req.arena_nbytes < 0:
        raise InvalidRequestError("local_rank and arena_nbytes must be >= 0")
