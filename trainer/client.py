"""Clients of the offloadd daemon: ``OffloadClient`` (blocking) and ``AsyncOffloadClient``.

Both speak the message types of :mod:`offloadd.protocol` and map the job's
arena (its fd arrives with the hello reply over SCM_RIGHTS), so leased
shards are plain views of shared memory: nothing is copied between the
daemon and the rank.
"""

from __future__ import annotations

import array
import asyncio
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from offloadd import protocol as p
from offloadd.errors import (
    DaemonUnavailableError,
    InvalidRequestError,
    OffloadError,
    ReplyTimeoutError,
    UnknownShardError,
    error_from_code,
)
from offloadd.protocol import check_daemon_peer
from trainer import lease_debug
from trainer.lease_debug import StaleLeaseError

__all__ = [
    "AsyncOffloadClient",
    "DaemonUnavailableError",
    "LeaseGroup",
    "OffloadClient",
    "OffloadError",
    "ReplyTimeoutError",
    "ShardLease",
    "StaleLeaseError",
    "StepHandle",
    "UnknownShardError",
]

TAG_TORCH_DTYPES = p.torch_dtypes()  # the daemon's own tag -> torch dtype table
TORCH_DTYPE_TAGS = {dtype: tag for tag, dtype in TAG_TORCH_DTYPES.items()}
_encode = msgspec.msgpack.Encoder().encode


class ReleasedLeaseError(RuntimeError):
    """A lease's memory was used after the lease was released."""


def as_bytes(data: Any) -> tuple[memoryview, str]:
    """A flat byte view of ``data`` (bytes-like, numpy array or CPU tensor) and its dtype tag."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"put() needs a CPU tensor, got one on {data.device}")
        tag = TORCH_DTYPE_TAGS.get(data.dtype)
        if tag is None:
            raise ValueError(f"unsupported tensor dtype {data.dtype}; use one of {p.DTYPES}")
        flat = data.detach().contiguous().reshape(-1).view(torch.uint8)
        return flat.numpy().data, tag
    if isinstance(data, np.ndarray):
        tag = str(data.dtype) if str(data.dtype) in p.DTYPES else "uint8"
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data, tag
    view = memoryview(data)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view, "uint8"


def _frame(request: p.Request) -> bytes:
    payload = _encode(request)
    return p.HEADER.pack(len(payload)) + payload


def _as_list(ids: str | Iterable[str]) -> list[str]:
    return [ids] if isinstance(ids, str) else list(ids)


def _check_reply(reply: p.Reply) -> p.Reply:
    if isinstance(reply, p.ErrorReply):
        raise error_from_code(reply.code, reply.message, reply.shard_ids)
    return reply


class _Arena:
    """The client's mapping of its job's arena."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.nbytes = nbytes
        try:
            self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            pass  # tensors still view the arena; the mapping goes with the last of them


