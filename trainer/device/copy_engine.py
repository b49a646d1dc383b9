"""Copy engines: host <-> compute-device copies that complete asynchronously, with events.

The rank moves parameter partitions from arena leases to the compute device
(H2D) and reduced gradients back into write leases (D2H). Three engines share
one interface:

- ``CudaCopyEngine``: dedicated CUDA streams for each direction, a pool of
  ``torch.cuda.Event``; the compute stream waits on events, never the host.
- ``TwinCopyEngine``: the CPU twin CI runs. Every copy runs later on a worker
  thread after a small random delay and completes its own event, so the
  ordering rules below are exercised without a GPU. A copy whose guard (the
  lease it reads or writes) was released before the copy ran fails its event
  with ``CopyAfterReleaseError``.
- ``InlineCopyEngine``: CPU training without the twin; copies run at once.

Hazard (release after event): an arena lease must not be released, nor a
write lease committed, until the event of the copy that touches its bytes has
completed. Otherwise the daemon may evict the shard, write it back or hand the
bytes to another shard while the DMA is still reading or writing them.
``ReleaseQueue`` holds such releases and runs them at safe points (``poll``).

``OFFLOADD_COPY_ENGINE`` (``cuda`` | ``twin`` | ``inline``) overrides the
choice ``select_copy_engine`` makes from the compute device.
"""

from __future__ import annotations

import abc
import collections
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from trainer.device import host_pages
from trainer.device.twin import check_copy

COPY_ENGINE_ENV = "OFFLOADD_COPY_ENGINE"
TWIN_MAX_DELAY_ENV = "OFFLOADD_TWIN_MAX_DELAY_US"
TWIN_GBPS_ENV = "OFFLOADD_TWIN_GBPS"
"""The timed twin: each copy takes nbytes / this many GB/s on the worker (unset: as fast
as memcpy), so the overlap of copies with compute can be measured on CPU."""
DEFAULT_TWIN_MAX_DELAY_S = 200e-6
"""Upper bound of the twin's random per-copy delay: long enough to reorder copies against
the host, short enough that the parity suite stays fast."""
ENGINE_KINDS = ("cuda", "twin", "inline")


class CopyAfterReleaseError(RuntimeError):
    """A copy touched lease memory after the lease was released (release before event)."""


class CopyEngineUnavailableError(RuntimeError):
    """The requested copy engine cannot run here (no CUDA, CPU-only torch build)."""


class Guard(Protocol):
    """What a copy protects: a lease whose memory must outlive the copy."""

    @property
    def released(self) -> bool: ...


class CopyEvent(Protocol):
    """Completion of one copy."""

    def query(self) -> bool:
        """True when the copy finished (without blocking)."""
        ...

    def synchronize(self) -> None:
        """Block the host until the copy finished; re-raise its failure."""
        ...


