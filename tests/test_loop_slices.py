"""Large allocs and puts are created in slices: other jobs are served while a 200k-id
batch is made, and a batch that fails in a late slice leaves nothing behind."""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import JOB_ARENA_NBYTES, raw_socket, read_reply, served_during, start_daemon

from offloadd import protocol as p
from offloadd.errors import LeaseConflictError, OverBudgetError, ShardExistsError
from offloadd.memory.arena import Arena
from offloadd.memory.shards import Lease, Shard, ShardTable
from offloadd.ops.embedded import PrivateDaemon
from offloadd.protocol import Placed
from offloadd.service.batches import SLICE_IDS
from offloadd.service.jobs import Job
from trainer.client import OffloadClient

NUM_IDS = int(os.environ.get("OFFLOADD_TEST_BATCH_IDS", "200000"))
PAGE = 4096


@pytest.fixture(scope="module")
def big_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateDaemon]:
    workdir = tmp_path_factory.mktemp("offloadd")
    swap_dir = workdir / "swap"
    swap_dir.mkdir()
    instance = start_daemon(workdir, arena_size=f"{2 * NUM_IDS * PAGE // (1 << 20) + 128}MiB",
                            extra_args=["--swap-dir", str(swap_dir)])
    yield instance
    assert instance.stop() == 0


def hello(daemon: PrivateDaemon, job: str, arena_nbytes: int
          ) -> tuple[socket.socket, mmap.mmap]:
    """A raw session of ``job`` (rank 0) and its arena mapped here."""
    sock = raw_socket(daemon.socket_path, timeout_s=120)
    sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, job, 0, 1, 0, "cpu",
                                        arena_nbytes)))
    reply, fds = read_reply(sock)
    assert isinstance(reply, p.HelloOk), reply
    arena = mmap.mmap(fds[0], reply.arena_nbytes)
    for fd in fds:
        os.close(fd)
    return sock, arena


def ask(sock: socket.socket, request: p.Request) -> p.Reply:
    sock.sendall(p.encode_frame(request))
    reply = read_reply(sock)[0]
    assert reply is not None and reply.rid == request.rid
    return reply


@pytest.fixture
def witness(big_daemon: PrivateDaemon) -> Iterator[OffloadClient]:
    client = OffloadClient.connect(big_daemon.socket_path, job="witness",
                                   arena_nbytes=JOB_ARENA_NBYTES, timeout_s=60)
    client.put("w", b"witness")
    yield client
    client.close()


def test_other_jobs_are_served_during_a_200k_id_alloc(big_daemon: PrivateDaemon,
                                                      witness: OffloadClient) -> None:
    ids = [f"a{i}" for i in range(NUM_IDS)]
    sock, arena = hello(big_daemon, "alloc", NUM_IDS * PAGE)
    reply, during = served_during(sock, p.Alloc(2, ids, [1] * NUM_IDS, ["uint8"] * NUM_IDS),
                                  witness)
    assert isinstance(reply, p.Placed), reply
    # Unsliced, the whole alloc runs in one callback and the witness gets nothing.
    assert during > 3, during
    assert len(set(reply.offsets)) == NUM_IDS and min(reply.offsets) >= 0
    assert reply.nbytes == [1] * NUM_IDS and reply.dtypes == ["uint8"] * NUM_IDS
    # Its stats count 200k shards, a slice per loop turn: the witness is served meanwhile.
    stats, during = served_during(sock, p.Stats(3), witness)
    assert isinstance(stats, p.StatsOk)
    assert during > 3, during
    assert stats.stats["num_shards"] == NUM_IDS and stats.stats["shard_nbytes"] == NUM_IDS
    residency = stats.stats["residency"]
    assert isinstance(residency, dict) and residency["arena_clean"] == NUM_IDS
    assert sum(residency.values()) == NUM_IDS
    assert stats.stats["arena_used_nbytes"] == NUM_IDS * PAGE
    status = ask(sock, p.NodeStatus(4))
    assert isinstance(status, p.StatsOk)
    assert status.stats["jobs"]["alloc"]["residency"] == residency  # type: ignore[index]
    assert isinstance(ask(sock, p.CloseJob(5)), p.Ok)
    arena.close()
    sock.close()


