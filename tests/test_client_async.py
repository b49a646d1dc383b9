"""The asyncio client against the real daemon, under the default loop and under uvloop."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import pytest
import torch
from conftest import JOB_ARENA_NBYTES

from offloadd.errors import (
    DaemonUnavailableError,
    LeaseConflictError,
    NoSwapError,
    UnknownShardError,
)
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import AsyncOffloadClient, ReleasedLeaseError


async def open_client(daemon: PrivateDaemon, job: str, rank: int = 0) -> AsyncOffloadClient:
    return await AsyncOffloadClient.connect(daemon.socket_path, job=job, rank=rank,
                                            world_size=2, arena_nbytes=JOB_ARENA_NBYTES,
                                            timeout_s=10)


def test_async_client_data_path_and_list_forms(daemon: PrivateDaemon, job: str,
                                               run_async: Callable) -> None:
    async def scenario() -> None:
        async with await open_client(daemon, job) as client:
            await client.put("a", torch.arange(256, dtype=torch.int32))
            assert await client.get("a") == torch.arange(256, dtype=torch.int32).numpy().tobytes()
            await client.alloc(["b", "c"], [8, 16], "uint8")
            async with await client.acquire_many(["b", "c"], "w") as group:
                for lease in group:
                    lease.view[:] = b"\x07" * lease.nbytes
            async with await client.acquire("a") as lease:
                assert lease.tensor()[255].item() == 255
            await client.prefetch(["a", "b"])
            await client.step_begin()
            with pytest.raises(NoSwapError):
                await client.flush()
            with pytest.raises(UnknownShardError):
                await client.acquire("ghost")
            # Many requests in flight on one connection, matched back by request id.
            values = await asyncio.gather(*(client.get(i) for i in ["a", "b", "c"] * 20))
            assert values[1::3] == [b"\x07" * 8] * 20 and values[2::3] == [b"\x07" * 16] * 20
            await client.drop(["a", "b", "c"])
            assert (await client.stats())["num_shards"] == 0

    run_async(scenario())


def test_async_leases_exclusive_writer_and_use_after_release(daemon: PrivateDaemon, job: str,
                                                             run_async: Callable) -> None:
    async def scenario() -> None:
        first, second = await open_client(daemon, job), await open_client(daemon, job)
        await first.put("s", b"abc")
        async with await first.acquire("s", "w") as lease:
            with pytest.raises(LeaseConflictError):
                await second.acquire("s", "r")
        with pytest.raises(ReleasedLeaseError):
            lease.view  # noqa: B018
        async with await first.acquire("s") as lease:
            lease.release()  # released inside the block: the exit gives back nothing more
        with pytest.raises(RuntimeError, match="boom"):
            async with await second.acquire("s", "w"):
                raise RuntimeError("boom")
        assert (await first.stats())["leased_nbytes"] == 0
        await first.close()
        with pytest.raises(DaemonUnavailableError):
            await first.stats()
        await second.close()

    run_async(scenario())


def test_cancelled_acquire_in_flight_does_not_leak_its_leases(daemon: PrivateDaemon, job: str,
                                                              run_async: Callable) -> None:
    """The daemon is frozen (SIGSTOP) so the acquire is certainly on the wire, unanswered,
    when it is cancelled; once the daemon runs again it grants the leases, and the client
    must give them back by itself."""

    async def scenario() -> None:
        client = await open_client(daemon, job)
        ids = [f"s{i}" for i in range(100)]
        await client.alloc(ids, 4096)
        await client.put("p", b"x")
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            acquire = asyncio.ensure_future(client.acquire_many(ids, "w"))
            put = asyncio.ensure_future(client.put("q", b"y" * 5000))
            await asyncio.sleep(0.05)  # both requests are written to the socket
            acquire.cancel()
            put.cancel()
            for task in (acquire, put):
                with pytest.raises(asyncio.CancelledError):
                    await task
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        await client.stats()  # the orphan releases went out before this request
        stats = await client.stats()
        assert stats["leased_nbytes"] == 0
        async with await client.acquire_many([*ids, "q"], "w"):  # all writable again
            pass
        await client.close()

    run_async(scenario())


def test_cancellation_inside_the_lease_block_still_releases(daemon: PrivateDaemon, job: str,
                                                            run_async: Callable) -> None:
    async def scenario() -> None:
        client = await open_client(daemon, job)
        await client.put("s", b"z")
        entered = asyncio.Event()

        async def holder() -> None:
            async with await client.acquire("s", "w"):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.ensure_future(holder())
        await entered.wait()
        assert (await client.stats())["leased_nbytes"] == 4096
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await client.stats())["leased_nbytes"] == 0
        await client.close()

    run_async(scenario())


def test_async_client_sees_a_daemon_that_goes_away(tmp_path, run_async: Callable) -> None:
    from conftest import start_daemon

    private = start_daemon(tmp_path / "d", arena_size="16MiB")

    async def scenario() -> None:
        client = await open_client(private, "gone")
        await client.put("s", b"1")
        pending = asyncio.ensure_future(asyncio.sleep(0))
        await pending
        private.process.terminate()
        await asyncio.get_running_loop().run_in_executor(None, private.process.wait)
        with pytest.raises(DaemonUnavailableError):
            await client.stats()
        await client.close()

    try:
        run_async(scenario())
    finally:
        assert private.stop() == 0
