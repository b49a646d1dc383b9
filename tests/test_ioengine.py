"""IO engines on real files: round trips, faults, short IO, O_DIRECT rules.

Every test runs for every engine kind available here and under both the
default asyncio loop and uvloop, each with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import random
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from offloadd.swap import ioengine
from offloadd.swap.ioengine import IOEngine, IOEngineError, open_engine

uvloop: Any
try:
    import uvloop
except ImportError:
    uvloop = None

ALIGN = ioengine.DIRECT_IO_ALIGNMENT
TIMEOUT_S = 30.0
FILE_BYTES = 4 << 20

LOOPS = [
    "asyncio",
    pytest.param(
        "uvloop", marks=pytest.mark.skipif(uvloop is None, reason="uvloop is not installed")
    ),
]


def run(loop_kind: str, coro: Awaitable[None]) -> None:
    """Run coro on a fresh loop of the given kind, failing after TIMEOUT_S."""
    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture(params=ioengine.available_engine_kinds())
def engine_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=LOOPS)
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def direct_io_supported(directory: Path) -> bool:
    """Whether this file system accepts O_DIRECT (tmpfs, for one, does not)."""
    probe = directory / "odirect-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, ALIGN) as page:
            os.pwrite(fd, page, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture(params=["direct", "buffered"])
def data_file(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[int, bool]]:
    """(fd, is_direct) of a FILE_BYTES file in tmp_path."""
    direct = request.param == "direct"
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT (tmpfs?); buffered variant covers it")
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp_path / "data.bin", flags, 0o600)
    os.ftruncate(fd, FILE_BYTES)
    yield fd, direct
    os.close(fd)


def with_engine(
    kind: str, body: Callable[[IOEngine], Awaitable[None]], **options: int
) -> Awaitable[None]:
    async def main() -> None:
        engine = open_engine(kind, **options)  # type: ignore[arg-type]
        try:
            await body(engine)
        finally:
            await engine.aclose()

    return main()


def random_extents(rng: random.Random, count: int, aligned: bool) -> list[tuple[int, int]]:
    """Non-overlapping (offset, nbytes) extents inside FILE_BYTES, shuffled."""
    slot = FILE_BYTES // count // ALIGN * ALIGN
    extents = []
    for index in range(count):
        if aligned:
            nbytes = rng.randrange(1, slot // ALIGN + 1) * ALIGN
            offset = index * slot + rng.randrange(0, (slot - nbytes) // ALIGN + 1) * ALIGN
        else:
            nbytes = rng.randrange(1, slot)
            offset = index * slot + rng.randrange(0, slot - nbytes + 1)
        extents.append((offset, nbytes))
    rng.shuffle(extents)
    return extents


def test_random_round_trip_many_in_flight(
    engine_kind: str, loop_kind: str, data_file: tuple[int, bool]
) -> None:
    fd, direct = data_file
    rng = random.Random(1234)
    extents = random_extents(rng, 48, aligned=direct)
    source = mmap.mmap(-1, FILE_BYTES)  # page-aligned, so aligned slices suit O_DIRECT
    source.write(rng.randbytes(FILE_BYTES))
    target = mmap.mmap(-1, FILE_BYTES)
    view_in, view_out = memoryview(source), memoryview(target)

    async def body(engine: IOEngine) -> None:
        # queue_depth=4 with 48 requests also exercises the submission backlog.
        writes = [engine.submit("write", fd, o, view_in[o : o + n]) for o, n in extents]
        await asyncio.gather(*writes)
        reads = [engine.submit("read", fd, o, view_out[o : o + n]) for o, n in extents]
        assert engine.stats()["in_flight"] == len(extents)
        await asyncio.gather(*reads)
        stats = engine.stats()
        total = sum(n for _, n in extents)
        assert stats["completed"] == 2 * len(extents) and stats["failed"] == 0
        assert stats["bytes_written"] == total and stats["bytes_read"] == total

    run(loop_kind, with_engine(engine_kind, body, queue_depth=4, num_threads=3))
    for offset, nbytes in extents:
        assert view_out[offset : offset + nbytes] == view_in[offset : offset + nbytes]
    view_in.release()
    view_out.release()
    source.close()  # raises BufferError if an engine still held a view
    target.close()


def test_injected_fault_fails_exactly_that_request(
    engine_kind: str, loop_kind: str, data_file: tuple[int, bool]
) -> None:
    fd, _ = data_file
    pattern = mmap.mmap(-1, 16 * ALIGN)
    pattern.write(random.Random(5).randbytes(16 * ALIGN))

    async def body(engine: IOEngine) -> None:
        engine.inject_fault(nth=5)
        futures = [
            engine.submit("write", fd, i * ALIGN, memoryview(pattern)[i * ALIGN : (i + 1) * ALIGN])
            for i in range(16)
        ]
        results = await asyncio.gather(*futures, return_exceptions=True)
        failed = [i for i, result in enumerate(results) if result is not None]
        assert failed == [4]
        error = results[4]
        assert isinstance(error, IOEngineError)
        assert (error.errno, error.op, error.offset) == (errno.EIO, "write", 4 * ALIGN)
        assert error.nbytes == ALIGN
        assert error.path is not None and error.path.endswith("data.bin")
        stats = engine.stats()
        assert (stats["completed"], stats["failed"], stats["in_flight"]) == (15, 1, 0)

        # An op-filtered fault skips requests of the other op.
        engine.inject_fault(nth=2, errno=errno.ENOSPC, op="read")
        sink = mmap.mmap(-1, ALIGN)
        await engine.write(fd, 0, memoryview(pattern)[:ALIGN])
        await engine.read(fd, 0, sink)
        with pytest.raises(IOEngineError) as caught:
            await engine.read(fd, ALIGN, sink)
        assert caught.value.errno == errno.ENOSPC and caught.value.op == "read"
        await engine.read(fd, 0, sink)  # the fault was one-shot
        sink.close()

    run(loop_kind, with_engine(engine_kind, body))
    pattern.close()


def test_short_read_at_end_of_file_is_an_error(
    engine_kind: str, loop_kind: str, data_file: tuple[int, bool]
) -> None:
    fd, _ = data_file
    buffer = mmap.mmap(-1, 4 * ALIGN)

    async def body(engine: IOEngine) -> None:
        with pytest.raises(IOEngineError) as caught:
            await engine.read(fd, FILE_BYTES - ALIGN, buffer)
        error = caught.value
        assert (error.op, error.nbytes, error.nbytes_done) == ("read", 4 * ALIGN, ALIGN)
        assert "short read" in str(error)
        with pytest.raises(IOEngineError) as caught:
            await engine.read(fd, FILE_BYTES + ALIGN, buffer)
        assert caught.value.nbytes_done == 0
        assert engine.stats()["failed"] == 2

    run(loop_kind, with_engine(engine_kind, body))
    buffer.close()


def test_kernel_errno_is_reported(engine_kind: str, loop_kind: str, tmp_path: Path) -> None:
    write_only = os.open(tmp_path / "wo.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    buffer = bytearray(ALIGN)

    async def body(engine: IOEngine) -> None:
        with pytest.raises(IOEngineError) as caught:
            await engine.read(write_only, 0, buffer)
        assert caught.value.errno == errno.EBADF and caught.value.nbytes_done is None

    try:
        run(loop_kind, with_engine(engine_kind, body))
    finally:
        os.close(write_only)


def test_misaligned_requests_on_direct_fd_are_rejected(engine_kind: str, tmp_path: Path) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT (tmpfs?)")
    fd = os.open(tmp_path / "direct.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    buffer = mmap.mmap(-1, 4 * ALIGN)
    view = memoryview(buffer)

    async def body(engine: IOEngine) -> None:
        for offset, buf in [(0, view[512 : 512 + ALIGN]), (512, view[:ALIGN]), (0, view[:1000])]:
            with pytest.raises(ValueError, match="O_DIRECT"):
                engine.submit("write", fd, offset, buf)
        assert engine.stats()["submitted"] == 0
        await engine.write(fd, 0, view[:ALIGN])  # aligned is fine

    try:
        run("asyncio", with_engine(engine_kind, body))
    finally:
        view.release()
        buffer.close()
        os.close(fd)


def test_bad_requests_are_rejected_up_front(engine_kind: str, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "plain.bin", os.O_RDWR | os.O_CREAT, 0o600)

    async def body(engine: IOEngine) -> None:
        with pytest.raises(ValueError, match="writable"):
            engine.submit("read", fd, 0, b"read-only bytes")
        with pytest.raises(ValueError, match="offset"):
            engine.submit("write", fd, -1, b"x")
        with pytest.raises(ValueError, match="op must be"):
            engine.submit("append", fd, 0, b"x")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="nth"):
            engine.inject_fault(nth=0)
        await engine.write(fd, 0, b"read-only buffers are fine to write")

    try:
        run("asyncio", with_engine(engine_kind, body))
    finally:
        os.close(fd)


def test_aclose_waits_for_in_flight_then_refuses(
    engine_kind: str, loop_kind: str, data_file: tuple[int, bool]
) -> None:
    fd, _ = data_file
    buffer = mmap.mmap(-1, 1 << 20)

    async def main() -> None:
        engine = open_engine(engine_kind)  # type: ignore[arg-type]
        futures = [engine.submit("read", fd, i << 20, buffer) for i in range(4)]
        await engine.aclose()
        assert all(f.done() and f.exception() is None for f in futures)
        assert engine.stats()["in_flight"] == 0
        with pytest.raises(RuntimeError, match="closed"):
            engine.submit("read", fd, 0, buffer)

    run(loop_kind, main())
    buffer.close()  # would raise BufferError if a view were still held


def test_open_engine_choices() -> None:
    kinds = ioengine.available_engine_kinds()
    assert kinds[-1] == "python"

    async def main() -> None:
        best = open_engine("auto")
        expected = {"io_uring": "native-io_uring", "threads": "native-threads"}
        assert best.name == expected.get(kinds[0], "python-threads")
        await best.aclose()

    run("asyncio", main())
    with pytest.raises(ValueError, match="kind must be"):
        open_engine("spdk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="queue_depth"):
        open_engine("auto", queue_depth=0)
    with pytest.raises(ValueError, match="num_threads"):
        open_engine("python", num_threads=0)


def test_python_fallback_when_native_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ioengine, "_native", None)
    ioengine._io_uring_refusal.cache_clear()
    try:
        assert ioengine.available_engine_kinds() == ["python"]
        engine = open_engine("auto")
        assert isinstance(engine, ioengine.ThreadPoolEngine)
        run("asyncio", engine.aclose())
        with pytest.raises(RuntimeError, match="not built"):
            open_engine("native")
    finally:
        ioengine._io_uring_refusal.cache_clear()


def test_is_direct_aligned() -> None:
    with mmap.mmap(-1, 3 * ALIGN) as buffer, contextlib.ExitStack() as stack:
        view = stack.enter_context(memoryview(buffer))
        assert ioengine.is_direct_aligned(view[ALIGN : 2 * ALIGN], ALIGN, ALIGN)
        assert not ioengine.is_direct_aligned(view[1 : ALIGN + 1], 0, ALIGN)
        assert not ioengine.is_direct_aligned(view[:ALIGN], 100, ALIGN)
        assert not ioengine.is_direct_aligned(view[:ALIGN], 0, 100)