def test_other_jobs_are_served_during_a_200k_id_put(big_daemon: PrivateDaemon,
                                                    witness: OffloadClient) -> None:
    ids = [f"p{i}" for i in range(NUM_IDS)]
    sock, arena = hello(big_daemon, "put", NUM_IDS * PAGE)
    reply, during = served_during(
        sock, p.Acquire(2, ids, "w", [2] * NUM_IDS, ["uint8"] * NUM_IDS), witness)
    assert isinstance(reply, p.Placed), reply
    assert during > 3, during
    view = np.frombuffer(arena, dtype=np.uint8)
    expected = (np.arange(NUM_IDS) % 251).astype(np.uint8)
    offsets = np.asarray(reply.offsets)
    view[offsets] = expected
    view[offsets + 1] = expected ^ 0xFF
    assert isinstance(ask(sock, p.Release(3, ids, True)), p.Ok)
    read = ask(sock, p.Acquire(4, ids, "r"))
    assert isinstance(read, p.Placed)
    assert read.versions == [1] * NUM_IDS and read.nbytes == [2] * NUM_IDS
    offsets = np.asarray(read.offsets)
    assert np.array_equal(view[offsets], expected)
    assert np.array_equal(view[offsets + 1], expected ^ 0xFF)
    del view
    assert isinstance(ask(sock, p.Release(5, ids, False)), p.Ok)
    assert isinstance(ask(sock, p.CloseJob(6)), p.Ok)
    arena.close()
    sock.close()


def footprint(sock: socket.socket, rid: int) -> tuple[object, ...]:
    stats = ask(sock, p.Stats(rid))
    assert isinstance(stats, p.StatsOk)
    s = stats.stats
    return (s["num_shards"], s["arena_used_nbytes"], s["swap_used_nbytes"], s["leased_nbytes"])


def test_a_put_that_conflicts_in_its_last_slice_leaves_nothing(
        big_daemon: PrivateDaemon) -> None:
    """The last id of a 3-slice put is leased by another session: the put fails after
    two slices were created and leased, and every one of them is gone again."""
    existing = "held"
    sock, arena = hello(big_daemon, "conflict", 64 << 20)
    other, other_arena = hello(big_daemon, "conflict", 0)
    assert isinstance(ask(other, p.Acquire(2, [existing], "w", [100], ["uint8"])), p.Placed)
    assert isinstance(ask(other, p.Release(3, [existing], True)), p.Ok)
    assert isinstance(ask(other, p.Acquire(4, [existing], "r")), p.Placed)
    before = footprint(sock, 2)
    ids = [f"c{i}" for i in range(2 * SLICE_IDS + 7)] + [existing]
    sizes = [1] * (len(ids) - 1) + [100]
    reply = ask(sock, p.Acquire(3, ids, "w", sizes, ["uint8"] * len(ids)))
    assert isinstance(reply, p.ErrorReply) and reply.code == LeaseConflictError.code.value
    assert footprint(sock, 4) == before
    assert isinstance(ask(other, p.Release(5, [existing], False)), p.Ok)
    # Nothing of the failed batch is left: the same put now succeeds from scratch.
    assert isinstance(ask(sock, p.Acquire(5, ids, "w", sizes, ["uint8"] * len(ids))), p.Placed)
    assert isinstance(ask(sock, p.Release(6, ids, False)), p.Ok)
    for client in (other, sock):
        client.close()
    arena.close()
    other_arena.close()


