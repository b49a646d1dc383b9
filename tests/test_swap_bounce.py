"""Swap IO of a 4 KiB-page arena is staged through bounce slots (``offloadd.swap.bounce``);
a hugetlb arena's is not. Each test runs a real daemon process on real swap files.

- random shards through a tiny arena (every shard is evicted and read back) come back
  byte for byte, and every byte the daemon wrote to or read from swap went through a
  slot (the daemon's ``swap.bounce`` stats), with every engine the host has;
- on a hugetlb arena the same round trip does its IO in place: no byte is staged;
- an IO error injected into a staged write or read (``OFFLOADD_IO_FAULT``) fails its
  request with SwapIOError, gives its slot back, and loses no shard's bytes;
- chunks larger than a slot (flushed with a bigger ``chunk_size``, recovered under a
  smaller one) are read in place, and come back byte for byte;
- a staged transfer whose caller is cancelled keeps its slot until the kernel is done;
- the slots are backed once a job outgrows its arena (registered, or recovered so), not
  at the first swap-out, and backing them never writes a slot some IO holds.

Nothing here is timed: the speed is ``bench/nvme_throughput.py``'s (``--unstaged``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import connect_reserving, wait_bounce_backed
from test_nvme_recovery import stopped_cleanly

from offloadd.config import DaemonConfig
from offloadd.errors import SwapIOError
from offloadd.metrics import DaemonMetrics
from offloadd.ops.embedded import PrivateDaemon
from offloadd.swap import ioengine
from offloadd.swap.nvme import SwapSpace
from offloadd.swap.scheduler import Priority
from trainer.client import OffloadClient

MIB = 1 << 20
ARENA_NBYTES = 16 * MIB
JOB = "bounce"


@contextlib.contextmanager
def running(root: Path, extra_args: list[str],
            huge_pages: Callable[[int], None] | None = None) -> Iterator[OffloadClient]:
    """A daemon with a 16 MiB arena swapping to ``root/nvme0``, and one client. With
    ``huge_pages`` the arena's pages are reserved right before the hello, and again if a
    daemon of a concurrent test (``arena_hugepages = "auto"``, the default) took them in
    between: the pool is the node's, not this test's."""
    daemon = PrivateDaemon.start(root / "run", arena_size=ARENA_NBYTES,
                                 swap_dirs=[str(root / "nvme0")], extra_args=extra_args)
    with stopped_cleanly(daemon), connect_reserving(
            daemon.socket_path, huge_pages, job=JOB, arena_nbytes=ARENA_NBYTES,
            timeout_s=60) as client:
        yield client


def put_random_shards(client: OffloadClient, count: int, seed: int) -> dict[str, bytes]:
    """``count`` shards of random sizes (sub-page tails, several chunks) and bytes."""
    rng = random.Random(seed)
    shards = {}
    for index in range(count):
        nbytes = rng.choice([4096, 5 * MIB - 3, 9 * MIB + 4097, rng.randrange(1, 3 * MIB)])
        data = rng.randbytes(nbytes)
        client.put(f"s{index}", data)
        shards[f"s{index}"] = data
    return shards


def read_back_and_compare(client: OffloadClient, shards: dict[str, bytes]) -> None:
    for shard_id, data in shards.items():
        with client.acquire(shard_id) as lease:
            assert bytes(lease.view) == data, shard_id


def swap_stats(client: OffloadClient) -> dict[str, Any]:
    """The daemon's swap stats once it is not backing its bounce slots: a slot being
    backed is in use, and the tests count the slots in use (the backing starts when the
    job outgrows its arena, ``SwapSpace.stage_ahead``)."""
    for _ in range(1200):
        swap = client.stats()["swap"]
        assert swap is not None
        if not swap["bounce"].get("prefault_running"):
            return swap
        time.sleep(0.05)
    raise AssertionError(f"the bounce slots were still being backed after 60 s: {swap}")


def require_o_direct(client: OffloadClient) -> None:
    if not swap_stats(client)["dirs"][0]["direct"]:
        pytest.skip("the swap dir's file system refuses O_DIRECT: no staging to test")


@pytest.mark.parametrize("engine", ioengine.available_engine_kinds())
def test_a_4k_page_arena_stages_every_swap_byte_and_round_trips_them(swap_root: Path,
                                                                     engine: str) -> None:
    with running(swap_root, ["--arena-hugepages", "off", "--io-engine", engine]) as client:
        require_o_direct(client)
        assert client.stats()["arena_hugepages"] is False
        shards = put_random_shards(client, 14, seed=7)  # ~4x the arena: most go to swap
        client.flush("one")
        read_back_and_compare(client, shards)  # each evicted one comes back from swap
        read_back_and_compare(client, shards)
        swap = swap_stats(client)
        written, read = swap["dirs"][0]["written_nbytes"], swap["dirs"][0]["read_nbytes"]
        assert written > 2 * ARENA_NBYTES and read > 2 * ARENA_NBYTES
        bounce = swap["bounce"]
        assert bounce["enabled"] and bounce["in_place"] == 0
        assert (bounce["written_nbytes"], bounce["read_nbytes"]) == (written, read)
        assert bounce["in_use"] == 0
        assert swap["checksum_failures"] == 0


def test_a_hugetlb_arena_does_its_swap_io_in_place(swap_root: Path,
                                                   huge_pages: Callable[[int], None]) -> None:
    with running(swap_root, ["--arena-hugepages", "on"], huge_pages) as client:
        require_o_direct(client)
        assert client.stats()["arena_hugepages"] is True
        shards = put_random_shards(client, 10, seed=11)
        client.flush("one")
        read_back_and_compare(client, shards)
        swap = swap_stats(client)
        assert swap["dirs"][0]["written_nbytes"] > ARENA_NBYTES
        assert swap["dirs"][0]["read_nbytes"] > ARENA_NBYTES
        bounce = swap["bounce"]
        assert (bounce["written_nbytes"], bounce["read_nbytes"], bounce["in_place"]) == (0, 0, 0)


@pytest.mark.parametrize("fault", ["write:3", "read:2"])
def test_an_io_error_in_a_staged_transfer_is_typed_and_loses_nothing(
        swap_root: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    monkeypatch.setenv("OFFLOADD_IO_FAULT", fault)
    with running(swap_root, ["--arena-hugepages", "off"]) as client:
        require_o_direct(client)
        shards: dict[str, bytes] = {}
        failures: list[SwapIOError] = []
        for index in range(12):  # 4 MiB each: three times the arena
            data = os.urandom(4 * MIB)
            try:
                client.put(f"s{index}", data)
            except SwapIOError as exc:  # the put whose room a failed write-back was for
                failures.append(exc)
                client.put(f"s{index}", data)  # the fault was transient: the retry works
            shards[f"s{index}"] = data
        client.flush("one")
        for shard_id, data in shards.items():
            try:
                got = client.get(shard_id)
            except SwapIOError as exc:  # the read that met the fault
                failures.append(exc)
                got = client.get(shard_id)
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), shard_id
        op = fault.partition(":")[0]
        swap = swap_stats(client)
        assert swap["io_errors"] == {op: 1}
        assert all(f"swap {op}" in exc.message and "Input/output error" in exc.message
                   for exc in failures)
        if op == "read":
            assert len(failures) == 1  # a demand read fails its own request
        assert swap["bounce"]["in_use"] == 0  # the failed transfer gave its slot back
        assert swap["bounce"]["written_nbytes"] > 0 and swap["bounce"]["read_nbytes"] > 0
        read_back_and_compare(client, shards)


def test_chunks_larger_than_a_slot_are_read_in_place_after_a_recover(swap_root: Path) -> None:
    big = swap_root / "big-chunks.toml"
    big.write_text(f"chunk_size = {8 * MIB}\n")
    first = PrivateDaemon.start(swap_root / "run1", arena_size=ARENA_NBYTES,
                                swap_dirs=[str(swap_root / "nvme0")],
                                extra_args=["--arena-hugepages", "off", "--config", str(big)])
    try:
        with OffloadClient.connect(first.socket_path, job=JOB, arena_nbytes=ARENA_NBYTES,
                                   timeout_s=60) as client:
            require_o_direct(client)
            shards = put_random_shards(client, 8, seed=3)
            client.flush("big chunks")
    finally:
        first.process.send_signal(signal.SIGKILL)  # the job stays live for --recover
        first.process.wait(30)
        first.stop()
    with running(swap_root, ["--arena-hugepages", "off", "--recover"]) as client:
        read_back_and_compare(client, shards)  # 8 MiB chunks, 4 MiB slots
        bounce = swap_stats(client)["bounce"]
        assert bounce["slot_nbytes"] == 4 * MIB
        assert bounce["in_place"] > 0 and bounce["in_use"] == 0
        # the recovered job outgrows its arena: its slots were backed at the restart
        assert bounce["prefaulted_slots"] == bounce["slots"]
        read_back_and_compare(client, shards)  # evicted (clean) and read in place again


def test_a_cancelled_staged_write_keeps_its_slot_until_the_kernel_is_done(
        swap_root: Path) -> None:
    """Hazard: a slot given back while the kernel still writes from it would be refilled
    by the next transfer, and the first write would put that one's bytes on disk."""
    config = DaemonConfig(swap_dirs=[str(swap_root / "nvme0")], io_engine="python",
                          mlock=False, arena_hugepages="off")

    async def body() -> None:
        space = SwapSpace(config, DaemonMetrics())
        await space.open()
        if not space.dirs[0].direct:
            await space.close()
            pytest.skip("the swap dir's file system refuses O_DIRECT: no staging to test")
        if space.bounce_prefault is not None:
            await space.bounce_prefault  # its slots in use are not the write's
        engine = space.engine
        gate = asyncio.Event()
        real_submit = engine.submit

        def held_submit(*args: Any) -> asyncio.Future[None]:
            inner = real_submit(*args)
            outer = asyncio.get_running_loop().create_future()

            async def release() -> None:
                await gate.wait()
                try:
                    await inner
                except BaseException as exc:  # pragma: no cover - the write must succeed
                    outer.set_exception(exc)
                else:
                    outer.set_result(None)

            outer.holder = asyncio.ensure_future(release())  # type: ignore[attr-defined]
            return outer

        engine.submit = held_submit
        try:
            jobfile = space.job_files("cancel")[0]
            offset = await jobfile.alloc(MIB)
            data = os.urandom(MIB)
            source = memoryview(bytearray(data))
            write = asyncio.ensure_future(space.io("write", jobfile, offset, source,
                                                  Priority.WRITEBACK))
            while space.bounce is None or space.bounce.in_use == 0:
                await asyncio.sleep(0.001)
            write.cancel()
            with pytest.raises(asyncio.CancelledError):
                await write
            assert space.bounce.in_use == 1  # the engine still has the slot
            gate.set()
            while space.bounce.in_use:
                await asyncio.sleep(0.001)
            with open(jobfile.path, "rb") as file:
                file.seek(offset)
                assert file.read(MIB) == data
            jobfile.close()
        finally:
            engine.submit = real_submit
            await space.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def _anonymous_nbytes(pid: int) -> int:
    """Private anonymous memory the process has backed (smaps_rollup's Anonymous)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no Anonymous line in /proc/{pid}/smaps_rollup")


def _backed_slots(root: Path, prefault: str, shards: int) -> tuple[dict[str, Any], int]:
    """A daemon's bounce stats once a job has registered ``shards`` 4 MiB shards (four
    fill its arena) and any backing is over, and the daemon's anonymous memory."""
    daemon = PrivateDaemon.start(root / "run", arena_size=ARENA_NBYTES,
                                 swap_dirs=[str(root / "nvme0")],
                                 extra_args=["--arena-hugepages", "off",
                                             "--arena-prefault", prefault])
    with stopped_cleanly(daemon), OffloadClient.connect(
            daemon.socket_path, job=JOB, arena_nbytes=ARENA_NBYTES, timeout_s=60) as client:
        require_o_direct(client)
        client.alloc([f"s{i}" for i in range(shards)], [4 * MIB] * shards)
        bounce = wait_bounce_backed(daemon.socket_path)
        return bounce, _anonymous_nbytes(daemon.process.pid)


