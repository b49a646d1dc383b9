"""Opening a session with the daemon, the same for both clients: connect, check who
listens, say hello and map the job's arena (its fd arrives with the hello reply over
SCM_RIGHTS).

All of it runs on a blocking socket (the asyncio client runs it in an executor and then
hands the socket to its event loop). Imports only :mod:`trainer.client.wire` of the
client package.
"""

from __future__ import annotations

import array
import mmap
import os
import socket

from offloadd import protocol as p
from offloadd.errors import DaemonUnavailableError
from offloadd.protocol import check_daemon_peer
from trainer.client.wire import check_reply


class Arena:
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


def hello_request(job: str, rank: int, world_size: int, local_rank: int,
                  arena_nbytes: int | None, device: str) -> p.Hello:
    return p.Hello(0, p.PROTOCOL_VERSION, job, rank, world_size, local_rank, device,
                   arena_nbytes or 0, job_secret=os.environ.get(p.JOB_SECRET_ENV, ""))


def open_session(socket_path: str, hello: p.Hello, timeout_s: float,
                 daemon_uid: int | str | None) -> tuple[socket.socket, p.HelloOk, Arena]:
    """Connect, say ``hello`` and map the arena; the socket is closed if any step fails."""
    sock = connect_socket(socket_path, timeout_s, daemon_uid)
    try:
        reply, fd = handshake(sock, hello)
        return sock, reply, Arena(fd, reply.arena_nbytes)
    except BaseException:
        sock.close()
        raise


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


def handshake(sock: socket.socket, hello: p.Hello) -> tuple[p.HelloOk, int]:
    """Send hello on a blocking socket; return the reply and the arena fd it carried."""
    try:
        sock.sendall(p.encode_frame(hello))
    except OSError:
        # A daemon that refuses us (uid not allowed) answers at connect and closes; our
        # send can then fail with EPIPE, but its typed error is still ours to read.
        pass
    header = _recv_exact_with_fd(sock, p.HEADER_NBYTES)
    (length,) = p.HEADER.unpack(header[0])
    payload = _recv_exact(sock, length)
    reply = check_reply(p.reply_decoder.decode(payload))
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