def test_an_alloc_that_finds_no_room_in_its_last_slice_leaves_nothing(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without swap, a batch whose total fits the free bytes but whose last shard fits no
    free extent (the arena is a comb of one-page holes) fails and frees what it placed."""
    instance = start_daemon(tmp_path_factory.mktemp("offloadd"), arena_size="64MiB")
    try:
        num_pages = 3 * SLICE_IDS
        sock, arena = hello(instance, "comb", num_pages * PAGE)
        comb = [f"k{i}" for i in range(num_pages)]
        assert isinstance(ask(sock, p.Alloc(2, comb, [PAGE] * num_pages,
                                            ["uint8"] * num_pages)), p.Placed)
        assert isinstance(ask(sock, p.Drop(3, comb[::2])), p.Ok)
        before = footprint(sock, 4)
        ids = [f"n{i}" for i in range(SLICE_IDS + 5)] + ["wide"]
        sizes = [1] * (len(ids) - 1) + [2 * PAGE]
        reply = ask(sock, p.Alloc(5, ids, sizes, ["uint8"] * len(ids)))
        assert isinstance(reply, p.ErrorReply) and reply.code == OverBudgetError.code.value
        assert "wide" in reply.message
        assert footprint(sock, 6) == before
        # Over the free bytes in total: refused before anything is created.
        too_many = [f"m{i}" for i in range(num_pages // 2 + 1)]
        reply = ask(sock, p.Alloc(7, too_many, [1] * len(too_many), ["uint8"] * len(too_many)))
        assert isinstance(reply, p.ErrorReply) and reply.code == OverBudgetError.code.value
        assert "the batch creates" in reply.message
        assert footprint(sock, 8) == before
        arena.close()
        sock.close()
    finally:
        assert instance.stop() == 0


class LoopTurns:
    """Counts calls of ``table.<method>`` (removals, lease give-backs) between two turns
    of the loop."""

    def __init__(self, table: ShardTable, method: str = "remove") -> None:
        self.removed = 0
        self.most_per_turn = 0
        real = getattr(table, method)

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.removed += 1
            return real(*args, **kwargs)

        setattr(table, method, counting)
        self.stop = asyncio.Event()
        self.task = asyncio.ensure_future(self.tick())

    async def tick(self) -> None:
        seen = 0  # from construction on, not from this task's first turn
        while True:
            self.most_per_turn = max(self.most_per_turn, self.removed - seen)
            seen = self.removed
            if self.stop.is_set():
                return
            await asyncio.sleep(0)

    async def close(self) -> None:
        self.stop.set()
        await self.task


def test_an_id_created_between_slices_fails_the_batch_and_frees_the_rest(
        run_async: Callable[..., Any]) -> None:
    """Another session creates an id of the batch's last slice while the first slices
    are being made: the batch fails with ShardExistsError, only that shard is left, and
    the undo removed the others a slice per turn of the loop."""
    ids = [f"s{i}" for i in range(3 * SLICE_IDS + 1)]

    async def scenario() -> None:
        job = Job("between", Arena("between", len(ids) * PAGE, lock=False))
        try:
            pending = asyncio.ensure_future(job.alloc(0, ids, [1] * len(ids),  # type: ignore[arg-type]
                                                      ["uint8"] * len(ids), {}, "w"))
            while (0, ids[2 * SLICE_IDS]) not in job.table.shards:
                await asyncio.sleep(0)
            assert (0, ids[-1]) not in job.table.shards
            job.alloc(0, [ids[-1]], [1], ["uint8"])
            turns = LoopTurns(job.table)
            with pytest.raises(ShardExistsError, match=ids[-1]):
                await pending
            await turns.close()
            assert turns.removed == 3 * SLICE_IDS
            assert turns.most_per_turn <= SLICE_IDS, turns.most_per_turn
            assert list(job.table.shards) == [(0, ids[-1])]
            assert job.arena.allocator.used_nbytes == PAGE
            assert job.table.leased_nbytes() == 0
        finally:
            job.arena.close()

    run_async(scenario())


def test_a_batch_cancelled_mid_way_is_undone_completely(
        run_async: Callable[..., Any]) -> None:
    """A put whose session closes while its second slice is made (the request's task is
    cancelled) still gives back every lease and removes every shard it created."""
    ids = [f"s{i}" for i in range(3 * SLICE_IDS)]

    async def scenario() -> None:
        job = Job("cancelled", Arena("cancelled", len(ids) * PAGE, lock=False))
        leases: dict[Shard, Lease] = {}
        try:
            pending = asyncio.ensure_future(job.alloc(0, ids, [1] * len(ids),  # type: ignore[arg-type]
                                                      ["uint8"] * len(ids), leases, "w"))
            while (0, ids[SLICE_IDS]) not in job.table.shards:
                await asyncio.sleep(0)
            assert job.table.leased_nbytes() == 2 * SLICE_IDS * PAGE
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            while job.table.shards:  # the undo goes on in its own task
                await asyncio.sleep(0)
            assert job.arena.allocator.used_nbytes == 0
            assert job.table.leased_nbytes() == 0 and not leases
        finally:
            job.arena.close()

    run_async(scenario())


def test_a_sliced_acquire_gives_back_a_slice_per_loop_turn(
        run_async: Callable[..., Any]) -> None:
    """The last id of a 3-slice acquire is leased for writing by another session: the
    acquire fails and gives back the two slices it leased a slice per turn of the loop."""
    ids = [f"s{i}" for i in range(3 * SLICE_IDS)]

    async def scenario() -> None:
        job = Job("giveback", Arena("giveback", len(ids) * PAGE, lock=False))
        try:
            assert isinstance(await job.alloc(0, ids, [1] * len(ids),  # type: ignore[misc]
                                              ["uint8"] * len(ids)), Placed)
            writer: dict[Shard, Lease] = {}
            assert isinstance(job.acquire(0, [ids[-1]], "w", writer), Placed)
            turns = LoopTurns(job.table, "give_back")
            leases: dict[Shard, Lease] = {}
            with pytest.raises(LeaseConflictError):
                await job.acquire(0, ids, "r", leases)  # type: ignore[misc]
            await turns.close()
            assert turns.removed == 2 * SLICE_IDS
            assert turns.most_per_turn <= SLICE_IDS, turns.most_per_turn
            assert not leases and job.table.leased_nbytes() == PAGE
        finally:
            job.arena.close()

    run_async(scenario())