class CopyEngine(abc.ABC):
    """Asynchronous host <-> device copies ordered against the compute stream by events."""

    kind: str
    device: torch.device
    h2d_nbytes = 0
    """Bytes the engine's H2D copies moved so far (a plain counter, read by stats)."""
    d2h_nbytes = 0
    """Bytes the engine's D2H copies moved so far."""

    @property
    def zero_copy(self) -> bool:
        """Compute can read host (arena) views directly: no staging copy is needed."""
        return False

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer on the compute device."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    @abc.abstractmethod
    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        """Start copying host ``src`` into device ``dst`` after the compute stream's work."""

    @abc.abstractmethod
    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        """Start copying device ``src`` into host ``dst`` after the compute stream's work."""

    @abc.abstractmethod
    def wait_on_compute(self, event: CopyEvent) -> None:
        """Make later compute-stream work wait for ``event`` (CUDA: no host block)."""

    def recycle(self, event: CopyEvent) -> None:  # noqa: B027 - pools are optional
        """``event`` completed and nobody holds it: it may be reused."""

    @contextmanager
    def ahead_of_compute(self) -> Iterator[None]:
        """Issue work for later use (allocations, H2D copies, the collectives that read
        them) so that it neither waits for the compute queued so far nor makes compute
        wait: on CUDA, on the H2D stream. Compute reads the results only after
        ``wait_on_compute(ready())``, at use. Hazard: memory allocated in here belongs to
        the copy stream; call ``hand_back`` before freeing what compute used."""
        yield

    def ready(self) -> CopyEvent:
        """An event after all the work issued inside ``ahead_of_compute`` so far."""
        return _DONE

    def hand_back(self, tensor: torch.Tensor) -> None:  # noqa: B027 - one stream on CPU
        """``tensor`` (allocated in ``ahead_of_compute``) was read by compute: its memory
        must not go back to the copy stream's pool before that compute has run."""

    def before_collective(self) -> None:  # noqa: B027 - CUDA orders collectives itself
        """A collective is about to read what the current stream wrote (the H2D of its
        input). On CUDA, NCCL runs after the current stream's work; the twin's "NCCL"
        (gloo) runs at issue, so there the host waits for the copies issued so far."""

    def synchronize(self) -> None:  # noqa: B027 - inline copies are done at issue
        """Wait for every copy issued so far."""

    def register_host(self, address: int, nbytes: int) -> bool:
        """Pin ``nbytes`` of host memory at ``address`` for DMA; False when not possible."""
        return False

    def unregister_host(self, address: int) -> None:  # noqa: B027 - nothing registered
        """Undo ``register_host`` (before the memory is unmapped)."""

    def close(self) -> None:  # noqa: B027 - nothing to stop
        """Finish outstanding copies and release threads/streams."""


# ---------------------------------------------------------------------------
# inline


class _DoneEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _DoneEvent()


class InlineCopyEngine(CopyEngine):
    """CPU compute without the twin: a copy is a synchronous ``copy_``."""

    kind = "inline"

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    @property
    def zero_copy(self) -> bool:
        return True

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        dst.copy_(src)
        self.h2d_nbytes += src.nbytes
        return _DONE

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        dst.copy_(src)
        self.d2h_nbytes += src.nbytes
        return _DONE

    def wait_on_compute(self, event: CopyEvent) -> None:
        event.synchronize()


# ---------------------------------------------------------------------------
# twin


class TwinTiming:
    """Copy time on the worker vs host time blocked on copy events (the timed twin)."""

    __slots__ = ("copy_s", "exposed_s")

    def __init__(self) -> None:
        self.copy_s = 0.0
        """Seconds the worker spent copying (sum over copies)."""
        self.exposed_s = 0.0
        """Seconds the host (the twin's compute) blocked waiting on a copy event."""

    def reset(self) -> None:
        self.copy_s = self.exposed_s = 0.0

    @property
    def overlap_fraction(self) -> float:
        """Copy time hidden behind host work / copy time (1.0 when nothing was copied)."""
        if self.copy_s <= 0.0:
            return 1.0
        return max(0.0, 1.0 - self.exposed_s / self.copy_s)


class TwinEvent:
    """A twin copy's completion: set by the worker thread, with its failure if any."""

    __slots__ = ("_done", "error", "timing")

    def __init__(self, timing: TwinTiming | None = None) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.timing = timing

    def reset(self) -> None:
        self._done.clear()
        self.error = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.is_set():
            started = time.perf_counter()
            self._done.wait()
            if self.timing is not None:
                self.timing.exposed_s += time.perf_counter() - started
        if self.error is not None:
            raise self.error

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()


