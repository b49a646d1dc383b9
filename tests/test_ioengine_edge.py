"""IO engine edge cases: transient errnos are retried, the io_uring probe moves real bytes,
and the thread engine runs demand reads first (also a write-back someone urgent waits on)."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offloadd.swap import ioengine
from offloadd.swap.ioengine import ThreadPoolEngine, open_engine
from offloadd.swap.scheduler import Priority

PAGE = 4096


def page(fill: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, PAGE)
    buffer[:] = bytes([fill]) * PAGE
    return buffer


@pytest.mark.parametrize("kind", ioengine.available_engine_kinds())
@pytest.mark.parametrize("error", [errno.EAGAIN, errno.EINTR])
def test_a_transient_errno_is_retried_not_reported(tmp_path: Path, kind: str, error: int) -> None:
    async def scenario() -> None:
        engine = open_engine(kind)  # type: ignore[arg-type]
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            engine.inject_fault(nth=1, errno=error, op="write")
            await engine.write(fd, 0, page(7))
            engine.inject_fault(nth=1, errno=error, op="read")
            into = page(0)
            await engine.read(fd, 0, into)
            assert into[:] == bytes([7]) * PAGE
            assert engine.stats()["failed"] == 0
        finally:
            await engine.aclose()
            os.close(fd)

    asyncio.run(scenario())


@pytest.mark.skipif("io_uring" not in ioengine.available_engine_kinds(), reason="no io_uring")
def test_the_io_uring_probe_writes_and_reads_a_real_page() -> None:
    from offloadd import _native

    backend = _native.IoEngine("io_uring", 1, 1)
    try:
        assert ioengine._probe_transfers(backend) is None
    finally:
        backend.close()


class RefusesWrites:
    """A real ring whose writes fail as under an LSM that denies file IO from io_uring."""

    def __init__(self) -> None:
        from offloadd import _native

        self.ring = _native.IoEngine("io_uring", 1, 1)
        self.event_fd = self.ring.event_fd

    def submit(self, tag: int, op: int, fd: int, offset: int, address: int, nbytes: int,
               fault: int) -> None:
        self.ring.submit(tag, op, fd, offset, address, nbytes, errno.EPERM if op == 1 else fault)

    def reap(self) -> list[tuple[int, int, int]]:
        return self.ring.reap()


@pytest.mark.skipif("io_uring" not in ioengine.available_engine_kinds(), reason="no io_uring")
def test_the_probe_refuses_a_ring_that_cannot_write() -> None:
    backend = RefusesWrites()
    try:
        refusal = ioengine._probe_transfers(backend)
    finally:
        backend.ring.close()
    assert refusal is not None and "write failed" in refusal


def test_the_thread_engine_runs_demand_reads_first_and_raises_a_waited_on_write_back(
        tmp_path: Path) -> None:
    async def scenario() -> list[str]:
        engine = ThreadPoolEngine(num_threads=1)
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(fd, bytes(PAGE * 8), 0)
        order: list[str] = []
        futures = {}
        try:
            with engine._ready:  # the worker waits for this lock: everything queues first
                for name, op, priority in (
                        ("wb0", "write", Priority.WRITEBACK), ("wb1", "write", Priority.WRITEBACK),
                        ("pf0", "read", Priority.PREFETCH), ("wb2", "write", Priority.WRITEBACK),
                        ("demand", "read", Priority.DEMAND)):
                    future = engine.submit(op, fd, PAGE * len(futures), page(1), int(priority))
                    future.add_done_callback(lambda _f, n=name: order.append(n))
                    futures[name] = future
                assert engine.pending_priorities() == [0, 1, 2, 2, 2]
                # A demand read waits for wb2 (its shard's write-back): wb2 runs as a demand.
                engine.raise_priority(futures["wb2"], int(Priority.DEMAND))
                assert engine.pending_priorities() == [0, 0, 1, 2, 2]
            await asyncio.gather(*futures.values())
        finally:
            await engine.aclose()
            os.close(fd)
        return order

    assert asyncio.run(scenario()) == ["demand", "wb2", "pf0", "wb0", "wb1"]


def test_auto_without_io_uring_takes_the_priority_thread_engine(tmp_path: Path) -> None:
    script = (
        "import asyncio, os\n"
        "from offloadd.swap.ioengine import open_engine, available_engine_kinds\n"
        "async def main():\n"
        "    engine = open_engine('auto')\n"
        "    print(engine.name, available_engine_kinds())\n"
        "    await engine.aclose()\n"
        "asyncio.run(main())\n")
    env = {**os.environ, "OFFLOADD_DISABLE_IO_URING": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.startswith("python-threads") and "io_uring" not in out