def test_the_slots_are_backed_once_a_job_outgrows_its_arena(swap_root: Path) -> None:
    """A fresh daemon's first swap-outs used to fault the slots' huge pages in, one copy
    at a time (up to a second on a VM). Now they are backed as soon as a job registers
    more than its arena holds (its swap IO is then certain), not for a job that fits,
    and left to their first use where arenas are too (``--arena-prefault lazy``)."""
    backed, backed_anon = _backed_slots(swap_root / "a", "background", 5)
    fits, fits_anon = _backed_slots(swap_root / "b", "background", 4)
    lazy, _ = _backed_slots(swap_root / "c", "lazy", 5)
    assert backed["prefaulted_slots"] == backed["slots"] and backed["in_use"] == 0
    assert fits["prefaulted_slots"] == 0 and lazy["prefaulted_slots"] == 0
    # the slots' memory is the daemon's, really backed: ~128 MiB more than the other's
    assert backed_anon - fits_anon >= 0.9 * backed["slots"] * backed["slot_nbytes"]


def test_backing_the_slots_skips_one_in_use_and_gives_every_slot_back() -> None:
    from offloadd.swap.bounce import BouncePool

    async def body() -> None:
        pool = BouncePool(4, MIB)
        held = pool.take(MIB)
        assert held is not None
        held[:] = b"\xab" * len(held)  # an IO's bytes in its slot
        await pool.prefault(None)
        assert pool.prefaulted == 3 and pool.in_use == 1
        assert bytes(held) == b"\xab" * len(held)  # untouched by the backing
        pool.give(held)
        slots = [pool.take(MIB) for _ in range(4)]
        assert all(slot is not None for slot in slots) and pool.in_use == 4
        for slot in slots:
            assert slot is not None
            pool.give(slot)
        pool.close()

    asyncio.run(asyncio.wait_for(body(), 60))
