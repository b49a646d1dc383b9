"""``OffloadClient``: the blocking client, one per rank, over a blocking unix socket.

Requests are serialised on a lock; optimizer steps (and ``request_async``) may be in
flight while other calls run, their replies parked by request id until waited for.
Imports the rest of the client package; nothing in the package imports it but
``trainer.client`` itself.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections.abc import Iterable
from typing import Any

from offloadd import protocol as p
from offloadd.errors import DaemonUnavailableError, ReplyTimeoutError
from trainer.client.core import ClientCore
from trainer.client.leases import LeaseGroup, ShardLease
from trainer.client.session import Arena, hello_request, open_session
from trainer.client.wire import as_bytes, as_list, check_reply, reply_timeout_error


def set_reply_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bound each send and recv by ``seconds`` with SO_SNDTIMEO/SO_RCVTIMEO (the kernel
    answers EAGAIN) on a blocking socket: Python's own ``settimeout`` would poll() before
    every send and recv, two more system calls per request."""
    sock.settimeout(None)
    if seconds is None:
        return
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _holds_frame(buffer: bytearray) -> bool:
    """A whole frame is in ``buffer``."""
    return (len(buffer) >= p.HEADER_NBYTES
            and len(buffer) >= p.HEADER_NBYTES + p.HEADER.unpack_from(buffer)[0])


class StepHandle:
    """An optimizer step in flight; ``wait()`` blocks until the daemon has applied it."""

    def __init__(self, client: OffloadClient, rid: int) -> None:
        self._client, self._rid, self._done = client, rid, False
        self.reply: p.Reply | None = None
        """The reply, once ``wait()`` read it."""

    def wait(self) -> None:
        if not self._done:
            self._done = True
            self.reply = self._client._wait_reply(self._rid)

    def done(self) -> bool:
        """Waited for, or its reply already read (by another call or ``poll_replies``)."""
        return self._done or self._rid in self._client._inbox


