"""Asynchronous file IO for the NVMe tier, usable from the daemon's event loop.

Every engine takes (op, fd, offset, buffer) requests, keeps many in flight,
and resolves one asyncio future per request on the loop thread.  The loop
itself never blocks on IO:

- ``NativeEngine(kind="io_uring")``: io_uring through raw syscalls; the ring
  signals an eventfd that the loop watches with ``add_reader``.
- ``NativeEngine(kind="threads")``: a native pthread pool doing pread/pwrite,
  same eventfd delivery; for kernels or sandboxes without io_uring.
- ``ThreadPoolEngine``: os.preadv/os.pwritev in Python threads; works without
  the compiled module.

Every completion is checked: an errno becomes IOEngineError, and a transfer
that ends early (end of file, no space) is an error carrying the byte count
done, never a silent partial success.

Usage: create and use an engine from coroutines running on one event loop
(it binds to the first loop that submits), and ``await engine.aclose()``.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import fcntl
import functools
import heapq
import itertools
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from offloadd.memory.arena import buffer_address

try:
    import offloadd._native as _native
except ImportError:  # the package must work without its compiled part
    _native = None

__all__ = [
    "EngineKind",
    "IOEngine",
    "IOEngineError",
    "NativeEngine",
    "ThreadPoolEngine",
    "available_engine_kinds",
    "is_direct_aligned",
    "open_engine",
]

logger = logging.getLogger(__name__)

OpName = Literal["read", "write"]
FaultOp = Literal["read", "write", "any"]
EngineKind = Literal["auto", "native", "io_uring", "threads", "python"]

DIRECT_IO_ALIGNMENT = 4096  # bytes; the logical block size of 4Kn drives, so safe on all
MAX_QUEUE_DEPTH = 4096
TRANSIENT_ERRNOS = (errno.EAGAIN, errno.EINTR)
"""Results that mean "try again", never an IO error (an injected one is retried once)."""
MAX_TRANSIENT_RETRIES = 64


class IOEngineError(OSError):
    """A failed or short read/write, with where it happened.

    ``nbytes_done`` is set for short transfers (end of file on a read, no
    progress on a write) and for errors after partial progress; it is None
    for requests that failed before moving any data.
    """

    def __init__(
        self,
        error: int,
        message: str,
        *,
        op: OpName,
        fd: int,
        offset: int,
        nbytes: int,
        nbytes_done: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(error, message)
        self.op = op
        self.fd = fd
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.nbytes_done = nbytes_done

    def __str__(self) -> str:
        where = self.path if self.path is not None else f"fd {self.fd}"
        done = "" if self.nbytes_done is None else f", {self.nbytes_done} done"
        return (
            f"[Errno {self.errno}] {self.strerror}: {self.op} of {self.nbytes} bytes "
            f"at offset {self.offset} of {where}{done}"
        )


@dataclass(slots=True)
class _Request:
    op: OpName
    fd: int
    offset: int
    view: memoryview  # Hazard: keeps the caller's buffer alive until the kernel is done with it
    address: int
    future: asyncio.Future[None]
    fault_errno: int  # nonzero: injected failure, the file is not touched
    priority: int = 0  # lower runs first where requests queue (the thread engine)
    started: bool = False


@dataclass(slots=True)
class _Fault:
    countdown: int  # matching requests still to pass before this one fails
    error: int
    op: FaultOp


@dataclass(slots=True)
class _Counters:
    """Plain fields, bumped on the loop thread; exported by stats()."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


def _byte_view(buf: Any, *, writable: bool) -> memoryview:
    try:
        view = memoryview(buf).cast("B")
    except TypeError as exc:
        raise ValueError(f"buf must be a C-contiguous buffer: {exc}") from None
    if writable and view.readonly:
        view.release()
        raise ValueError("buf must be writable for a read (got a read-only buffer)")
    return view


