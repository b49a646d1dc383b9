"""Bad input against the real daemon: each gets a typed error or a closed connection, the
daemon stays up, and a second, concurrent session (``witness``) keeps working after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import msgspec
import pytest
from conftest import (
    JOB_ARENA_NBYTES,
    call,
    error_code,
    hello,
    is_closed,
    raw_socket,
    read_reply,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offloadd import protocol as p
from offloadd.errors import (
    LeaseConflictError,
    NotLeasedError,
    OverBudgetError,
    UnknownShardError,
)
from offloadd.ops.embedded import PrivateDaemon


def session(daemon: PrivateDaemon, job: str, rank: int = 0):  # type: ignore[no-untyped-def]
    sock = raw_socket(daemon.socket_path)
    assert isinstance(hello(sock, job, rank=rank, world_size=2), p.HelloOk)
    return sock


# -- framing ----------------------------------------------------------------------------


@pytest.mark.parametrize("after_hello", [False, True])
def test_garbage_payload_gets_bad_frame_and_the_session_goes_on(
        daemon: PrivateDaemon, job: str, witness, after_hello: bool) -> None:
    sock = session(daemon, job) if after_hello else raw_socket(daemon.socket_path)
    sock.sendall(p.HEADER.pack(7) + b"\xc1garbag")
    reply, _ = read_reply(sock)
    assert error_code(reply) == "bad_frame"
    assert "cannot decode" in reply.message  # type: ignore[union-attr]
    expected = p.StatsOk if after_hello else p.ErrorReply  # no_session before hello
    assert isinstance(call(sock, p.Stats(2)), expected)
    witness()


def test_invalid_utf8_in_a_request_gets_bad_frame_and_the_session_goes_on(
        daemon: PrivateDaemon, job: str, witness) -> None:
    sock = session(daemon, job)
    payload = msgspec.msgpack.encode(["drop", 3, ["shard"]]).replace(b"shard", b"sh\xffrd")
    sock.sendall(p.HEADER.pack(len(payload)) + payload)
    assert error_code(read_reply(sock)[0]) == "bad_frame"
    assert isinstance(call(sock, p.Stats(4)), p.StatsOk)
    witness()


def test_random_garbage_without_framing_closes_the_connection(daemon: PrivateDaemon,
                                                              witness) -> None:
    sock = raw_socket(daemon.socket_path)
    sock.sendall(b"\xff" * 64)  # reads as a 4 GiB length prefix
    reply, _ = read_reply(sock)
    assert error_code(reply) == "bad_frame"
    assert is_closed(sock)
    witness()


def test_oversize_length_prefix_is_refused_before_any_payload(daemon: PrivateDaemon, job: str,
                                                             witness) -> None:
    sock = session(daemon, job)
    sock.sendall(p.HEADER.pack(p.MAX_FRAME_NBYTES + 1))
    reply, _ = read_reply(sock)
    assert error_code(reply) == "bad_frame"
    assert "exceeds" in reply.message  # type: ignore[union-attr]
    assert is_closed(sock)
    witness()


def test_a_frame_of_exactly_the_limit_is_read_and_answered(daemon: PrivateDaemon, job: str,
                                                          witness) -> None:
    sock = session(daemon, job)
    sock.sendall(p.HEADER.pack(p.MAX_FRAME_NBYTES) + b"\xc1" * p.MAX_FRAME_NBYTES)
    reply, _ = read_reply(sock)
    assert error_code(reply) == "bad_frame"
    assert isinstance(call(sock, p.Stats(3)), p.StatsOk)  # not closed: the frame was legal
    witness()


def test_truncated_frame_is_buffered_until_complete(daemon: PrivateDaemon, job: str,
                                                   witness) -> None:
    sock = session(daemon, job)
    frame = p.encode_frame(p.Stats(11))
    sock.sendall(frame[:3])
    sock.settimeout(0.3)
    assert not is_closed(sock)  # nothing answered yet, nothing misread
    sock.sendall(frame[3:-2])
    assert not is_closed(sock)
    sock.settimeout(10)
    sock.sendall(frame[-2:])
    reply, _ = read_reply(sock)
    assert isinstance(reply, p.StatsOk) and reply.rid == 11
    witness()


def test_truncated_frame_then_disconnect_harms_nobody(daemon: PrivateDaemon, job: str,
                                                     witness) -> None:
    sock = session(daemon, job)
    sock.sendall(p.HEADER.pack(1000) + b"\x00" * 10)
    sock.close()
    witness()


@pytest.mark.parametrize("message", [
    ["no_such_op", 5],
    ["acquire", 5, ["a"], "x"],
    ["alloc", 5, ["a"], [-1, 2], ["uint8"]],  # (length mismatch is a typed invalid, below)
    [],
    "just a string",
])
def test_unknown_ops_and_malformed_requests_get_bad_frame(daemon: PrivateDaemon, job: str,
                                                         witness, message: object) -> None:
    sock = session(daemon, job)
    payload = msgspec.msgpack.encode(message)
    sock.sendall(p.HEADER.pack(len(payload)) + payload)
    reply, _ = read_reply(sock)
    if message and message[0] == "alloc":  # type: ignore[index]
        assert error_code(reply) == "invalid"  # well-formed but the lists disagree
    else:
        assert error_code(reply) == "bad_frame"
    assert isinstance(call(sock, p.Stats(6)), p.StatsOk)
    witness()


def test_wrong_protocol_version_is_a_typed_error(daemon: PrivateDaemon, job: str,
                                                witness) -> None:
    sock = raw_socket(daemon.socket_path)
    for version in (0, p.PROTOCOL_VERSION + 1, 2**31):
        assert error_code(hello(sock, job, version=version)) == "version_mismatch"
    assert isinstance(hello(sock, job), p.HelloOk)
    witness()


@pytest.mark.parametrize("request_", [
    p.Alloc(1, ["a"], [-5], ["uint8"]),
    p.Alloc(1, ["a"], [8], ["complex128"]),
    p.Alloc(1, [""], [8], ["uint8"]),
    p.Alloc(1, ["x" * 257], [8], ["uint8"]),
    p.Acquire(1, ["a"], "w", [8, 8]),
    p.Flush(1, "a/b"),
])
def test_bad_arguments_are_invalid_or_typed(daemon: PrivateDaemon, job: str, witness,
                                           request_: p.Request) -> None:
    sock = session(daemon, job)
    assert error_code(call(sock, request_)) in ("invalid", "no_swap")
    witness()


# -- shards -----------------------------------------------------------------------------


def test_unknown_shard_ids_are_named_in_the_error_and_lease_nothing(connect, witness) -> None:
    client = connect()
    client.put("known", b"k")
    for operation in (lambda: client.acquire_many(["known", "ghost1", "ghost2"], "r"),
                      lambda: client.prefetch(["ghost1"]),
                      lambda: client.drop(["known", "ghost2"]),
                      lambda: client.get("ghost1")):
        with pytest.raises(UnknownShardError) as caught:
            operation()
        assert caught.value.shard_ids and set(caught.value.shard_ids) <= {"ghost1", "ghost2"}
    assert client.stats()["leased_nbytes"] == 0
    assert client.get("known") == b"k"  # the failed drop dropped nothing
    witness()


def test_release_of_a_shard_not_leased_is_not_leased(daemon: PrivateDaemon, job: str,
                                                    connect) -> None:
    client = connect()
    client.put("s", b"1")
    sock = session(daemon, job)
    assert error_code(call(sock, p.Release(4, ["s"], False))) == "not_leased"
    with pytest.raises(NotLeasedError):
        client._call(p.Release(0, ["s"], False))


def test_alloc_larger_than_the_arena_is_over_budget(connect, witness) -> None:
    client = connect()
    with pytest.raises(OverBudgetError, match="exceeds"):
        client.alloc("huge", JOB_ARENA_NBYTES + 1)
    with pytest.raises(OverBudgetError):
        client.put("huge", b"\0" * (JOB_ARENA_NBYTES + 1))
    with pytest.raises(OverBudgetError):
        client.alloc("enormous", 2**62)
    assert client.stats()["arena_used_nbytes"] == 0
    client.put("fits", b"\1" * JOB_ARENA_NBYTES)  # exactly the arena still works
    witness()


def test_filling_the_arena_is_over_budget_and_drop_makes_room(connect, witness) -> None:
    client = connect()
    client.alloc([f"p{i}" for i in range(JOB_ARENA_NBYTES // 4096)], 4096)
    with pytest.raises(OverBudgetError, match="arena is full"):
        client.alloc("one-more", 1)
    client.drop("p0")
    client.alloc("one-more", 1)
    witness()


def test_a_failed_batched_alloc_creates_no_shards(connect) -> None:
    client = connect()
    with pytest.raises(OverBudgetError):
        client.alloc(["a", "b", "too-big"], [4096, 4096, JOB_ARENA_NBYTES + 1])
    assert client.stats()["num_shards"] == 0


def test_another_job_can_neither_name_nor_see_a_jobs_shards(connect, job: str,
                                                            witness) -> None:
    owner = connect(job)
    secret = os.urandom(64 << 10)
    owner.put("secret", secret)
    stranger = connect(f"{job}-stranger")
    with pytest.raises(UnknownShardError):
        stranger.get("secret")
    with pytest.raises(UnknownShardError):
        stranger.drop("secret")
    stats = stranger.stats()
    assert stats["num_shards"] == 0 and stats["job"] == f"{job}-stranger"
    # Its arena is another memfd, zero-filled: job A's bytes are nowhere in it.
    assert bytes(stranger.arena.view) == b"\0" * stranger.arena.nbytes
    stranger.put("secret", b"mine")  # the same id in another job is another shard
    assert owner.get("secret") == secret and stranger.get("secret") == b"mine"
    witness()


def test_shard_ids_are_per_rank_within_a_job(connect, job: str) -> None:
    rank0, rank1 = connect(job, rank=0, world_size=2), connect(job, rank=1, world_size=2)
    rank0.put("u0.param", b"zero")
    with pytest.raises(UnknownShardError):
        rank1.get("u0.param")
    rank1.put("u0.param", b"one")
    assert (rank0.get("u0.param"), rank1.get("u0.param")) == (b"zero", b"one")


# -- a client that goes away while holding leases ------------------------------------------

HOLDER = textwrap.dedent("""
    import os, sys
    from trainer.client import OffloadClient
    client = OffloadClient.connect(sys.argv[1], job=sys.argv[2], rank=1, world_size=2,
                                   arena_nbytes=int(sys.argv[3]))
    client.put("kept", b"committed")
    writing = client.acquire("kept", "w")
    writing.view[:4] = b"torn"  # dies mid-write, holding the write lease
    client.put("read", b"r" * 5000)
    reading = client.acquire_many(["read", "read"], "r")
    print("holding", flush=True)
    sys.stdin.read()  # killed here
