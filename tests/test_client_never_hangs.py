"""Clients never hang: bad requests get a reply with their request id, a silent daemon
times out with a typed error, and a reply the client cannot decode fails one request."""

from __future__ import annotations

import array
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from conftest import hello, raw_socket, read_reply, start_daemon

from offloadd import protocol as p
from offloadd.errors import BadFrameError, DaemonUnavailableError, ReplyTimeoutError
from trainer.client import AsyncOffloadClient, OffloadClient


@pytest.mark.parametrize("fields", [
    ["acquire", 42, "not-a-list-of-ids", "r"],  # known tag, bad body
    ["no_such_request", 42],  # unknown tag
    ["alloc", 42],  # known tag, fields missing
])
def test_undecodable_request_is_answered_with_its_request_id(daemon, job, fields) -> None:
    sock = raw_socket(daemon.socket_path)
    assert isinstance(hello(sock, job), p.HelloOk)
    payload = msgspec.msgpack.encode(fields)
    sock.sendall(p.HEADER.pack(len(payload)) + payload)
    reply, _fds = read_reply(sock)
    assert isinstance(reply, p.ErrorReply) and reply.code == "bad_frame", reply
    assert reply.rid == 42


def test_blocking_client_times_out_with_a_typed_error_when_the_daemon_is_stopped(
        tmp_path: Path) -> None:
    with start_daemon(tmp_path / "d", arena_size="32MiB") as daemon:
        client = OffloadClient.connect(daemon.socket_path, job="frozen", reply_timeout_s=1.0)
        client.put("a", b"1234")
        os.kill(daemon.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReplyTimeoutError, match="reply_timeout_s"):
                client.stats()
            assert client.closed
            with pytest.raises(DaemonUnavailableError):
                client.stats()
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        with OffloadClient.connect(daemon.socket_path, job="frozen") as again:
            assert again.get("a") == b"1234"


@pytest.mark.asyncio
async def test_async_client_times_out_with_a_typed_error_when_the_daemon_is_stopped(
        tmp_path: Path) -> None:
    with start_daemon(tmp_path / "d", arena_size="32MiB") as daemon:
        client = await AsyncOffloadClient.connect(daemon.socket_path, job="frozen-async",
                                                  reply_timeout_s=1.0)
        await client.put("a", b"1234")
        os.kill(daemon.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReplyTimeoutError, match="reply_timeout_s"):
                await client.stats()
            assert client.closed
            with pytest.raises(DaemonUnavailableError):
                await client.stats()
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        await client.close()
        again = await AsyncOffloadClient.connect(daemon.socket_path, job="frozen-async")
        try:
            assert await again.get("a") == b"1234"
        finally:
            await again.close()


class FutureDaemon:
    """A peer speaking a newer protocol: its first reply to ``stats`` has a tag this client
    does not know; every later one is a plain StatsOk. Serves one connection."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.path = path
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            request = self.read(conn)
            assert isinstance(request, p.Hello)
            arena_fd = os.memfd_create("future-arena")
            os.ftruncate(arena_fd, 1 << 20)
            frame = p.encode_frame(p.HelloOk(request.rid, p.PROTOCOL_VERSION, 1 << 20, 1, 0))
            conn.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                    array.array("i", [arena_fd]))])
            os.close(arena_fd)
            first = True
            while (request := self.read(conn)) is not None:
                if first:
                    payload = msgspec.msgpack.encode(["stats_ok_v2", request.rid, {"new": 1}])
                    conn.sendall(p.HEADER.pack(len(payload)) + payload)
                    first = False
                else:
                    conn.sendall(p.encode_frame(p.StatsOk(request.rid, {"answered": True})))

    @staticmethod
    def read(conn: socket.socket) -> p.Request | None:
        header = conn.recv(p.HEADER_NBYTES, socket.MSG_WAITALL)
        if len(header) < p.HEADER_NBYTES:
            return None
        (length,) = p.HEADER.unpack(header)
        return p.request_decoder.decode(conn.recv(length, socket.MSG_WAITALL))

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


@pytest.fixture
def future_daemon(tmp_path: Path) -> Iterator[FutureDaemon]:
    peer = FutureDaemon(str(tmp_path / "future.sock"))
    yield peer
    peer.close()


def test_unknown_reply_tag_fails_one_request_of_the_async_client(future_daemon,
                                                                  run_async) -> None:
    async def scenario() -> None:
        client = await AsyncOffloadClient.connect(future_daemon.path, job="j")
        try:
            with pytest.raises(BadFrameError, match="matching offloadd versions"):
                await client.stats()
            assert (await client.stats())["answered"] is True  # the reader survived
        finally:
            await client.close()

    run_async(scenario())


def test_unknown_reply_tag_fails_one_request_of_the_blocking_client(future_daemon) -> None:
    with OffloadClient.connect(future_daemon.path, job="j", reply_timeout_s=30) as client:
        with pytest.raises(BadFrameError, match="matching offloadd versions"):
            client.stats()
        assert client.stats()["answered"] is True