class TwinCopyEngine(CopyEngine):
    """The CPU twin of ``CudaCopyEngine``: copies run later, on a worker thread, in order.

    One worker plays the copy stream (copies complete in issue order, as on a
    CUDA stream); the host thread plays the compute stream. As on CUDA, work
    issued inside ``ahead_of_compute`` goes to the copy stream: there
    ``wait_on_compute`` orders nothing on the host (the worker runs in issue
    order already), ``run_on_stream`` queues device work behind the copies,
    and ``ready()`` is a marker the host waits for at use. Outside it, the
    host waits at once, as a compute stream waits on an event. ``hold()``
    pauses the worker so tests can place releases deterministically between
    a copy's issue and its completion.
    """

    kind = "twin"

    def __init__(self, *, max_delay_s: float | None = None, seed: int = 0,
                 memlock_nbytes: int | None = None,
                 device: torch.device | None = None, gbps: float | None = None,
                 populate_on_register: bool = True) -> None:
        self.device = device or torch.device("cpu")
        """cpu, or the strict twin's ``twin:0`` (trainer.device.twin): then h2d/d2h check
        that one side is device memory and the other host memory."""
        self.memlock_nbytes = memlock_nbytes
        """Like RLIMIT_MEMLOCK for cudaHostRegister: registrations past it fail (None: no
        limit)."""
        self.populate_on_register = populate_on_register
        """``register_host`` faults the range in, as cudaHostRegister does (False: only for
        a test that must keep a registered arena unbacked)."""
        if max_delay_s is None:
            max_delay_s = float(os.environ.get(TWIN_MAX_DELAY_ENV,
                                               DEFAULT_TWIN_MAX_DELAY_S * 1e6)) * 1e-6
        if max_delay_s < 0:
            raise ValueError(f"{TWIN_MAX_DELAY_ENV} must be >= 0, got {max_delay_s * 1e6} us")
        self.max_delay_s = max_delay_s
        if gbps is None and os.environ.get(TWIN_GBPS_ENV):
            gbps = float(os.environ[TWIN_GBPS_ENV])
        if gbps is not None and not gbps > 0:
            raise ValueError(f"{TWIN_GBPS_ENV} must be > 0 GB/s, got {gbps}")
        self.bytes_per_s = gbps * 1e9 if gbps is not None else None
        """The timed twin's copy bandwidth (None: untimed)."""
        self.timing = TwinTiming()
        self._random = random.Random(seed)
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._running = threading.Event()
        self._running.set()
        self._pool: list[TwinEvent] = []
        self._last: TwinEvent | None = None
        self.copies = 0
        """Copies issued (stats)."""
        self.late_releases_caught = 0
        """Copies that found their guard released (each failed its event)."""
        self.registered: dict[int, int] = {}
        """Pinned host regions (address -> nbytes), tracked like cudaHostRegister would."""
        self._stream = threading.local()
        """``depth``: how many ``ahead_of_compute`` blocks this thread is in (like CUDA's
        current stream, per thread)."""
        self._worker = threading.Thread(target=self._run, name="offloadd-twin-copy",
                                        daemon=True)
        self._worker.start()

    @property
    def on_copy_stream(self) -> bool:
        """The calling thread issues to the copy stream (inside ``ahead_of_compute``)."""
        return getattr(self._stream, "depth", 0) > 0

    def _take_event(self) -> TwinEvent:
        event = self._pool.pop() if self._pool else TwinEvent(self.timing)
        event.reset()
        self._last = event
        return event

    def recycle(self, event: CopyEvent) -> None:
        # The last event too: taking it again makes it ``_last`` anew, so ``synchronize``
        # still waits on the newest copy (pooling depended on id reuse before).
        if (isinstance(event, TwinEvent) and event.query()
                and not any(pooled is event for pooled in self._pool)):
            self._pool.append(event)

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, guard: Guard | None) -> TwinEvent:
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} elements into {dst.numel()}")
        event = self._take_event()
        self.copies += 1
        delay_s = self._random.uniform(0.0, self.max_delay_s)
        self._jobs.put((dst, src, guard, event, delay_s))
        return event

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        check_copy(self.device, dst, src, direction="h2d")
        self.h2d_nbytes += src.nbytes
        return self._issue(dst, src, guard)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        check_copy(self.device, dst, src, direction="d2h")
        self.d2h_nbytes += src.nbytes
        return self._issue(dst, src, guard)

    def wait_on_compute(self, event: CopyEvent) -> None:
        if self.on_copy_stream:
            # The current stream is the copy stream, whose worker runs jobs in issue
            # order: later work on it runs after this event anyway. A failure surfaces at
            # the next ``ready()`` marker and at the event's own release.
            return
        event.synchronize()  # the compute stream is the host thread itself

    @contextmanager
    def ahead_of_compute(self) -> Iterator[None]:
        self._stream.depth = getattr(self._stream, "depth", 0) + 1
        try:
            yield
        finally:
            self._stream.depth -= 1

    def ready(self) -> CopyEvent:
        """A marker behind every job issued so far; it fails with the first failure of a
        job since the previous marker (CUDA errors are sticky: bytes of a failed copy are
        never used silently)."""
        event = self._take_event()
        self._jobs.put((None, None, None, event, 0.0))
        return event

    def run_on_stream(self, work: Callable[[], None]) -> CopyEvent:
        """Device work (a kernel) on the current stream: on the copy stream it runs on the
        worker after the copies issued before it; on the compute stream (the host), now."""
        if not self.on_copy_stream:
            work()
            return _DONE
        event = self._take_event()
        self._jobs.put((work, None, None, event, 0.0))
        return event

    def before_collective(self) -> None:
        if self.on_copy_stream:
            marker = self.ready()
            try:
                marker.synchronize()
            finally:
                self.recycle(marker)

    def synchronize(self) -> None:
        last = self._last
        if last is not None and not last.query():  # a failure surfaces at its own event
            started = time.perf_counter()
            last._done.wait()
            self.timing.exposed_s += time.perf_counter() - started

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Pause copies (issued ones wait) until the block exits."""
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    def register_host(self, address: int, nbytes: int) -> bool:
        if (self.memlock_nbytes is not None
                and sum(self.registered.values()) + nbytes > self.memlock_nbytes):
            return False
        if self.populate_on_register:
            # As cudaHostRegister: every page is faulted in, so pages nobody backed yet are
            # allocated here, by this process (the OOM killer's business, not an error).
            host_pages.populate(address, nbytes)
        self.registered[address] = nbytes
        return True

    def unregister_host(self, address: int) -> None:
        if self.registered.pop(address, None) is None:
            raise RuntimeError(f"host region {address:#x} was never registered")

    def _run(self) -> None:
        failed: BaseException | None = None  # since the last ``ready()`` marker
        while True:
            job = self._jobs.get()
            if job is None:
                return
            dst, src, guard, event, delay_s = job
            del job
            self._running.wait()
            if src is None:  # a marker, or device work queued by run_on_stream
                error = failed if dst is None else _run_work(dst)
                failed = None if dst is None else failed or error
                del dst
                event._finish(error)
                del event, error
                continue
            if delay_s:
                time.sleep(delay_s)
            started = time.perf_counter()
            error = self._copy(dst, src, guard)
            nbytes = dst.nbytes
            # Drop the views now: a lingering view would keep the client's arena mmap open.
            del dst, src, guard
            if self.bytes_per_s is not None:  # the timed twin: the copy lasts nbytes / rate
                left_s = started + nbytes / self.bytes_per_s - time.perf_counter()
                if left_s > 0:
                    time.sleep(left_s)
            self.timing.copy_s += time.perf_counter() - started
            failed = failed or error
            event._finish(error)
            del event, error

    def _copy(self, dst: torch.Tensor, src: torch.Tensor,
              guard: Guard | None) -> BaseException | None:
        if guard is not None and guard.released:
            self.late_releases_caught += 1
            return CopyAfterReleaseError(
                f"a copy ran after its lease {getattr(guard, 'shard_id', guard)!r} was released; "
                "release leases through ReleaseQueue.release_after(event, ...)")
        try:
            dst.copy_(src)
        except BaseException as error:  # surfaces at the event's synchronize()
            return error
        return None

    def close(self) -> None:
        self._running.set()
        self._jobs.put(None)
        self._worker.join()


def _run_work(work: Callable[[], None]) -> BaseException | None:
    try:
        work()
    except BaseException as error:  # surfaces at the event's synchronize()
        return error
    return None


# ---------------------------------------------------------------------------
# cuda


class CudaCopyEngine(CopyEngine):
    """One CUDA stream per direction and a pool of events on ``device``."""

    kind = "cuda"

    def __init__(self, device: torch.device | str) -> None:
        require_cuda()
        self.device = torch.device(device)
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self._pool: list[torch.cuda.Event] = []
        self.copies = 0
        self.registered: dict[int, int] = {}

    def _take_event(self) -> torch.cuda.Event:
        return self._pool.pop() if self._pool else torch.cuda.Event()

    def recycle(self, event: CopyEvent) -> None:
        if isinstance(event, torch.cuda.Event) and event.query():
            self._pool.append(event)

    def _copy_on(self, stream: torch.cuda.Stream, dst: torch.Tensor,
                 src: torch.Tensor) -> torch.cuda.Event:
        current = torch.cuda.current_stream(self.device)
        event = self._take_event()
        # The copy may overwrite (H2D) or read (D2H) memory the compute stream is still
        # using, so it starts after the compute stream's work issued so far. Inside
        # ``ahead_of_compute`` the current stream is the copy stream itself: memory
        # allocated there is the copy stream's, and nothing is waited for.
        if current != stream:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event.record(stream)
        # The caching allocator must not hand the device buffer to another tensor while
        # this stream still copies into/out of it.
        for tensor in (dst, src):
            if tensor.is_cuda:
                tensor.record_stream(stream)
        self.copies += 1
        return event

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        self.h2d_nbytes += src.nbytes
        return self._copy_on(self.h2d_stream, dst, src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, guard: Guard | None = None) -> CopyEvent:
        self.d2h_nbytes += src.nbytes
        return self._copy_on(self.d2h_stream, dst, src)

    def wait_on_compute(self, event: CopyEvent) -> None:
        assert isinstance(event, torch.cuda.Event | _DoneEvent)
        if isinstance(event, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(event)

    @contextmanager
    def ahead_of_compute(self) -> Iterator[None]:
        with torch.cuda.stream(self.h2d_stream):
            yield

    def ready(self) -> CopyEvent:
        event = self._take_event()
        event.record(self.h2d_stream)
        return event

    def hand_back(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda and tensor.untyped_storage().nbytes():
            tensor.record_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.h2d_stream.synchronize()
        self.d2h_stream.synchronize()

    def register_host(self, address: int, nbytes: int) -> bool:
        # cudaHostRegister faults the pages in one at a time on this thread: mapped first
        # from several threads, an arena pins 2-2.5x faster (trainer.device.host_pages).
        host_pages.populate(address, nbytes)
        # cudaHostRegisterPortable (1): pinned for every context, as torch's own pinning does.
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))
        if code != 0:
            # Hazard: torch's binding leaves the refusal as CUDA's last error, which the
            # next kernel launch check would raise as its own failure.
            clear_last_cuda_error()
            return False
        self.registered[address] = nbytes
        return True

    def unregister_host(self, address: int) -> None:
        if self.registered.pop(address, None) is None:
            return
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
        if code != 0:
            raise RuntimeError(f"cudaHostUnregister({address:#x}) failed with cudaError {code}")

    def close(self) -> None:
        self.synchronize()


def clear_last_cuda_error() -> int:
    """Reset the calling thread's last CUDA runtime error (``cudaGetLastError``) and return
    it. torch binds no ``cudaGetLastError``: call it in every libcudart this process has
    loaded (each keeps its own last error; cupy may bring a second one)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "/libcudart.so" in line})
    last = 0
    for path in paths:
        last = int(ctypes.CDLL(path).cudaGetLastError()) or last
    return last