class ShardLease:
    """A lease on one shard: ``view`` is the shard's bytes in the shared arena (no copy).

    ``view``, ``tensor()`` and ``numpy()`` are valid only while the lease is held: after
    ``release()`` the daemon may place another shard at the same bytes. Clone what must
    outlive the lease. ``trainer.lease_debug`` (``OFFLOADD_DEBUG_LEASES=1``) catches a view
    used after its release wherever the engine calls ``check_view``.
    """

    __slots__ = ("_owner", "_view", "dtype", "group", "mode", "nbytes", "offset", "shard_id",
                 "version")

    def __init__(self, owner: Any, shard_id: str, mode: str, offset: int, nbytes: int,
                 version: int, dtype: str, view: memoryview) -> None:
        self._owner = owner
        self.shard_id, self.mode, self.offset = shard_id, mode, offset
        self.nbytes, self.version, self.dtype = nbytes, version, dtype
        self._view: memoryview | None = view
        self.group: LeaseGroup | None = None
        """The batch this lease was taken in (``acquire_many``); None for ``acquire``."""

    @property
    def released(self) -> bool:
        """Given back, or its client closed (the daemon dropped the lease with the session)."""
        return self._view is None or self._owner.closed

    @property
    def view(self) -> memoryview:
        if self._view is None or self._owner.closed:
            raise ReleasedLeaseError(f"lease on {self.shard_id!r} was released; acquire it again")
        return self._view

    def tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 1-D tensor viewing the shard's arena bytes (default dtype: the shard's tag)."""
        target = dtype or TAG_TORCH_DTYPES.get(self.dtype, torch.uint8)
        if self.nbytes % target.itemsize:
            raise ValueError(f"{self.nbytes} bytes is not a whole number of {target} elements")
        if self.nbytes == 0:
            return torch.empty(0, dtype=target)
        return torch.frombuffer(self.view, dtype=target)

    def numpy(self, dtype: Any = np.uint8) -> np.ndarray:
        return np.frombuffer(self.view, dtype=dtype)

    def _forget(self) -> None:
        if self._view is not None and self._owner.lease_ranges is not None:
            self._owner.lease_ranges.give_back(self.offset)
        self._view = None

    def release(self, dirty: bool | None = None) -> None:
        """Give the lease back; a write lease is committed (dirty) unless told otherwise."""
        if self._view is None or self._owner.closed:  # released
            return
        self._owner._release([self], self.mode == "w" if dirty is None else dirty)

    def __enter__(self) -> ShardLease:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A write lease left by an exception publishes nothing: the daemon marks
        # the shard torn (reads raise TornShardError until it is written again),
        # and a flush keeps its previous version.
        if not self.released:
            self._owner._release([self], self.mode == "w", torn=_torn(self.mode, exc_type))

    async def __aenter__(self) -> ShardLease:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if not self.released:  # released inside the block already: nothing to give back
            await self._owner._release_async([self], self.mode == "w",
                                             torn=_torn(self.mode, exc_type))


class LeaseGroup(Sequence[ShardLease]):
    """Leases taken in one batched acquire and given back in one batched release."""

    def __init__(self, owner: Any, leases: list[ShardLease], mode: str) -> None:
        self._owner, self.leases, self.mode = owner, leases, mode

    def __getitem__(self, index):
        return self.leases[index]

    def __len__(self) -> int:
        return len(self.leases)

    def release(self, dirty: bool | None = None) -> None:
        live = [lease for lease in self.leases if not lease.released]
        if live:
            self._owner._release(live, self.mode == "w" if dirty is None else dirty)

    def __enter__(self) -> LeaseGroup:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        live = [lease for lease in self.leases if not lease.released]
        if live:  # torn on error, as ShardLease.__exit__
            self._owner._release(live, self.mode == "w", torn=_torn(self.mode, exc_type))

    async def __aenter__(self) -> LeaseGroup:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        live = [lease for lease in self.leases if not lease.released]
        if live:
            await self._owner._release_async(live, self.mode == "w",
                                              torn=_torn(self.mode, exc_type))


def _torn(mode: str, exc_type: object) -> bool:
    """A write lease left by an exception is torn (cancellation included)."""
    return mode == "w" and exc_type is not None


def _hello_request(job: str, rank: int, world_size: int, local_rank: int,
                   arena_nbytes: int | None, device: str) -> p.Hello:
    return p.Hello(0, p.PROTOCOL_VERSION, job, rank, world_size, local_rank, device,
                   arena_nbytes or 0, job_secret=os.environ.get(p.JOB_SECRET_ENV, ""))


def handshake(sock: socket.socket, hello: p.Hello) -> tuple[p.HelloOk, int]:
    """Send hello on a blocking socket; return the reply and the arena fd it carried."""
    try:
        sock.sendall(_frame(hello))
    except OSError:
        # A daemon that refuses us (uid not allowed) answers at connect and closes; our
        # send can then fail with EPIPE, but its typed error is still ours to read.
        pass
    header = _recv_exact_with_fd(sock, p.HEADER_NBYTES)
    (length,) = p.HEADER.unpack(header[0])
    payload = _recv_exact(sock, length)
    reply = _check_reply(p.reply_decoder.decode(payload))
    if not isinstance(reply, p.HelloOk) or header[1] is None:
        raise DaemonUnavailableError("daemon answered hello without an arena descriptor")
    return reply, header[1]


def _recv_exact_with_fd(sock: socket.socket, nbytes: int) -> tuple[bytes, int | None]:
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(nbytes, socket.CMSG_SPACE(fds.itemsize))
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
    if not data:
        raise DaemonUnavailableError("daemon closed the connection during hello")
    rest = _recv_exact(sock, nbytes - len(data)) if len(data) < nbytes else b""
    return data + rest, (fds[0] if fds else None)


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    chunks, remaining = [], nbytes
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise DaemonUnavailableError("daemon closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


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


def connect_socket(socket_path: str, timeout_s: float,
                   daemon_uid: int | str | None = None) -> socket.socket:
    """Connect, then check who listens (``offloadd.protocol.check_daemon_peer``) before the
    caller sends anything: a hello carries the job secret."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(socket_path)
    except OSError as exc:
        sock.close()
        raise DaemonUnavailableError(
            f"cannot reach offloadd at {socket_path}: {exc.strerror or exc}; start it with "
            "`offloadd serve --socket PATH` or let the engine start a private one"
        ) from exc
    try:
        check_daemon_peer(sock, socket_path, daemon_uid)
    except BaseException:
        sock.close()
        raise
    return sock


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
        return self._done


