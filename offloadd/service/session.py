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
from typing import Any, Protocol

import msgspec

from offloadd import protocol as p
from offloadd.compute.optimizer import OptimizerService
from offloadd.config import DaemonConfig
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
from offloadd.memory.shards import Lease, Shard
from offloadd.metrics import DaemonMetrics, Histogram
from offloadd.service import device_copies, node_view
from offloadd.service.auth import JobAuthority
from offloadd.service.batches import SLICE_IDS
from offloadd.service.jobs import Job
from offloadd.service.lifecycle import JobLifecycle
from offloadd.service.limits import LimitGuard
from offloadd.service.registry import JobRegistry

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


class Daemon(Protocol):
    """What a session uses of its daemon (``offloadd.service.server.Daemon``, which makes the
    sessions): config and limits, metrics, owners, jobs and their lifecycle, the services."""

    config: DaemonConfig
    metrics: DaemonMetrics
    limits: LimitGuard
    auth: JobAuthority
    jobs: JobRegistry
    lifecycle: JobLifecycle
    optimizer: OptimizerService
    device_copies: device_copies.DeviceCopiesService
    sessions: set[Session]
    swap: Any
    """The swap space (``offloadd.swap.nvme.SwapSpace``), or None without --swap-dir."""

    async def open_job_async(self, name: str, arena_nbytes: int) -> Job: ...

    def node_stats(self) -> dict[str, object]: ...


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
        self.frame_timer: asyncio.TimerHandle | None = None
        """Runs while a partial frame is buffered: the frame must arrive in frame_timeout_s."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop of the connection (its timers run there); None until connection_made."""
        self.leases: dict[Shard, Lease] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self.hello_pending = False
        """A new job's arena is being made: frames after the hello wait in the buffer."""
        self.held = False
        """Frames wait in the buffer, the socket unread: the client does not read its replies
        (writing paused) or ``max_requests_in_flight`` requests are in flight."""
        self.writing_paused = False
        self.in_flight = 0
        self.max_ids = daemon.config.max_ids_per_request
        self.max_frame_nbytes = min(p.MAX_FRAME_NBYTES, daemon.config.max_partial_frame_nbytes)
        self.pending_nbytes = 0
        """Bytes of ``buffer`` counted against the uid (LimitGuard.pending_changed)."""
        self.reply_nbytes = 0
        """Reply bytes in the transport's buffer counted against the uid (``count_replies``)."""
        self.replies_capped = False
        """The uid's buffered bytes passed its limit while this connection held replies: its
        transport pauses writing (and so reading) at any reply byte it cannot send."""
        self.status_pending = False
        """A node_status is being answered: the connection's next frame waits for it."""
        self.drain_waiters: list[asyncio.Future[None]] = []
        """Replies not yet built, waiting for the client to read (``writable``)."""
        self.staging: device_copies.SessionStaging | None = None
        """Daemon-driven device copies into this rank's GPU staging slots, once opened."""
        self.staging_opening = False
        """A staging_open is being served (its copier opens off the loop)."""
        handlers: dict[type, Callable[[Any], Any]] = {
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
            p.StagingOpen: self.on_staging_open,
            **device_copies.handlers(self),
        }
        self.routes: dict[type, Route] = {
            kind: (handler, _op_name(kind), daemon.metrics.ok_histogram(_op_name(kind)))
            for kind, handler in handlers.items()}
        """The data-plane requests of a live session: handler, op label and the histogram an
        ok reply is observed in, found with one look-up per request."""

    # -- connection lifecycle -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.loop = asyncio.get_running_loop()
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
        self.arm_hello_timer()

    def arm_hello_timer(self) -> None:
        """(Re)start the deadline of a connection without a job: its hello, or an admin
        connection's next node_status."""
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if self.loop is not None:
            self.hello_timer = self.loop.call_later(
                self.daemon.config.hello_timeout_s, self.hello_timed_out)

    def hello_timed_out(self) -> None:
        self.hello_timer = None
        if self.hello_pending:  # the hello came in time; its new arena is being made
            return
        if self.job is None and not self.closed:
            timeout_s = self.daemon.config.hello_timeout_s
            self.fail_and_close(0, self.daemon.limits.reject(
                "hello_timeout_s", f"no hello within {timeout_s} s (an admin connection is "
                f"closed {timeout_s} s after its last node_status)"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.daemon.sessions.discard(self)
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if self.frame_timer is not None:
            self.frame_timer.cancel()
        if self.counted:
            self.counted = False
            self.daemon.limits.session_closed(self.peer_uid)
        if self.pending_nbytes:
            self.daemon.limits.pending_changed(self.peer_uid, -self.pending_nbytes)
            self.pending_nbytes = 0
        if self.reply_nbytes:
            self.daemon.limits.replies_changed(self.peer_uid, -self.reply_nbytes)
            self.reply_nbytes = 0
        self.buffer.clear()
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
    # our write buffer (and our loop time) without bound. Once the transport's buffer
    # passes its high-water mark, no frame is dispatched and the socket is not read
    # until the client drains its replies; frames already received wait in the buffer.
    # Replies still to be built for it (node_status) wait too (``writable``), and the
    # buffered replies count against the uid's max_pending_nbytes_per_uid with its
    # buffered requests: past it, each of the uid's connections holding replies stops
    # at its next unsent byte instead of at the high-water mark (``count_replies``), so
    # many connections of one uid cannot each buffer a high-water mark's worth.
    def pause_writing(self) -> None:
        self.writing_paused = True
        self.count_replies()
        self.hold()

    def resume_writing(self) -> None:
        self.writing_paused = False
        self.count_replies()
        waiters, self.drain_waiters = self.drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.release_hold()

    def count_replies(self) -> None:
        """Charge the replies buffered in the transport (written, not yet taken by the
        client) to the uid; past the uid's limit, stop at the next reply byte not sent."""
        transport = self.transport
        if transport is None or self.closed:
            return
        nbytes = transport.get_write_buffer_size()
        over = self.daemon.limits.replies_changed(self.peer_uid, nbytes - self.reply_nbytes)
        self.reply_nbytes = nbytes
        if transport.is_closing():
            return
        if over and nbytes and not self.replies_capped:
            self.replies_capped = True
            transport.set_write_buffer_limits(high=0)  # pauses writing (and reading) now
        elif self.replies_capped and not over and not self.writing_paused:
            self.replies_capped = False
            transport.set_write_buffer_limits()  # the default high-water mark again

    async def writable(self) -> None:
        """Return once the client takes its replies (writing is not paused)."""
        while self.writing_paused and not self.closed:
            assert self.loop is not None
            waiter = self.loop.create_future()
            self.drain_waiters.append(waiter)
            await waiter

    def hold(self) -> None:
        self.held = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def release_hold(self) -> None:
        """Dispatch again once replies drain and requests in flight are under the limit."""
        if (not self.held or self.writing_paused or self.closed or self.status_pending
                or self.in_flight >= self.daemon.config.max_requests_in_flight):
            return
        self.held = False
        if self.hello_pending or self.transport is None or self.transport.is_closing():
            return  # hello_after_arena resumes reading
        self.transport.resume_reading()
        if self.buffer:
            self.data_received(b"")

    def fail_and_close(self, rid: int, error: OffloadError) -> None:
        self.send(p.ErrorReply(rid, error.code.value, error.message, error.shard_ids))
        if self.transport is None:
            return
        if self.writing_paused:  # close() would keep its unread replies until it reads
            self.transport.abort()
        else:
            self.transport.close()

    def send(self, reply: p.Reply) -> None:
        if self.transport is not None and not self.closed:
            payload = _encode(reply)
            self.transport.write(p.HEADER.pack(len(payload)) + payload)
            self.count_replies()

    # -- framing ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        if not buffer:
            # Fast path: whole frames straight out of ``data``, no copy into the buffer.
            consumed = self.handle_frames(data)
            if consumed < len(data) and not self.closed:
                buffer += memoryview(data)[consumed:]
                self.count_pending()
                if not self.closed:
                    self.frame_started()
            return
        buffer += data
        with memoryview(buffer) as view:
            consumed = self.handle_frames(view)
        del buffer[:consumed]
        self.count_pending()
        if consumed:  # the frame the timer ran for is done; another may have begun
            if buffer:
                self.frame_started()
            elif self.frame_timer is not None:
                self.frame_timer.cancel()
                self.frame_timer = None

    # A frame is timed from its first byte, not from its last: a client that trickles a
    # byte now and then must not hold max_partial_frame_nbytes of our memory for ever.
    def frame_started(self) -> None:
        if self.frame_timer is not None:
            self.frame_timer.cancel()
        if self.loop is not None:  # None: frames fed without a connection (protocol tests)
            self.frame_timer = self.loop.call_later(
                self.daemon.config.frame_timeout_s, self.frame_timed_out)

    def frame_timed_out(self) -> None:
        self.frame_timer = None
        if self.closed or not self.buffer:
            return
        if self.daemon_holds_frames():
            self.frame_started()  # the wait is ours, not the client's: look again later
            return
        self.fail_and_close(0, self.daemon.limits.reject(
            "frame_timeout_s", f"a request frame still incomplete after "
            f"{self.daemon.config.frame_timeout_s} s ({len(self.buffer)} bytes buffered); "
            "closing"))

    def daemon_holds_frames(self) -> bool:
        """Whether the buffer waits on the daemon: a hello's arena is being made, reading is
        paused (backpressure), or a whole frame is buffered but not yet dispatched."""
        transport = self.transport
        if self.hello_pending or (transport is not None and not transport.is_reading()):
            return True
        buffer = self.buffer
        if len(buffer) < p.HEADER_NBYTES:
            return False
        (length,) = p.HEADER.unpack_from(buffer)
        return len(buffer) >= p.HEADER_NBYTES + length

    def count_pending(self) -> None:
        """Charge the buffered request bytes to the uid; over its limit, close."""
        delta = len(self.buffer) - self.pending_nbytes
        if not delta or self.closed:
            return
        try:
            self.daemon.limits.pending_changed(self.peer_uid, delta)
        except LimitExceededError as exc:
            self.buffer.clear()
            self.fail_and_close(0, exc)
            self.closed = True
            return
        self.pending_nbytes += delta

    def handle_frames(self, data: bytes | memoryview) -> int:
        """Answer every complete frame in ``data``; returns how many bytes were consumed."""
        start, end = 0, len(data)
        unpack_from = p.HEADER.unpack_from
        while (end - start >= p.HEADER_NBYTES and not self.closed and not self.hello_pending
               and not self.held):
            (length,) = unpack_from(data, start)
            if length > self.max_frame_nbytes:
                self.refuse_frame(length)
                return end
            stop = start + p.HEADER_NBYTES + length
            if stop > end:
                break
            self.handle_frame(data[start + p.HEADER_NBYTES : stop])
            start = stop
        return start

    def refuse_frame(self, length: int) -> None:
        if length > p.MAX_FRAME_NBYTES:
            self.daemon.metrics.bad_frames.add(("oversize",))
            self.fail_and_close(0, BadFrameError(
                f"frame length {length} exceeds {p.MAX_FRAME_NBYTES} bytes; closing"))
        else:
            self.fail_and_close(0, self.daemon.limits.reject(
                "max_partial_frame_nbytes", f"a frame of {length} bytes; closing"))
        self.closed = True

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
        route = self.routes.get(type(request)) if self.job is not None else None
        if route is None:
            self.dispatch_control(request, started)
            return
        handler, op, ok_seconds = route  # the hot path: a data-plane request of a live session
        try:
            ids = getattr(request, "ids", None)
            if ids is not None and len(ids) > self.max_ids:
                self.daemon.limits.check_ids(len(ids))
            result: Any = handler(request)
        except Exception as exc:
            self.reply_failed(request.rid, op, exc, started)
            return
        if result is not None and not isinstance(result, p.Reply):
            self.spawn(self.finish_async(request.rid, op, result, started))
            return
        transport = self.transport
        if transport is not None and not self.closed:
            reply = p.Ok(request.rid) if result is None else result
            reply.rid = request.rid
            payload = _encode(reply)
            transport.write(p.HEADER.pack(len(payload)) + payload)  # one write per reply
            if transport.get_write_buffer_size() != self.reply_nbytes:  # the client lags
                self.count_replies()
        ok_seconds.observe(time.perf_counter() - started)

    def dispatch_control(self, request: p.Request, started: float) -> None:
        """Hello, node_status, and any request of a connection without a job."""
        op = _op_name(type(request))
        try:
            if isinstance(request, p.Hello):
                self.on_hello(request)  # replies itself: the arena fd rides on its reply
                self.daemon.metrics.observe_request(op, "ok", time.perf_counter() - started)
                return
            if not isinstance(request, p.NodeStatus):  # admin query: uid checked at connect
                raise NoSessionError("send hello before any other request")
            result = self.on_node_status(request)
        except Exception as exc:
            self.reply_failed(request.rid, op, exc, started)
            return
        if isinstance(result, p.Reply):
            self.reply_ok(request.rid, op, result, started)
            return
        # One node_status at a time per connection: its reply is built only once the
        # client reads (``writable``), so a pipeline of them would only park tasks here.
        self.status_pending = True
        self.spawn(self.finish_status(request.rid, op, result, started))
        self.hold()

    async def finish_status(self, rid: int, op: str, pending: Awaitable[p.Reply | None],
                            started: float) -> None:
        try:
            await self.finish_async(rid, op, pending, started)
        finally:
            self.status_pending = False

    def reply_ok(self, rid: int, op: str, reply: p.Reply | None, started: float) -> None:
        if reply is None:
            reply = p.Ok(rid)
        else:
            reply.rid = rid
        self.send(reply)
        self.daemon.metrics.observe_request(op, "ok", time.perf_counter() - started)

    def reply_failed(self, rid: int, op: str, exc: Exception, started: float) -> None:
        """Reply a handler's exception: an OffloadError as itself, anything else (a daemon
        bug, which must cost one request, not the daemon) logged and sent as internal.
        Called from the ``except`` block, so the log carries the traceback."""
        if not isinstance(exc, OffloadError):
            log.exception("event=handler_failed op=%s", op)
            exc = InternalError(f"{op} failed: {exc!r}")
        self.reply_error(rid, op, exc, started)

    def reply_error(self, rid: int, op: str, error: OffloadError, started: float) -> None:
        self.send(p.ErrorReply(rid, error.code.value, error.message, error.shard_ids))
        self.daemon.metrics.observe_request(op, error.code.value, time.perf_counter() - started)

    async def finish_async(self, rid: int, op: str, pending: Awaitable[p.Reply | None],
                           started: float) -> None:
        try:
            reply = await pending
        except Exception as exc:  # CancelledError is a BaseException: it propagates
            self.reply_failed(rid, op, exc, started)
        else:
            self.reply_ok(rid, op, reply, started)

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.task_done)
        self.in_flight += 1
        if self.in_flight >= self.daemon.config.max_requests_in_flight:
            self.hold()

    def task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.in_flight -= 1
        if self.held:
            self.release_hold()

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
            self.daemon.limits.new_job_starting(self.peer_uid, req.job)
            self.hello_pending = True
            if self.transport is not None:
                self.transport.pause_reading()
            self.spawn(self.hello_after_arena(req))
            return
        self.finish_hello(req, job)

    async def hello_after_arena(self, req: p.Hello) -> None:
        """Hello of a job whose arena is new: made off the loop, then answered as usual."""
        lifecycle = self.daemon.lifecycle
        lifecycle.hello_began(req.job)
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
        finally:
            lifecycle.hello_ended(req.job)
            self.daemon.limits.new_job_done(self.peer_uid, req.job)
        self.hello_pending = False
        if self.job is None and self.hello_timer is None and not self.closed:
            self.arm_hello_timer()  # it fired while the arena was made: a failed hello may retry
        if self.transport is not None and not self.closed and not self.held:
            self.transport.resume_reading()
            if self.buffer:
                self.data_received(b"")  # requests pipelined behind the hello

    def finish_hello(self, req: p.Hello, job: Job) -> None:
        # Checked again: another uid may have claimed a new job while its arena was made.
        self.daemon.auth.check_hello(req.job, self.peer_uid, req.job_secret)
        self.daemon.limits.check_rank(job, req.rank)
        self.daemon.auth.claim(req.job, self.peer_uid, req.job_secret)
        self.daemon.limits.claim_job(job, self.peer_uid)
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

    def admit_new_shards(self, job: Job, ids: list[str]) -> None:
        """Before ``ids`` are created: the per-job and per-uid shard limits, and the Adam
        kernel's load once optimizer state appears (``OptimizerService.warm_for``)."""
        self.daemon.limits.check_new_shards(job, self.rank, ids)
        self.daemon.limits.check_uid_shards(job, ids)
        self.daemon.optimizer.warm_for(ids)

    def on_alloc(self, req: p.Alloc) -> p.Reply | Awaitable[p.Reply]:
        assert self.job is not None
        self.admit_new_shards(self.job, req.ids)
        return self._stage_ahead(self.job.alloc(self.rank, req.ids, req.nbytes, req.dtypes))

    def on_acquire(self, req: p.Acquire) -> p.Reply | Awaitable[p.Reply]:
        assert self.job is not None
        if req.create_nbytes is not None:
            self.admit_new_shards(self.job, req.ids)
            dtypes = req.create_dtypes or ["uint8"] * len(req.ids)
            return self._stage_ahead(self.job.alloc(self.rank, req.ids, req.create_nbytes,
                                                    dtypes, self.leases, req.mode))
        return self.job.acquire(self.rank, req.ids, req.mode, self.leases)

    def _stage_ahead(self, placed: p.Reply | Awaitable[p.Reply]
                     ) -> p.Reply | Awaitable[p.Reply]:
        """Once ``placed`` (an alloc's reply: a large batch is made in slices, later)
        has created its shards, they may have outgrown the job's arena: the swap tier
        readies its staging for the swap IO to come (``SwapSpace.stage_ahead``)."""
        swap, job = self.daemon.swap, self.job
        if swap is None or job is None:
            return placed
        if isinstance(placed, p.Reply):
            swap.stage_ahead(job.table)
            return placed

        async def then() -> p.Reply:
            reply = await placed
            swap.stage_ahead(job.table)
            return reply

        return then()

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
        return p.StatsOk(req.rid, node_view.job_stats(self.daemon, self.peer_uid, job.name,
                                                      job.stats(), self.rank))

    async def stats_reply(self, req: p.Stats, name: str,
                          pending: Awaitable[dict[str, object]]) -> p.Reply:
        stats = await pending
        return p.StatsOk(req.rid, node_view.job_stats(self.daemon, self.peer_uid, name, stats,
                                                      self.rank))

    def on_node_status(self, req: p.NodeStatus) -> p.Reply | Awaitable[p.Reply]:
        if self.job is None:  # an admin connection: it never says hello, but may not idle
            self.arm_hello_timer()
        delay_s = self.daemon.limits.node_status_delay_s(
            self.peer_uid, asyncio.get_running_loop().time())
        if delay_s > 0:  # each uid's answers are spaced: status is O(shards) of the node
            return self.node_status_later(req, delay_s)
        return self.node_status_now(req)

    async def node_status_later(self, req: p.NodeStatus, delay_s: float) -> p.Reply:
        await asyncio.sleep(delay_s)
        await self.writable()  # built when the client reads: not kept here meanwhile
        reply = self.node_status_now(req)
        return reply if isinstance(reply, p.Reply) else await reply

    def node_status_now(self, req: p.NodeStatus) -> p.Reply | Awaitable[p.Reply]:
        uid = self.peer_uid
        visible = node_view.visible_jobs(self.daemon, self.daemon.jobs.jobs, uid)
        if sum(len(job.table.shards) for job in visible) > SLICE_IDS:
            return self.node_status_sliced(req, visible)
        return p.StatsOk(req.rid, node_view.node_status(
            self.daemon, uid, {job.name: job.stats() for job in visible}))

    async def node_status_sliced(self, req: p.NodeStatus, visible: list[Job]) -> p.Reply:
        """Each job's per-shard counts a slice per loop turn (offloadd.service.batches)."""
        jobs = {job.name: await job.stats_sliced() for job in visible}
        return p.StatsOk(req.rid, node_view.node_status(self.daemon, self.peer_uid, jobs))

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
        self.arm_hello_timer()  # a connection without a job: a new hello, or it is closed

    def on_staging_open(self, req: p.StagingOpen) -> Awaitable[p.StagingOk]:
        return self.daemon.device_copies.open(self, req)

    def on_optimizer_step(self, req: p.OptimizerStep) -> Awaitable[None]:
        assert self.job is not None
        limits, uid = self.daemon.limits, self.peer_uid
        limits.step_queued(uid)
        # A task, not a coroutine: its done callback uncounts it even if it never starts.
        step = asyncio.ensure_future(self.daemon.optimizer.step(self.job, self.rank, req))
        step.add_done_callback(lambda _step: limits.step_done(uid))
        return step


Route = tuple[Callable[[Any], Any], str, Histogram]
"""A data-plane request's handler, op label and ok-duration histogram (Session.routes)."""


def _op_name(kind: type) -> str:
    """The wire tag of a request type (the metrics' ``op`` label)."""
    return kind.__struct_config__.tag  # type: ignore[attr-defined]


MAX_JOB_NAME_NBYTES = 128
"""A job name is a directory name, a memfd name and a log field: short, and plain."""


def check_job_name(job: str) -> None:
    """Refuse a job name that could not be a directory, memfd or log field as it is.

    Hazard: the name is written into log lines (``job=%s``) and paths; a newline or
    control character would forge log records, a space a log field, and a long
    multi-byte name passes a character count but not the kernel's name limits.
    """
    if (not job or len(job.encode(errors="replace")) > MAX_JOB_NAME_NBYTES or "/" in job
            or " " in job or job.startswith(".") or not job.isprintable()):
        shown = job[:64] + ("..." if len(job) > 64 else "")
        raise InvalidRequestError(
            f"job name must be 1..{MAX_JOB_NAME_NBYTES} bytes of printable characters without "
            f"spaces or '/' and not start with '.', got {shown!r}; pick another job name")


def check_identity(req: p.Hello) -> None:
    check_job_name(req.job)
    if req.world_size < 1 or not 0 <= req.rank < req.world_size:
        raise InvalidRequestError(
            f"need 0 <= rank < world_size, got rank={req.rank} world_size={req.world_size}")
    if req.local_rank < 0 or req.arena_nbytes < 0:
        raise InvalidRequestError("local_rank and arena_nbytes must be >= 0")
