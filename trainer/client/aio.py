"""``AsyncOffloadClient``: the asyncio client, many requests in flight on one connection.

Requests are matched to replies by request id: a reader task resolves each request's
future, and a reply overdue past ``reply_timeout_s`` fails every call in flight and
closes the client, as the blocking client does. Imports the rest of the client package;
nothing in the package imports it but ``trainer.client`` itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from offloadd import protocol as p
from offloadd.errors import DaemonUnavailableError
from trainer.client.core import ClientCore
from trainer.client.leases import LeaseGroup, ShardLease
from trainer.client.session import Arena, hello_request, open_session
from trainer.client.wire import as_list, check_reply, reply_timeout_error


class AsyncOffloadClient(ClientCore):
    """asyncio client with many requests in flight, matched to replies by request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 hello: p.HelloOk, arena: Arena, job: str, rank: int) -> None:
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
        hello = hello_request(job, rank, world_size, local_rank, arena_nbytes, device)
        loop = asyncio.get_running_loop()
        # The hello reply carries the arena fd (SCM_RIGHTS), which asyncio's streams
        # cannot receive: the session opens on a blocking socket off the event loop.
        sock, reply, arena = await loop.run_in_executor(
            None, open_session, socket_path, hello, timeout_s, daemon_uid)
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        client = cls(reader, writer, reply, arena, job, rank)
        client.reply_timeout_s = reply_timeout_s
        return client

    # -- transport ----------------------------------------------------------------

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
        self._writer.write(p.encode_frame(request))
        if self.reply_timeout_s is not None:
            timer = loop.call_later(self.reply_timeout_s, self._expire, waiter)
            waiter.add_done_callback(lambda _waiter: timer.cancel())
        return waiter

    def _expire(self, waiter: asyncio.Future[p.Reply]) -> None:
        """A reply is overdue: fail every call in flight and close, like the blocking client."""
        if waiter.done():
            return
        self.closed = True
        self._fail(reply_timeout_error(self.reply_timeout_s))  # the calls in flight
        self._failure = DaemonUnavailableError("client is closed")  # later calls
        self._pump.cancel()
        self._writer.close()

    async def _call(self, request: p.Request) -> p.Reply:
        return check_reply(await self._send(request))

    # -- shards -------------------------------------------------------------------

    async def alloc(self, ids: str | Iterable[str], nbytes: int | Iterable[int],
                    dtype: str | Iterable[str] = "uint8") -> None:
        await self._call(self._alloc_request(ids, nbytes, dtype))

    async def acquire_many(self, ids: Iterable[str], mode: str = "r") -> LeaseGroup:
        return await self._acquire(self._acquire_request(list(ids), mode))

    async def _acquire(self, request: p.Acquire) -> LeaseGroup:
        # The request is on the wire once _send returns; if we are cancelled while
        # waiting, the daemon may still grant the leases, so give them back then.
        ids = request.ids
        waiter = self._send(request)
        try:
            reply = check_reply(await asyncio.shield(waiter))
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
        # Sent before any await: cancellation cannot lose the release.
        waiter = self._send(self._release_request(leases, dirty, torn))
        check_reply(await asyncio.shield(waiter))

    def _release(self, leases: list[ShardLease], dirty: bool, torn: bool = False) -> None:
        self._send(self._release_request(leases, dirty, torn))

    async def put(self, shard_id: str, data: Any) -> None:
        src, request = self._put_request(shard_id, data)
        async with (await self._acquire(request))[0] as lease:
            lease.view[:] = src

    async def get(self, shard_id: str) -> bytes:
        async with await self.acquire(shard_id, "r") as lease:
            return bytes(lease.view)

    async def prefetch(self, ids: str | Iterable[str], deadline_s: float = 0.0) -> None:
        await self._call(p.Prefetch(0, as_list(ids), deadline_s))

    async def drop(self, ids: str | Iterable[str]) -> None:
        await self._call(p.Drop(0, as_list(ids)))

    async def step_begin(self) -> None:
        await self._call(p.StepBegin(0))

    async def flush(self, tag: str | None = None) -> dict[str, Any]:
        return self._stats_of(await self._call(p.Flush(0, tag)))

    async def stats(self) -> dict[str, Any]:
        return self._stats_of(await self._call(p.Stats(0)))

    async def optimizer_step(self, unit: str, *, step: int, lr: float, beta1: float = 0.9,
                             beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                             decoupled_weight_decay: bool = True, grad_scale: float = 1.0,
                             drop_grad: bool = False, undo: p.StepUndo = "none") -> None:
        await self._call(self._step_request(unit, step, lr, beta1, beta2, eps, weight_decay,
                                            decoupled_weight_decay, grad_scale, drop_grad,
                                            undo))

    async def close_job(self) -> None:
        """Tell the daemon this rank is done with the job, then close (see OffloadClient)."""
        try:
            await self._call(p.CloseJob(0))
        finally:
            await self.close()

    async def close(self) -> None:
        self._mark_closed()
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