class _ClientBase:
    """State and request builders shared by the blocking and the asyncio client."""

    def __init__(self, hello: p.HelloOk, arena: _Arena, job: str, rank: int) -> None:
        self.job, self.rank = job, rank
        self.session_id = hello.session_id
        self.daemon_pid = hello.daemon_pid
        self.arena = arena
        self._next_rid = 0
        self.closed = False
        self.lease_ranges = lease_debug.LeaseRanges(arena.view) if lease_debug.enabled() else None
        """Live lease ranges, kept only in debug-lease mode (see ``trainer.lease_debug``)."""

    def _rid(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def _lease(self, shard_id: str, mode: str, reply: p.Reply) -> ShardLease:
        """The lease of a single-shard acquire (``_leases`` for one id, without the lists)."""
        assert isinstance(reply, p.Placed)
        offset, nbytes = reply.offsets[0], reply.nbytes[0]
        if self.lease_ranges is not None:
            self.lease_ranges.hold(offset, nbytes, shard_id)
        return ShardLease(self, shard_id, mode, offset, nbytes, reply.versions[0],
                          reply.dtypes[0], self.arena.view[offset : offset + nbytes])

    def _leases(self, ids: list[str], mode: str, reply: p.Reply) -> list[ShardLease]:
        assert isinstance(reply, p.Placed)
        view = self.arena.view
        if self.lease_ranges is not None:
            for shard_id, offset, nbytes in zip(ids, reply.offsets, reply.nbytes):
                self.lease_ranges.hold(offset, nbytes, shard_id)
        return [
            ShardLease(self, shard_id, mode, offset, nbytes, version, dtype,
                       view[offset : offset + nbytes])
            for shard_id, offset, nbytes, version, dtype in zip(
                ids, reply.offsets, reply.nbytes, reply.versions, reply.dtypes)
        ]

    @staticmethod
    def _alloc_request(ids: str | Iterable[str], nbytes: int | Iterable[int],
                       dtype: str | Iterable[str]) -> p.Alloc:
        id_list = _as_list(ids)
        sizes = [nbytes] * len(id_list) if isinstance(nbytes, int) else list(nbytes)
        dtypes = [dtype] * len(id_list) if isinstance(dtype, str) else list(dtype)
        if len(sizes) != len(id_list) or len(dtypes) != len(id_list):
            raise InvalidRequestError("alloc needs one size and one dtype per shard id")
        return p.Alloc(0, id_list, sizes, dtypes)

    @staticmethod
    def _step_request(unit: str, step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, decoupled_weight_decay: bool,
                      grad_scale: float, drop_grad: bool = False) -> p.OptimizerStep:
        return p.OptimizerStep(0, unit, step, lr, beta1, beta2, eps, weight_decay,
                               decoupled_weight_decay, grad_scale, drop_grad)


class OffloadClient(_ClientBase):
    """Blocking client, one per rank (thread-safe: calls are serialised on a lock)."""

    def __init__(self, sock: socket.socket, hello: p.HelloOk, arena: _Arena, job: str,
                 rank: int) -> None:
        super().__init__(hello, arena, job, rank)
        self._sock = sock
        self._lock = threading.RLock()
        self._inbox: dict[int, p.Reply] = {}
        self._rbuf = bytearray()
        self.closed = False
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
        sock = connect_socket(socket_path, timeout_s, daemon_uid)
        try:
            hello, fd = handshake(
                sock, _hello_request(job, rank, world_size, local_rank, arena_nbytes, device))
            arena = _Arena(fd, hello.arena_nbytes)
        except BaseException:
            sock.close()
            raise
        set_reply_timeout(sock, reply_timeout_s)
        client = cls(sock, hello, arena, job, rank)
        client.reply_timeout_s = reply_timeout_s
        return client

    # -- transport ----------------------------------------------------------------

    def _send(self, request: p.Request) -> int:
        if self.closed:
            raise DaemonUnavailableError("client is closed")
        self._next_rid = request.rid = rid = self._next_rid + 1
        payload = _encode(request)
        try:
            self._sock.sendall(p.HEADER.pack(len(payload)) + payload)
        except (TimeoutError, BlockingIOError):  # SO_SNDTIMEO/SO_RCVTIMEO ran out
            raise self._timed_out() from None
        except OSError as exc:
            raise DaemonUnavailableError(f"lost the daemon: {exc}") from exc
        return rid

    def _timed_out(self) -> ReplyTimeoutError:
        """Close the connection (a late reply would arrive out of step) and say why."""
        self.close()
        return _reply_timeout_error(self.reply_timeout_s)

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
            return _check_reply(reply)

    def _call(self, request: p.Request) -> p.Reply:
        with self._lock:
            rid = self._send(request)
            if not self._inbox:  # the common case: no other caller's reply is parked
                reply = self._read_frame()
                if reply.rid == rid:
                    return reply if type(reply) is not p.ErrorReply else _check_reply(reply)
                self._inbox[reply.rid] = reply
            return self._wait_reply(rid)

    # -- shards -------------------------------------------------------------------

    def alloc(self, ids: str | Iterable[str], nbytes: int | Iterable[int],
              dtype: str | Iterable[str] = "uint8") -> None:
        """Create shards (no lease); existing ones must have the same size and dtype."""
        self._call(self._alloc_request(ids, nbytes, dtype))

    def acquire(self, shard_id: str, mode: str = "r") -> ShardLease:
        """Lease one shard; use as a context manager. ``mode`` is "r" or "w"."""
        reply = self._call(p.Acquire(0, [shard_id], mode))  # type: ignore[arg-type]
        return self._lease(shard_id, mode, reply)

    def acquire_many(self, ids: Iterable[str], mode: str = "r") -> LeaseGroup:
        id_list = list(ids)
        reply = self._call(p.Acquire(0, id_list, mode))  # type: ignore[arg-type]
        return self._group(id_list, mode, reply)

    def _group(self, ids: list[str], mode: str, reply: p.Reply) -> LeaseGroup:
        leases = self._leases(ids, mode, reply)
        group = LeaseGroup(self, leases, mode)
        for lease in leases:
            lease.group = group
        return group

    def _release(self, leases: list[ShardLease], dirty: bool, torn: bool = False) -> None:
        ids = [lease.shard_id for lease in leases]
        for lease in leases:
            lease._forget()
        self._call(p.Release(0, ids, dirty, torn))

    def put(self, shard_id: str, data: Any) -> None:
        """Copy ``data`` into the shard (created if missing) and commit it."""
        src, dtype = as_bytes(data)
        reply = self._call(p.Acquire(0, [shard_id], "w", [src.nbytes], [dtype]))
        with self._group([shard_id], "w", reply)[0] as lease:
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
        self._call(p.Prefetch(0, _as_list(ids), deadline_s))

    def drop(self, ids: str | Iterable[str]) -> None:
        self._call(p.Drop(0, _as_list(ids)))

    def step_begin(self) -> None:
        """Mark the start of a training step (the daemon learns the access order per step)."""
        self._call(p.StepBegin(0))

    def flush(self, tag: str | None = None) -> dict[str, Any]:
        """Persist every dirty shard of the job and a manifest; returns what was written."""
        reply = self._call(p.Flush(0, tag))
        assert isinstance(reply, p.StatsOk)
        return reply.stats

    def stats(self) -> dict[str, Any]:
        reply = self._call(p.Stats(0))
        assert isinstance(reply, p.StatsOk)
        return reply.stats

    def optimizer_step_async(self, unit: str, *, step: int, lr: float, beta1: float = 0.9,
                             beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                             decoupled_weight_decay: bool = True,
                             grad_scale: float = 1.0, drop_grad: bool = False) -> StepHandle:
        """Start Adam/AdamW on ``{unit}.master/.exp_avg/.exp_avg_sq/.grad`` in the daemon;
        ``drop_grad``: the daemon forgets ``{unit}.grad`` after the step."""
        request = self._step_request(unit, step, lr, beta1, beta2, eps, weight_decay,
                                     decoupled_weight_decay, grad_scale, drop_grad)
        with self._lock:
            return StepHandle(self, self._send(request))

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
        self.closed = True
        if self.lease_ranges is not None:
            self.lease_ranges.close()
        self._sock.close()
        self.arena.close()

    def __enter__(self) -> OffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reply_timeout_error(reply_timeout_s: float | None) -> ReplyTimeoutError:
    return ReplyTimeoutError(
        f"no reply from offloadd within {reply_timeout_s} s (reply_timeout_s); the daemon may "
        "be stopped or overloaded (`offloadd status`); the client is closed")


class AsyncOffloadClient(_ClientBase):
    """asyncio client with many requests in flight, matched to replies by request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 hello: p.HelloOk, arena: _Arena, job: str, rank: int) -> None:
        super().__init__(hello, arena, job, rank)
        self._reader, self._writer = reader, writer
        self._waiters: dict[int, asyncio.Future[p.Reply]] = {}
        self._failure: BaseException | None = None
        self._pump = asyncio.ensure_future(self._read_replies())
        self.reply_timeout_s: float | None = 300.0
        """Longest wait for any one reply (None: forever); see ``connect``."""

    @classmethod
    async def connect(cls, socket_path: str, *, job: str, rank: int = 0, world_size: int = 1,
                      local_rank: int = 0, arena_nbytes: int | None = None, device: str = "cpu",
                      timeout_s: float = 60.0, reply_timeout_s: float | None = 300.0,
                      daemon_uid: int | str | None = None) -> AsyncOffloadClient:
        """``reply_timeout_s``: longest wait for any one reply (None: forever); past it every
        call in flight raises ReplyTimeoutError and the client is closed, as the blocking
        client does. ``daemon_uid``: as ``OffloadClient.connect``."""
        hello_req = _hello_request(job, rank, world_size, local_rank, arena_nbytes, device)

        def blocking_hello() -> tuple[socket.socket, p.HelloOk, _Arena]:
            sock = connect_socket(socket_path, timeout_s, daemon_uid)
            try:
                hello, fd = handshake(sock, hello_req)
                return sock, hello, _Arena(fd, hello.arena_nbytes)
            except BaseException:
                sock.close()
                raise

        loop = asyncio.get_running_loop()
        sock, hello, arena = await loop.run_in_executor(None, blocking_hello)
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        client = cls(reader, writer, hello, arena, job, rank)
        client.reply_timeout_s = reply_timeout_s
        return client

    async def _read_replies(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(p.HEADER_NBYTES)
                (length,) = p.HEADER.unpack(header)
                reply = p.decode_reply(await self._reader.readexactly(length))
                waiter = self._waiters.pop(reply.rid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._fail(DaemonUnavailableError(f"lost the daemon: {exc!r}"))
        except asyncio.CancelledError:
            self._fail(DaemonUnavailableError("client is closed"))
            raise

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()

    def _send(self, request: p.Request) -> asyncio.Future[p.Reply]:
        if self._failure is not None:
            raise self._failure
        request.rid = rid = self._rid()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[p.Reply] = loop.create_future()
        self._waiters[rid] = waiter
        self._writer.write(_frame(request))
        if self.reply_timeout_s is not None:
            timer = loop.call_later(self.reply_timeout_s, self._expire, waiter)
            waiter.add_done_callback(lambda _waiter: timer.cancel())
        return waiter

    def _expire(self, waiter: asyncio.Future[p.Reply]) -> None:
        """A reply is overdue: fail every call in flight and close, like the blocking client."""
        if waiter.done():
            return
        self.closed = True
        self._fail(_reply_timeout_error(self.reply_timeout_s))  # the calls in flight
        self._failure = DaemonUnavailableError("client is closed")  # later calls
        self._pump.cancel()
        self._writer.close()

    async def _call(self, request: p.Request) -> p.Reply:
        return _check_reply(await self._send(request))

    async def alloc(self, ids: str | Iterable[str], nbytes: int | Iterable[int],
                    dtype: str | Iterable[str] = "uint8") -> None:
        await self._call(self._alloc_request(ids, nbytes, dtype))

    async def acquire_many(self, ids: Iterable[str], mode: str = "r") -> LeaseGroup:
        id_list = list(ids)
        return await self._acquire(p.Acquire(0, id_list, mode))  # type: ignore[arg-type]

    async def _acquire(self, request: p.Acquire) -> LeaseGroup:
        # The request is on the wire once _send returns; if we are cancelled while
        # waiting, the daemon may still grant the leases, so give them back then.
        ids = request.ids
        waiter = self._send(request)
        try:
            reply = _check_reply(await asyncio.shield(waiter))
        except asyncio.CancelledError:
            waiter.add_done_callback(lambda f: self._release_orphans(ids, f))
            raise
        return LeaseGroup(self, self._leases(ids, request.mode, reply), request.mode)

    def _release_orphans(self, ids: list[str], waiter: asyncio.Future[p.Reply]) -> None:
        granted = not waiter.cancelled() and isinstance(
            waiter.exception() or waiter.result(), p.Placed)
        if granted and self._failure is None:
            self._send(p.Release(0, ids, False))

    async def acquire(self, shard_id: str, mode: str = "r") -> ShardLease:
        return (await self.acquire_many([shard_id], mode))[0]

    async def _release_async(self, leases: list[ShardLease], dirty: bool,
                             torn: bool = False) -> None:
        ids = [lease.shard_id for lease in leases]
        for lease in leases:
            lease._forget()
        # Sent before any await: cancellation cannot lose the release.
        waiter = self._send(p.Release(0, ids, dirty, torn))
        _check_reply(await asyncio.shield(waiter))

    def _release(self, leases: list[ShardLease], dirty: bool, torn: bool = False) -> None:
        for lease in leases:
            lease._forget()
        self._send(p.Release(0, [lease.shard_id for lease in leases], dirty, torn))

    async def put(self, shard_id: str, data: Any) -> None:
        src, dtype = as_bytes(data)
        group = await self._acquire(p.Acquire(0, [shard_id], "w", [src.nbytes], [dtype]))
        async with group[0] as lease:
            lease.view[:] = src

    async def get(self, shard_id: str) -> bytes:
        async with await self.acquire(shard_id, "r") as lease:
            return bytes(lease.view)

    async def prefetch(self, ids: str | Iterable[str], deadline_s: float = 0.0) -> None:
        await self._call(p.Prefetch(0, _as_list(ids), deadline_s))

    async def drop(self, ids: str | Iterable[str]) -> None:
        await self._call(p.Drop(0, _as_list(ids)))

    async def step_begin(self) -> None:
        await self._call(p.StepBegin(0))

    async def flush(self, tag: str | None = None) -> dict[str, Any]:
        reply = await self._call(p.Flush(0, tag))
        assert isinstance(reply, p.StatsOk)
        return reply.stats

    async def stats(self) -> dict[str, Any]:
        reply = await self._call(p.Stats(0))
        assert isinstance(reply, p.StatsOk)
        return reply.stats

    async def optimizer_step(self, unit: str, *, step: int, lr: float, beta1: float = 0.9,
                             beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                             decoupled_weight_decay: bool = True, grad_scale: float = 1.0,
                             drop_grad: bool = False) -> None:
        await self._call(self._step_request(unit, step, lr, beta1, beta2, eps, weight_decay,
                                            decoupled_weight_decay, grad_scale, drop_grad))

    async def close_job(self) -> None:
        """Tell the daemon this rank is done with the job, then close (see OffloadClient)."""
        try:
            await self._call(p.CloseJob(0))
        finally:
            await self.close()

    async def close(self) -> None:
        self.closed = True
        if self.lease_ranges is not None:
            self.lease_ranges.close()
        if self._failure is None:  # requests after close fail at once instead of hanging
            self._failure = DaemonUnavailableError("client is closed")
        self._pump.cancel()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        self.arena.close()

    async def __aenter__(self) -> AsyncOffloadClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
