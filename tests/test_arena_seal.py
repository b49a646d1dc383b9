"""Sealed arenas: no rank can resize the memfd it was given, so none can SIGBUS the daemon."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import pytest
from conftest import hello, raw_socket, read_reply

from offloadd import protocol as p
from offloadd.memory.arena import ARENA_SEALS, HUGE_PAGE_NBYTES, PAGE_NBYTES, Arena, seals
from offloadd.ops.embedded import PrivateDaemon


def expect_eperm(action, *args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PermissionError) as caught:
        action(*args)
    assert caught.value.errno == errno.EPERM


def test_a_new_arena_is_sealed_against_resizing_and_unsealing() -> None:
    arena = Arena("sealed", 4 * PAGE_NBYTES, lock=False)
    try:
        assert seals(arena.fd) & ARENA_SEALS == ARENA_SEALS
        expect_eperm(os.ftruncate, arena.fd, PAGE_NBYTES)
        expect_eperm(os.ftruncate, arena.fd, 8 * PAGE_NBYTES)
        expect_eperm(fcntl.fcntl, arena.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        arena.slice(0, 4)[:] = b"data"  # writes stay allowed: ranks fill their shards
        assert os.fstat(arena.fd).st_size == arena.nbytes
    finally:
        arena.close()


def test_a_hugetlb_arena_is_sealed_too(huge_pages) -> None:  # type: ignore[no-untyped-def]
    huge_pages(1)
    arena = Arena("sealed-huge", HUGE_PAGE_NBYTES, lock=False, hugepages="on")
    try:
        assert arena.hugepages
        assert seals(arena.fd) & ARENA_SEALS == ARENA_SEALS
        expect_eperm(os.ftruncate, arena.fd, 0)
    finally:
        arena.close()


def test_a_client_that_truncates_its_fd_gets_eperm_and_the_daemon_serves_on(
        daemon: PrivateDaemon, job: str, witness) -> None:  # type: ignore[no-untyped-def]
    sock = raw_socket(daemon.socket_path)
    sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, job, 0, 1, 0, "cpu", 1 << 20)))
    reply, fds = read_reply(sock)
    assert isinstance(reply, p.HelloOk) and len(fds) == 1
    fd = fds[0]
    try:
        sock.sendall(p.encode_frame(p.Acquire(2, ["a"], "w", create_nbytes=[4096],
                                              create_dtypes=["uint8"])))
        placed, _ = read_reply(sock)
        assert isinstance(placed, p.Placed)
        view = mmap.mmap(fd, reply.arena_nbytes, flags=mmap.MAP_SHARED)
        view[placed.offsets[0] : placed.offsets[0] + 4] = b"kept"
        expect_eperm(os.ftruncate, fd, 0)
        expect_eperm(os.ftruncate, fd, reply.arena_nbytes * 2)
        sock.sendall(p.encode_frame(p.Release(3, ["a"], True)))
        assert isinstance(read_reply(sock)[0], p.Ok)
        sock.sendall(p.encode_frame(p.Acquire(4, ["a"], "r")))
        again, _ = read_reply(sock)
        assert isinstance(again, p.Placed)
        assert view[again.offsets[0] : again.offsets[0] + 4] == b"kept"
        view.close()
    finally:
        os.close(fd)
        sock.close()
    witness()
    assert daemon.process.poll() is None
    other = raw_socket(daemon.socket_path)
    assert isinstance(hello(other, f"{job}-after"), p.HelloOk)
    other.close()