def is_direct_aligned(
    buf: Any, offset: int, nbytes: int, alignment: int = DIRECT_IO_ALIGNMENT
) -> bool:
    """Whether buf's address, offset and nbytes all meet O_DIRECT's alignment."""
    with memoryview(buf).cast("B") as view:
        address = buffer_address(view)
    return address % alignment == 0 and offset % alignment == 0 and nbytes % alignment == 0


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class IOEngine(abc.ABC):
    """Common request bookkeeping: validation, faults, stats, completion.

    Subclasses implement `_start` (hand a request to the backend) and call
    `_finish` on the loop thread when it completes.
    """

    name: str

    def __init__(self) -> None:
        self._counters = _Counters()
        self._faults: list[_Fault] = []
        self._direct_fds: dict[int, bool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._drained: asyncio.Future[None] | None = None

    async def read(self, fd: int, offset: int, buf: Any, priority: int = 0) -> None:
        """Fill all of buf from fd at offset; a short read raises IOEngineError."""
        await self.submit("read", fd, offset, buf, priority)

    async def write(self, fd: int, offset: int, buf: Any, priority: int = 0) -> None:
        """Write all of buf to fd at offset; a short write raises IOEngineError."""
        await self.submit("write", fd, offset, buf, priority)

    def raise_priority(self, future: asyncio.Future[None], priority: int) -> None:
        """A request someone more urgent waits on runs as that one would (if still queued).

        The native engines start every request at once (io_uring) or in order
        (native threads): they have no queue to reorder, so this does nothing there.
        """
        return None

    def submit(self, op: OpName, fd: int, offset: int, buf: Any,
               priority: int = 0) -> asyncio.Future[None]:
        """Start one request and return its future; call from the loop's thread.

        Hazard: cancelling the future does not cancel the IO; the engine
        keeps the buffer referenced until the kernel has finished with it.
        """
        loop = asyncio.get_running_loop()
        if self._closing:
            raise RuntimeError(f"{self.name} engine is closed")
        self._bind_loop(loop)
        request = self._make_request(loop, op, fd, offset, buf)
        request.priority = priority
        try:
            self._start(request)
        except BaseException:
            request.view.release()
            raise
        self._counters.submitted += 1
        self._counters.in_flight += 1
        return request.future

    def inject_fault(self, *, nth: int, errno: int = errno.EIO, op: FaultOp = "any") -> None:
        """Test hook: the nth matching request from now fails with errno, file untouched."""
        if nth < 1:
            raise ValueError(f"nth must be >= 1 (1 = the next request), got {nth}")
        if errno <= 0:
            raise ValueError(f"errno must be a positive errno value, got {errno}")
        if op not in ("read", "write", "any"):
            raise ValueError(f"op must be 'read', 'write' or 'any', got {op!r}")
        self._faults.append(_Fault(nth, errno, op))

    def stats(self) -> dict[str, int]:
        c = self._counters
        return {
            "submitted": c.submitted,
            "completed": c.completed,
            "failed": c.failed,
            "in_flight": c.in_flight,
            "bytes_read": c.bytes_read,
            "bytes_written": c.bytes_written,
        }

    def forget_fd(self, fd: int) -> None:
        """Drop the cached O_DIRECT flag of fd; call before its number is reused."""
        self._direct_fds.pop(fd, None)

    async def aclose(self) -> None:
        """Refuse new requests, wait for those in flight, release the backend."""
        if self._closing:
            return
        self._closing = True
        if self._counters.in_flight:
            assert self._loop is not None
            self._drained = self._loop.create_future()
            await self._drained
        self._close_backend()

    @abc.abstractmethod
    def _start(self, request: _Request) -> None: ...

    @abc.abstractmethod
    def _close_backend(self) -> None: ...

    @abc.abstractmethod
    def _on_bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The first submit binds the engine to its loop: register with it."""

    def _bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None:
            self._loop = loop
            self._on_bind(loop)
        elif self._loop is not loop:
            raise RuntimeError(f"{self.name} engine is bound to another event loop")

    def _make_request(
        self, loop: asyncio.AbstractEventLoop, op: OpName, fd: int, offset: int, buf: Any
    ) -> _Request:
        if op not in ("read", "write"):
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        view = _byte_view(buf, writable=op == "read")
        address = buffer_address(view)
        if self._is_direct(fd):
            self._check_direct_alignment(fd, offset, view.nbytes, address)
        fault = self._take_fault(op)
        return _Request(op, fd, offset, view, address, loop.create_future(), fault)

    def _is_direct(self, fd: int) -> bool:
        direct = self._direct_fds.get(fd)
        if direct is None:
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            self._direct_fds[fd] = direct
        return direct

    @staticmethod
    def _check_direct_alignment(fd: int, offset: int, nbytes: int, address: int) -> None:
        a = DIRECT_IO_ALIGNMENT
        if address % a or offset % a or nbytes % a:
            raise ValueError(
                f"fd {fd} is opened with O_DIRECT: buffer address ({address:#x}), offset "
                f"({offset}) and nbytes ({nbytes}) must all be multiples of {a}"
            )

    def _take_fault(self, op: OpName) -> int:
        if not self._faults:
            return 0
        hit = 0
        for fault in self._faults:
            if fault.op in ("any", op):
                fault.countdown -= 1
                if fault.countdown == 0 and not hit:
                    hit = fault.error
        self._faults = [f for f in self._faults if f.countdown > 0]
        return hit

    def _finish(self, request: _Request, error: int, nbytes_done: int) -> None:
        """Check one completion and resolve its future (loop thread only)."""
        nbytes = request.view.nbytes
        request.view.release()  # the kernel is done; let the caller close/resize its buffer
        exc = self._completion_error(request, nbytes, error, nbytes_done)
        counters = self._counters
        counters.in_flight -= 1
        if exc is not None:
            counters.failed += 1
        else:
            counters.completed += 1
            if request.op == "read":
                counters.bytes_read += nbytes
            else:
                counters.bytes_written += nbytes
        if not request.future.done():  # the caller may have cancelled it
            if exc is not None:
                request.future.set_exception(exc)
            else:
                request.future.set_result(None)
        if counters.in_flight == 0 and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    @staticmethod
    def _completion_error(
        request: _Request, nbytes: int, error: int, nbytes_done: int
    ) -> IOEngineError | None:
        if error == 0 and nbytes_done == nbytes:
            return None
        details: dict[str, Any] = {
            "op": request.op,
            "fd": request.fd,
            "offset": request.offset,
            "nbytes": nbytes,
            "path": _fd_path(request.fd),
        }
        if error:
            done = nbytes_done if nbytes_done else None
            return IOEngineError(error, os.strerror(error), nbytes_done=done, **details)
        what = "end of file" if request.op == "read" else "no progress"
        return IOEngineError(
            errno.EIO, f"short {request.op} ({what})", nbytes_done=nbytes_done, **details
        )


def _blocking_transfer(request: _Request) -> tuple[int, int]:
    """pread/pwrite the whole request in a worker thread; returns (errno, bytes done)."""
    if request.fault_errno and request.fault_errno not in TRANSIENT_ERRNOS:
        return request.fault_errno, 0
    view, done, nbytes = request.view, 0, request.view.nbytes
    retries = 0
    while done < nbytes:
        try:
            if request.op == "read":
                moved = os.preadv(request.fd, [view[done:]], request.offset + done)
            else:
                moved = os.pwritev(request.fd, [view[done:]], request.offset + done)
        except OSError as exc:  # EINTR is already retried by Python (PEP 475)
            if exc.errno in TRANSIENT_ERRNOS and retries < MAX_TRANSIENT_RETRIES:
                retries += 1
                continue
            return exc.errno or errno.EIO, done
        if moved == 0:
            break
        done += moved
    return 0, done


class ThreadPoolEngine(IOEngine):
    """os.preadv/os.pwritev in worker threads; needs no compiled code.

    Requests wait in a priority queue, not a FIFO: where io_uring is blocked (a
    container's seccomp profile) this is the daemon's engine, and a demand read
    must not queue behind a drive's worth of write-back and prefetch.
    """

    name = "python-threads"

    def __init__(self, *, num_threads: int = 4) -> None:
        super().__init__()
        _check_positive("num_threads", num_threads)
        self._queue: list[tuple[int, int, _Request]] = []
        self._queued: dict[asyncio.Future[None], _Request] = {}
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._stopping = False
        self._workers = [threading.Thread(target=self._work, name=f"offloadd-io-{i}", daemon=True)
                         for i in range(num_threads)]
        for worker in self._workers:
            worker.start()

    def _on_bind(self, loop: asyncio.AbstractEventLoop) -> None:
        pass  # workers reach the loop through call_soon_threadsafe; nothing to register

    def _start(self, request: _Request) -> None:
        with self._ready:
            heapq.heappush(self._queue, (request.priority, next(self._order), request))
            self._queued[request.future] = request
            self._ready.notify()

    def raise_priority(self, future: asyncio.Future[None], priority: int) -> None:
        with self._ready:
            request = self._queued.get(future)
            if request is None or request.started or request.priority <= priority:
                return
            request.priority = priority  # the old heap entry is skipped once this one ran
            heapq.heappush(self._queue, (priority, next(self._order), request))
            self._ready.notify()

    def pending_priorities(self) -> list[int]:
        """Priorities of the requests still queued, in the order they will run (for tests)."""
        with self._ready:
            entries = sorted(e for e in self._queue if not e[2].started and e[0] == e[2].priority)
            return [priority for priority, _order, _request in entries]

    def _work(self) -> None:
        while True:
            with self._ready:
                request = self._next_request()
                if request is None:
                    return
            self._run(request)

    def _next_request(self) -> _Request | None:
        """Pop the most urgent queued request; None once closing with nothing left."""
        while True:
            while not self._queue and not self._stopping:
                self._ready.wait()
            if not self._queue:
                return None
            priority, _order, request = heapq.heappop(self._queue)
            if request.started or priority != request.priority:
                continue  # a stale entry of a request whose priority was raised
            request.started = True
            self._queued.pop(request.future, None)
            return request

    def _run(self, request: _Request) -> None:
        error, done = _blocking_transfer(request)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._finish, request, error, done)
        except RuntimeError:
            pass  # the loop was closed under us: nobody is left to notify

    def _close_backend(self) -> None:
        with self._ready:  # drained already: workers are idle and exit
            self._stopping = True
            self._ready.notify_all()


class VolatileCacheEngine(ThreadPoolEngine):
    """Python threads behind a volatile write cache that only ``sync`` makes durable.

    A fault mode for tests (``OFFLOADD_IO_FAULT=power_loss``): a write lands in
    memory and reaches the file at the next ``sync(fd)``; reads see it at once.
    Killing the process then loses every write since the last sync, as a power
    loss loses a drive's volatile cache, so a test can show that no manifest
    ever names such data.
    """

    name = "python-volatile-cache"
    SYNC_LATENCY_S = 0.01
    """A drive's cache flush takes milliseconds; so does this one, before it starts."""

    def __init__(self, *, num_threads: int = 4) -> None:
        super().__init__(num_threads=num_threads)
        self._cache: dict[int, list[tuple[int, bytes]]] = {}
        self._cache_lock = threading.Lock()

    def _run(self, request: _Request) -> None:
        if request.fault_errno:
            error, done = request.fault_errno, 0
        elif request.op == "write":
            with self._cache_lock:
                self._cache.setdefault(request.fd, []).append(
                    (request.offset, bytes(request.view)))
            error, done = 0, request.view.nbytes
        else:
            error, done = _blocking_transfer(request)
            if not error:
                self._overlay(request)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._finish, request, error, done)
        except RuntimeError:
            pass  # the loop was closed under us: nobody is left to notify

    def _overlay(self, request: _Request) -> None:
        """Apply the cached writes that overlap a read, oldest first."""
        start, end = request.offset, request.offset + request.view.nbytes
        with self._cache_lock:
            for offset, data in self._cache.get(request.fd, ()):
                low, high = max(start, offset), min(end, offset + len(data))
                if low < high:
                    request.view[low - start:high - start] = data[low - offset:high - offset]

    async def sync(self, fd: int) -> None:
        """Write the cached writes of ``fd`` to the file, then fdatasync it."""
        await asyncio.get_running_loop().run_in_executor(None, self._drain_cache, fd)

    def _drain_cache(self, fd: int) -> None:
        time.sleep(self.SYNC_LATENCY_S)  # writes completing meanwhile are not in this sync
        with self._cache_lock:
            writes = self._cache.pop(fd, [])
        for offset, data in writes:
            aligned = mmap.mmap(-1, len(data))  # page-aligned: the file may be O_DIRECT
            try:
                aligned[:] = data
                os.pwritev(fd, [aligned], offset)
            finally:
                aligned.close()
        os.fdatasync(fd)


class NativeEngine(IOEngine):
    """io_uring (or a native pthread pool) with eventfd completion delivery."""

    def __init__(
        self,
        kind: Literal["io_uring", "threads"] = "io_uring",
        *,
        queue_depth: int = 64,
        num_threads: int = 4,
    ) -> None:
        super().__init__()
        if _native is None:
            raise RuntimeError("offloadd._native is not built; use ThreadPoolEngine")
        _check_queue_depth(queue_depth)
        _check_positive("num_threads", num_threads)
        self._backend = _native.IoEngine(kind, queue_depth, num_threads)
        self.kind: str = self._backend.kind
        self.name = f"native-{self.kind}"
        self._requests: dict[int, _Request] = {}
        self._next_tag = 0

    def _on_bind(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self._backend.event_fd, self._on_completions)

    def _start(self, request: _Request) -> None:
        tag = self._next_tag
        self._next_tag += 1
        op_code = 0 if request.op == "read" else 1
        self._backend.submit(
            tag,
            op_code,
            request.fd,
            request.offset,
            request.address,
            request.view.nbytes,
            request.fault_errno,
        )
        self._requests[tag] = request

    def _on_completions(self) -> None:
        for tag, error, nbytes_done in self._backend.reap():
            self._finish(self._requests.pop(tag), error, nbytes_done)

    def _close_backend(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._backend.event_fd)
        self._backend.close()


def _check_positive(knob: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{knob} must be an int >= 1, got {value!r}")


def _check_queue_depth(queue_depth: int) -> None:
    if not isinstance(queue_depth, int) or not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise ValueError(
            f"queue_depth must be an int in [1, {MAX_QUEUE_DEPTH}], got {queue_depth!r}"
        )


@functools.cache
def _io_uring_refusal() -> str | None:
    """Why io_uring cannot be used here, or None if it can (probed once)."""
    if _native is None:
        return "offloadd._native is not built"
    if os.environ.get(DISABLE_IO_URING_ENV, "") not in ("", "0"):
        return f"io_uring disabled by {DISABLE_IO_URING_ENV}"
    try:
        backend = _native.IoEngine("io_uring", 1, 1)
    except OSError as exc:
        return f"io_uring unavailable: {exc}"
    try:
        return _probe_transfers(backend)
    finally:
        backend.close()


PROBE_TIMEOUT_S = 5.0
DISABLE_IO_URING_ENV = "OFFLOADD_DISABLE_IO_URING"
"""Set to 1 to act as if io_uring were blocked (a seccomp profile): "auto" takes the
thread fallback. For tests and for kernels whose io_uring is known bad."""


def _probe_transfers(backend: Any) -> str | None:
    """Write then read one page through the ring; None when both round-trip.

    Hazard: a ring can be created where its operations are refused (a seccomp
    profile that filters only IORING_OP_*, an LSM denying file IO from the ring):
    only a real write and read show it, before the daemon trusts the engine.
    """
    import select
    import tempfile

    pattern = os.urandom(DIRECT_IO_ALIGNMENT)
    with tempfile.TemporaryFile() as scratch, \
            mmap.mmap(-1, DIRECT_IO_ALIGNMENT) as buffer:
        buffer[:] = pattern
        view = memoryview(buffer)
        address = buffer_address(view)
        poller = select.poll()  # not select.select: the eventfd may be numbered past 1024
        poller.register(backend.event_fd, select.POLLIN)
        try:
            for op_code, op in ((1, "write"), (0, "read")):
                if op == "read":
                    buffer[:] = bytes(DIRECT_IO_ALIGNMENT)
                backend.submit(op_code, op_code, scratch.fileno(), 0, address,
                               DIRECT_IO_ALIGNMENT, 0)
                completions = backend.reap() if poller.poll(PROBE_TIMEOUT_S * 1000) else []
                if not completions:
                    return f"io_uring probe: the {op} did not complete in {PROBE_TIMEOUT_S}s"
                _tag, error, done = completions[0]
                if error or done != DIRECT_IO_ALIGNMENT:
                    why = os.strerror(error) if error else f"{done} bytes moved"
                    return f"io_uring probe: the {op} failed ({why})"
            if buffer[:] != pattern:
                return "io_uring probe: the read returned other bytes than were written"
        finally:
            view.release()
    return None


def available_engine_kinds() -> list[str]:
    """Concrete engine kinds that open_engine can create here."""
    kinds = []
    if _native is not None:
        if _io_uring_refusal() is None:
            kinds.append("io_uring")
        kinds.append("threads")
    return [*kinds, "python"]


def open_engine(
    kind: EngineKind = "auto", *, queue_depth: int = 64, num_threads: int = 4
) -> IOEngine:
    """Open the best engine for kind.

    Both prefer io_uring (after a probe write and read); without it "native"
    uses the native threads and "auto" the Python threads, whose priority queue
    keeps demand reads ahead; "io_uring", "threads" and "python" insist on that
    engine.  queue_depth bounds io_uring requests in the kernel (more wait in
    a backlog); num_threads sizes the thread-based engines.
    """
    _check_queue_depth(queue_depth)
    _check_positive("num_threads", num_threads)
    if kind == "python":
        engine: IOEngine = ThreadPoolEngine(num_threads=num_threads)
    elif kind in ("io_uring", "threads"):
        engine = NativeEngine(kind, queue_depth=queue_depth, num_threads=num_threads)
    elif kind in ("auto", "native"):
        engine = _open_best(kind, queue_depth, num_threads)
    else:
        raise ValueError(
            f"kind must be one of 'auto', 'native', 'io_uring', 'threads', 'python'; got {kind!r}"
        )
    logger.info("io engine: %s (requested %r)", engine.name, kind)
    return engine


def _open_best(kind: EngineKind, queue_depth: int, num_threads: int) -> IOEngine:
    refusal = _io_uring_refusal()
    if refusal is None:
        return NativeEngine("io_uring", queue_depth=queue_depth, num_threads=num_threads)
    if kind == "native":
        if _native is None:
            raise RuntimeError("open_engine('native'): offloadd._native is not built")
        logger.info("io engine: %s; using native threads", refusal)
        return NativeEngine("threads", queue_depth=queue_depth, num_threads=num_threads)
    # "auto" falls back to the Python threads: their priority queue keeps demand reads
    # ahead of write-back and prefetch (pread/pwrite release the GIL, so they move data
    # as fast as the native pool; the native pool runs requests in arrival order).
    logger.info("io engine: %s; using Python threads (priority queue)", refusal)
    return ThreadPoolEngine(num_threads=num_threads)

