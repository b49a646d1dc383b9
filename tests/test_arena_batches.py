"""Large batches are served in slices: other jobs are answered while a 200k-id acquire
runs, and the sliced acquire still succeeds or fails as a whole."""

from __future__ import annotations

import os

import pytest
from conftest import JOB_ARENA_NBYTES, raw_socket, read_reply, served_during

from offloadd import protocol as p
from offloadd.errors import LeaseConflictError
from offloadd.ops.embedded import PrivateDaemon
from offloadd.service.batches import SLICE_IDS
from trainer.client import OffloadClient

NUM_IDS = int(os.environ.get("OFFLOADD_TEST_BATCH_IDS", "200000"))


def big_session(daemon: PrivateDaemon, job: str, ids: list[str]):  # type: ignore[no-untyped-def]
    sock = raw_socket(daemon.socket_path, timeout_s=120)
    sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, job, 0, 1, 0, "cpu",
                                        len(ids) * 4096 + (4 << 20))))
    reply, fds = read_reply(sock)
    for fd in fds:
        os.close(fd)
    assert isinstance(reply, p.HelloOk), reply
    sock.sendall(p.encode_frame(p.Alloc(2, ids, [1] * len(ids), ["uint8"] * len(ids))))
    assert isinstance(read_reply(sock)[0], p.Placed)
    return sock


@pytest.fixture(scope="module")
def big_daemon(tmp_path_factory: pytest.TempPathFactory) -> PrivateDaemon:
    from conftest import start_daemon

    instance = start_daemon(tmp_path_factory.mktemp("offloadd"), arena_size="1200MiB")
    yield instance  # type: ignore[misc]
    assert instance.stop() == 0


def test_other_jobs_are_served_during_a_200k_id_acquire(big_daemon: PrivateDaemon) -> None:
    ids = [f"s{i}" for i in range(NUM_IDS)]
    sock = big_session(big_daemon, "big", ids)
    witness = OffloadClient.connect(big_daemon.socket_path, job="witness",
                                    arena_nbytes=JOB_ARENA_NBYTES, timeout_s=60)
    witness.put("w", b"witness")
    reply, during = served_during(sock, p.Acquire(3, ids, "r"), witness)
    assert isinstance(reply, p.Placed) and len(reply.offsets) == NUM_IDS
    # Unsliced, the whole acquire runs in one callback and the witness gets nothing.
    assert during > 3, during
    sock.sendall(p.encode_frame(p.Stats(4)))
    stats = read_reply(sock)[0]
    assert stats.stats["leased_nbytes"] == NUM_IDS * 4096  # type: ignore[union-attr]
    sock.sendall(p.encode_frame(p.Release(5, ids, False)))
    assert isinstance(read_reply(sock)[0], p.Ok)
    sock.sendall(p.encode_frame(p.Drop(6, ids)))
    assert isinstance(read_reply(sock)[0], p.Ok)
    sock.sendall(p.encode_frame(p.Stats(7)))
    stats = read_reply(sock)[0]
    assert stats.stats["leased_nbytes"] == 0 and stats.stats["num_shards"] == 0  # type: ignore[union-attr]
    sock.close()
    witness.close()


def test_a_sliced_acquire_that_fails_in_a_late_slice_leases_nothing(
        big_daemon: PrivateDaemon) -> None:
    ids = [f"t{i}" for i in range(3 * SLICE_IDS + 5)]
    sock = big_session(big_daemon, "conflict", ids)
    other = raw_socket(big_daemon.socket_path)
    other.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, "conflict", 0, 1, 0, "cpu", 0)))
    _, fds = read_reply(other)
    for fd in fds:
        os.close(fd)
    other.sendall(p.encode_frame(p.Acquire(2, [ids[-1]], "w")))
    assert isinstance(read_reply(other)[0], p.Placed)
    sock.sendall(p.encode_frame(p.Acquire(3, ids, "r")))
    reply = read_reply(sock)[0]
    assert isinstance(reply, p.ErrorReply) and reply.code == LeaseConflictError.code.value
    sock.sendall(p.encode_frame(p.Stats(4)))
    assert read_reply(sock)[0].stats["leased_nbytes"] == 4096  # type: ignore[union-attr]
    other.sendall(p.encode_frame(p.Release(3, [ids[-1]], False)))
    assert isinstance(read_reply(other)[0], p.Ok)
    sock.sendall(p.encode_frame(p.Acquire(5, ids, "w")))
    assert isinstance(read_reply(sock)[0], p.Placed)
    other.close()
    sock.close()