def require_cuda() -> None:
    """Raise ``CopyEngineUnavailableError`` naming the fix when CUDA cannot be used."""
    if torch.version.cuda is None:
        raise CopyEngineUnavailableError(
            f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch or "
            f'set {COPY_ENGINE_ENV}=twin / config "device": "cpu"')
    if not torch.cuda.is_available():
        raise CopyEngineUnavailableError(
            "torch.cuda.is_available() is False (no GPU or driver visible); "
            f'set config "device": "cpu" or {COPY_ENGINE_ENV}=inline')


# ---------------------------------------------------------------------------
# deferred releases


class ReleaseQueue:
    """Lease releases/commits that wait for the copies using the lease (see module note)."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self._pending: collections.deque[tuple[CopyEvent, Callable[[], None]]] = (
            collections.deque())
        self.deferred = 0
        """Releases that could not run at once because their copy was in flight."""

    def __len__(self) -> int:
        return len(self._pending)

    def release_after(self, event: CopyEvent, release: Callable[[], None]) -> None:
        """Run ``release`` once ``event`` completed (at the next ``poll``/``drain``)."""
        self._pending.append((event, release))
        self.deferred += 1

    def poll(self) -> int:
        """Run the releases whose copies completed, in order; returns how many ran.

        A copy that failed re-raises here (after its release ran: the lease is given back
        either way, and the failure names the race)."""
        ran = 0
        while self._pending and self._pending[0][0].query():
            self._finish(*self._pending.popleft())
            ran += 1
        return ran

    def finish_oldest(self) -> None:
        """Wait for the oldest pending copy and run its release (its failure re-raised)."""
        self._finish(*self._pending.popleft())

    def drain(self) -> None:
        """Wait for every pending copy and run every release (first failure re-raised)."""
        failure: BaseException | None = None
        while self._pending:
            event, release = self._pending.popleft()
            try:
                self._finish(event, release)
            except BaseException as error:  # release the rest before re-raising
                failure = failure or error
        if failure is not None:
            raise failure

    def _finish(self, event: CopyEvent, release: Callable[[], None]) -> None:
        try:
            event.synchronize()  # done already unless draining; re-raises a copy failure
        finally:
            release()
            self.engine.recycle(event)


# ---------------------------------------------------------------------------
# selection


def select_copy_engine(device: torch.device | str, kind: str | None = None) -> CopyEngine:
    """The engine for ``device``: ``kind`` or ``$OFFLOADD_COPY_ENGINE``, else by device."""
    device = torch.device(device)
    from_env = kind is None
    kind = kind or os.environ.get(COPY_ENGINE_ENV) or None
    if kind is not None and kind not in ENGINE_KINDS:
        raise ValueError(f"{COPY_ENGINE_ENV}={kind!r}: expected one of {', '.join(ENGINE_KINDS)}")
    if from_env and kind in ("twin", "inline") and device.type == "cuda":
        kind = None  # the variable picks the engine of CPU compute; a GPU copies on CUDA
    if kind is None:
        kind = "cuda" if device.type == "cuda" else "inline"
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"copy engine 'cuda' needs a cuda compute device, got {device}")
        return CudaCopyEngine(device)
    if device.type == "twin":  # the strict twin's device: host views are not device memory
        return TwinCopyEngine(device=device)
    if device.type != "cpu":
        raise ValueError(f"copy engine {kind!r} runs CPU compute only, got device {device}")
    return TwinCopyEngine() if kind == "twin" else InlineCopyEngine()


def host_address(view: memoryview) -> int:
    """Address of a host buffer (for ``register_host``)."""
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0
