"""A new job's arena is made off the event loop: one job's hello never stalls another's
requests, and requests pipelined behind a pending hello are answered after it.

The daemon here backs arenas before their hello is answered (``--arena-prefault now``),
so a 1 GiB hello takes long enough to watch the other job being served meanwhile;
tests/test_arena_backing.py covers the default, where the hello does not wait at all."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import JOB_ARENA_NBYTES, call, raw_socket, read_reply, start_daemon

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

LARGE_ARENA_NBYTES = 1 << 30


@pytest.fixture(scope="module")
def roomy_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateDaemon]:
    instance = start_daemon(tmp_path_factory.mktemp("offloadd"), arena_size="1200MiB",
                            extra_args=["--arena-prefault", "now"])
    yield instance
    assert instance.stop() == 0


def test_other_jobs_are_served_while_a_large_arena_is_made(roomy_daemon: PrivateDaemon) -> None:
    witness = OffloadClient.connect(roomy_daemon.socket_path, job="witness",
                                    arena_nbytes=JOB_ARENA_NBYTES, timeout_s=30)
    witness.put("w", b"witness")
    sock = raw_socket(roomy_daemon.socket_path, timeout_s=60)
    hello_sent, hello_arrived, stop = threading.Event(), threading.Event(), threading.Event()
    served: list[int] = [0, 0]  # witness replies [before the hello was sent, while pending]

    def keep_asking() -> None:
        while not stop.is_set():
            sent = hello_sent.is_set()
            with witness.acquire("w", "r") as lease:
                assert bytes(lease.view) == b"witness"
            # Not readable now and not yet seen by the main thread (which flags before it
            # reads): this reply came back before the HelloOk did.
            pending = not select.select([sock], [], [], 0)[0] and not hello_arrived.is_set()
            if not sent:
                served[0] += 1
            elif pending:
                served[1] += 1

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        while served[0] < 10:  # the witness is in full swing before the hello
            time.sleep(0.01)
        sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, "large", 0, 1, 0, "cpu",
                                            LARGE_ARENA_NBYTES)))
        hello_sent.set()
        select.select([sock], [], [], 60)
        hello_arrived.set()
        reply, fds = read_reply(sock)
    finally:
        stop.set()
        asker.join()
    for fd in fds:
        os.close(fd)
    assert isinstance(reply, p.HelloOk) and reply.arena_nbytes == LARGE_ARENA_NBYTES
    # Made on the loop, the arena's fallocate + populate + mlock of 1 GiB stalls the
    # witness for the whole hello: only requests the daemon read before the hello (one,
    # two at most) are answered before the HelloOk.
    assert served[1] > 3, served
    assert isinstance(call(sock, p.Stats(2)), p.StatsOk)
    sock.close()
    witness.close()


def test_requests_pipelined_behind_a_new_jobs_hello_are_answered_in_order(
        roomy_daemon: PrivateDaemon) -> None:
    sock = raw_socket(roomy_daemon.socket_path)
    frames = [
        p.Hello(1, p.PROTOCOL_VERSION, "pipelined", 0, 1, 0, "cpu", 64 << 20),
        p.Acquire(2, ["a"], "w", create_nbytes=[100], create_dtypes=["uint8"]),
        p.Release(3, ["a"], True),
        p.Stats(4),
    ]
    sock.sendall(b"".join(p.encode_frame(frame) for frame in frames))
    answers = []
    for _ in frames:
        reply, fds = read_reply(sock)
        answers.append(reply)
        for fd in fds:
            os.close(fd)
    assert [type(a) for a in answers] == [p.HelloOk, p.Placed, p.Ok, p.StatsOk]
    assert [a.rid for a in answers] == [1, 2, 3, 4]  # type: ignore[union-attr]
    assert answers[3].stats["leased_nbytes"] == 0  # type: ignore[union-attr]
    sock.close()


def test_two_ranks_saying_hello_at_once_share_one_new_arena(roomy_daemon: PrivateDaemon) -> None:
    socks = [raw_socket(roomy_daemon.socket_path) for _ in range(2)]
    for rank, sock in enumerate(socks):
        sock.sendall(p.encode_frame(
            p.Hello(1, p.PROTOCOL_VERSION, "together", rank, 2, rank, "cpu", 64 << 20)))
    replies = []
    for sock in socks:
        reply, fds = read_reply(sock)
        replies.append(reply)
        assert len(fds) == 1
        os.close(fds[0])
    assert all(isinstance(r, p.HelloOk) for r in replies)
    status = call(socks[0], p.NodeStatus(2))
    assert isinstance(status, p.StatsOk)
    assert status.stats["jobs"]["together"]["sessions"] == 2
    assert status.stats["jobs"]["together"]["arena_nbytes"] == 64 << 20
    for sock in socks:
        sock.close()