class OffloadClient(ClientCore):
    """Blocking client, one per rank (thread-safe: calls are serialised on a lock)."""

    def __init__(self, sock: socket.socket, hello: p.HelloOk, arena: Arena, job: str,
                 rank: int) -> None:
        super().__init__(hello, arena, job, rank)
        self._sock = sock
        self._readable = select.poll()
        """Polls the socket for a reply (``poll``, not ``select``: a rank's fds can number
        past select's 1024, and a socket numbered there would make it raise)."""
        self._readable.register(sock, select.POLLIN)
        self._lock = threading.RLock()
        self._inbox: dict[int, p.Reply] = {}
        self._rbuf = bytearray()
        self.reply_timeout_s: float | None = None

    @classmethod
    def connect(cls, socket_path: str, *, job: str, rank: int = 0, world_size: int = 1,
                local_rank: int = 0, arena_nbytes: int | None = None, device: str = "cpu",
                timeout_s: float = 60.0, reply_timeout_s: float | None = 300.0,
                daemon_uid: int | str | None = None) -> OffloadClient:
        """Connect, say hello and map the job's arena.

        ``reply_timeout_s``: longest wait for any one reply (None: forever); past it a call
        raises ReplyTimeoutError and the client is closed. ``daemon_uid``: the uid (or user
        name) the daemon runs as; unset: $OFFLOADD_DAEMON_UID, else the ``offloadd`` user,
        else root. A listener of another uid (nor root's, nor ours) gets nothing sent and
        the connect raises UntrustedDaemonError."""
        hello = hello_request(job, rank, world_size, local_rank, arena_nbytes, device)
        sock, reply, arena = open_session(socket_path, hello, timeout_s, daemon_uid)
        set_reply_timeout(sock, reply_timeout_s)
        client = cls(sock, reply, arena, job, rank)
        client.reply_timeout_s = reply_timeout_s
        return client

    # -- transport ----------------------------------------------------------------

    def _send(self, request: p.Request) -> int:
        if self.closed:
            raise DaemonUnavailableError("client is closed")
        request.rid = rid = self._rid()
        try:
            self._sock.sendall(p.encode_frame(request))
        except (TimeoutError, BlockingIOError):  # SO_SNDTIMEO/SO_RCVTIMEO ran out
            raise self._timed_out() from None
        except OSError as exc:
            raise DaemonUnavailableError(f"lost the daemon: {exc}") from exc
        return rid

    def _timed_out(self) -> ReplyTimeoutError:
        """Close the connection (a late reply would arrive out of step) and say why."""
        self.close()
        return reply_timeout_error(self.reply_timeout_s)

    def _read_frame(self) -> p.Reply:
        buffer = self._rbuf
        if not buffer:  # the common case: one recv returns exactly one reply
            chunk = self._recv()
            if (len(chunk) >= p.HEADER_NBYTES
                    and p.HEADER.unpack_from(chunk)[0] == len(chunk) - p.HEADER_NBYTES):
                return p.decode_reply(chunk[p.HEADER_NBYTES:])
            buffer += chunk
        while True:
            if len(buffer) >= p.HEADER_NBYTES:
                (length,) = p.HEADER.unpack_from(buffer)
                end = p.HEADER_NBYTES + length
                if len(buffer) >= end:
                    with memoryview(buffer) as view:
                        reply = p.decode_reply(view[p.HEADER_NBYTES:end])
                    del buffer[:end]
                    return reply
            buffer += self._recv()

    def _recv(self) -> bytes:
        try:
            chunk = self._sock.recv(1 << 16)
        except (TimeoutError, BlockingIOError):
            raise self._timed_out() from None
        except OSError as exc:
            raise DaemonUnavailableError(f"lost the daemon: {exc}") from exc
        if not chunk:
            raise DaemonUnavailableError("the daemon closed the connection")
        return chunk

    def _wait_reply(self, rid: int) -> p.Reply:
        with self._lock:
            reply = self._inbox.pop(rid, None)
            while reply is None:
                reply = self._read_frame()
                if reply.rid != rid:  # another caller's reply (optimizer steps in flight)
                    self._inbox[reply.rid] = reply
                    reply = None
            return check_reply(reply)

    def poll_replies(self) -> None:
        """Read the replies the daemon has sent so far, without blocking: what makes a
        step handle's ``done()`` current."""
        with self._lock:
            while _holds_frame(self._rbuf) or self._readable.poll(0):
                reply = self._read_frame()
                self._inbox[reply.rid] = reply

    def _call(self, request: p.Request) -> p.Reply:
        with self._lock:
            rid = self._send(request)
            if not self._inbox:  # the common case: no other caller's reply is parked
                reply = self._read_frame()
                if reply.rid == rid:
                    return reply if type(reply) is not p.ErrorReply else check_reply(reply)
                self._inbox[reply.rid] = reply
            return self._wait_reply(rid)

    # -- shards -------------------------------------------------------------------

    def alloc(self, ids: str | Iterable[str], nbytes: int | Iterable[int],
              dtype: str | Iterable[str] = "uint8") -> None:
        """Create shards (no lease); existing ones must have the same size and dtype."""
        self._call(self._alloc_request(ids, nbytes, dtype))

    def acquire(self, shard_id: str, mode: str = "r") -> ShardLease:
        """Lease one shard; use as a context manager. ``mode`` is "r" or "w"."""
        reply = self._call(self._acquire_request([shard_id], mode))
        return self._lease(shard_id, mode, reply)

    def acquire_many(self, ids: Iterable[str], mode: str = "r") -> LeaseGroup:
        id_list = list(ids)
        return self._group(id_list, mode, self._call(self._acquire_request(id_list, mode)))

    def _group(self, ids: list[str], mode: str, reply: p.Reply) -> LeaseGroup:
        leases = self._leases(ids, mode, reply)
        group = LeaseGroup(self, leases, mode)
        for lease in leases:
            lease.group = group
        return group

    def _release(self, leases: list[ShardLease], dirty: bool, torn: bool = False) -> None:
        self._call(self._release_request(leases, dirty, torn))

    def put(self, shard_id: str, data: Any) -> None:
        """Copy ``data`` into the shard (created if missing) and commit it."""
        src, request = self._put_request(shard_id, data)
        with self._group([shard_id], "w", self._call(request))[0] as lease:
            lease.view[:] = src

    def put_many(self, items: dict[str, Any]) -> None:
        """Batched put: one acquire and one release for all shards."""
        sources = {shard_id: as_bytes(data) for shard_id, data in items.items()}
        ids = list(sources)
        request = p.Acquire(0, ids, "w", [sources[i][0].nbytes for i in ids],
                            [sources[i][1] for i in ids])
        with self._group(ids, "w", self._call(request)) as group:
            for lease in group:
                lease.view[:] = sources[lease.shard_id][0]

    def get(self, shard_id: str) -> bytes:
        """A copy of the shard's committed bytes."""
        with self.acquire(shard_id, "r") as lease:
            return bytes(lease.view)

    def prefetch(self, ids: str | Iterable[str], deadline_s: float = 0.0) -> None:
        self._call(p.Prefetch(0, as_list(ids), deadline_s))

    def drop(self, ids: str | Iterable[str]) -> None:
        self._call(p.Drop(0, as_list(ids)))

    def step_begin(self) -> None:
        """Mark the start of a training step (the daemon learns the access order per step)."""
        self._call(p.StepBegin(0))

    def flush(self, tag: str | None = None) -> dict[str, Any]:
        """Persist every dirty shard of the job and a manifest; returns what was written."""
        return self._stats_of(self._call(p.Flush(0, tag)))

    def stats(self) -> dict[str, Any]:
        return self._stats_of(self._call(p.Stats(0)))

    def optimizer_step_async(self, unit: str, *, step: int, lr: float, beta1: float = 0.9,
                             beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                             decoupled_weight_decay: bool = True,
                             grad_scale: float = 1.0, drop_grad: bool = False,
                             undo: p.StepUndo = "none") -> StepHandle:
        """Start Adam/AdamW on ``{unit}.master/.exp_avg/.exp_avg_sq/.grad`` in the daemon;
        ``drop_grad``: the daemon forgets ``{unit}.grad`` after the step; ``undo``: a part
        of a speculative step (``offloadd.protocol.StepUndo``)."""
        request = self._step_request(unit, step, lr, beta1, beta2, eps, weight_decay,
                                     decoupled_weight_decay, grad_scale, drop_grad, undo)
        return self.request_async(request)

    def optimizer_step(self, unit: str, **hyperparams: Any) -> None:
        self.optimizer_step_async(unit, **hyperparams).wait()

    def request(self, request: p.Request) -> p.Reply:
        """Send any request and wait for its reply (typed errors raised)."""
        return self._call(request)

    def request_async(self, request: p.Request) -> StepHandle:
        """Send ``request`` now; the handle's ``wait()`` waits for its reply."""
        with self._lock:
            return StepHandle(self, self._send(request))

    def close_job(self) -> None:
        """Tell the daemon this rank is done with the job (freed once no rank is attached,
        without the linger), then close the client."""
        try:
            self._call(p.CloseJob(0))
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self._mark_closed()
        self._sock.close()
        self.arena.close()

    def __enter__(self) -> OffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