""")


def test_a_killed_client_loses_its_leases_but_its_shards_stay_with_the_job(
        daemon: PrivateDaemon, connect, job: str, witness) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.socket_path, job,
                               str(JOB_ARENA_NBYTES)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    peer = connect(job, rank=0, world_size=2)
    # "kept" (1 page, w) and "read" (2 pages, r twice: a shard's pages count once)
    assert peer.stats()["leased_nbytes"] == 3 * 4096
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    witness()  # (a round trip, so the daemon has seen the disconnect by now)
    stats = peer.stats()
    assert stats["leased_nbytes"] == 0 and stats["num_shards"] == 2
    assert stats["sessions"] == 1
    back = connect(job, rank=1, world_size=2)  # the same job and rank reconnects
    with back.acquire("kept", "w") as lease:  # the dead writer's lease is gone
        assert bytes(lease.view) == b"tornitted"  # what it wrote before dying
    assert back.get("read") == b"r" * 5000
    used = back.stats()["arena_used_nbytes"]
    back.drop(["kept", "read"])
    assert back.stats()["arena_used_nbytes"] == used - 3 * 4096
    assert back.stats()["num_shards"] == 0


def test_a_closed_socket_with_leases_frees_them(daemon: PrivateDaemon, connect, job: str,
                                                witness) -> None:
    client = connect()
    client.put("s", b"1")
    sock = session(daemon, job)
    sock.sendall(p.encode_frame(p.Acquire(1, ["s"], "w")))
    assert isinstance(read_reply(sock)[0], p.Placed)
    with pytest.raises(LeaseConflictError):
        client.acquire("s", "r")
    sock.close()
    witness()
    with client.acquire("s", "w"):
        pass


# -- backpressure and fuzz ----------------------------------------------------------------


def test_a_client_that_never_reads_replies_is_throttled_not_buffered(
        daemon: PrivateDaemon, job: str, witness) -> None:
    """The daemon stops reading a session whose replies pile up (its memory stays bounded):
    the client's own send blocks. Other sessions are served meanwhile."""
    sock = session(daemon, job)
    batch = p.encode_frame(p.Stats(1)) * 100
    sock.settimeout(2.0)
    sent_batches = 0
    with pytest.raises(TimeoutError):
        for _ in range(2000):  # 200k requests would be ~150 MB of replies
            sock.sendall(batch)
            sent_batches += 1
    witness()
    sock.settimeout(30)
    for _ in range(sent_batches * 100):  # every reply still arrives once we read
        assert isinstance(read_reply(sock)[0], p.StatsOk)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prefix=st.sampled_from(["none", "hello", "frame"]), noise=st.binary(max_size=300))
def test_random_bytes_never_kill_the_daemon(daemon: PrivateDaemon, witness, prefix: str,
                                            noise: bytes) -> None:
    sock = raw_socket(daemon.socket_path, timeout_s=0.2)
    if prefix == "hello":
        sock.settimeout(10)
        assert isinstance(hello(sock, "fuzz"), p.HelloOk)
        sock.settimeout(0.2)
    data = p.HEADER.pack(len(noise)) + noise if prefix == "frame" else noise
    try:
        sock.sendall(data)
        while True:  # whatever comes back is a well-formed reply frame
            reply, _fds = read_reply(sock)
            if reply is None:
                break
            assert isinstance(reply, p.Reply)
    except TimeoutError:
        pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon closed on an oversize prefix
    finally:
        sock.close()
    assert daemon.process.poll() is None
    witness()
