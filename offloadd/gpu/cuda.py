"""The daemon's device copiers: arena <-> a rank's GPU staging slots (daemon-driven copies).

A rank that asks for ``device_copies: "daemon"`` hands the daemon its staging
slots: on CUDA a ``cudaIpcMemHandle_t`` of one device allocation plus, per
slot, two interprocess events (the rank records "consumed", the daemon
records "filled"); on the CPU twin a memfd of the same layout. A
``DeviceCopier`` then copies shard bytes between the arena and those slots on
a stream of its own:

- ``CupyDeviceCopier``: one CUDA context per GPU (found by UUID), the rank's
  allocation opened with ``cudaIpcOpenMemHandle``, copies by
  ``cudaMemcpyAsync`` on a non-blocking stream that first waits
  (``cudaStreamWaitEvent``) on the rank's consumer event of the slot. cupy is
  imported lazily: it lives in the ``cuda`` extra.
- ``TwinDeviceCopier``: the CPU twin. The "device" is the rank's memfd,
  copies run on one worker thread (one stream: in issue order) after a random
  small delay. The memfd ends with an events area: per slot the rank's
  "consumed" count and the daemon's "filled" sequence number, 64-bit words
  both sides map, which play the two IPC events (``TwinEvents``).

A copy is *issued* at once: ``copy_in`` returns the slot's fill sequence
number (the reply the rank gets; its compute waits on the "filled" event at
use) and the copy's completion, which the caller awaits off the reply path.
Several copies of one rank are in flight at once; each waits on its stream
for the rank's "consumed" event of the slot, so a slot is never overwritten
while the rank still reads it.

Hazard (lease outlives the DMA): the caller releases the shard's lease, or
commits the write lease, when the completion is done, never at issue
(invariant 6).

``open_copier`` raises ``CopiesRefused`` with a reason from
``FALLBACK_REASONS`` when the path is impossible; the rank then copies itself.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import fcntl
import logging
import mmap
import os
import random
import threading
import time
from typing import Any

from offloadd.memory import pages
from offloadd.memory.arena import buffer_address
from offloadd.protocol import TwinEvents, twin_staging_nbytes

log = logging.getLogger(__name__)
FALLBACK_REASONS = ("no_cupy", "gpu_not_visible", "expandable_segments", "ipc_refused",
                    "ipc_namespace", "cuda_unavailable", "host_compute")
"""Why a job's rank copies itself although it asked for daemon copies (a metric label)."""
TWIN_MAX_DELAY_ENV = "OFFLOADD_TWIN_MAX_DELAY_US"
DEFAULT_TWIN_MAX_DELAY_S = 200e-6
"""Upper bound of the twin's random per-copy delay (as trainer.device.copy_engine's twin)."""
TWIN_UUID_PREFIX = "twin-"
"""The twin's "GPUs": a rank on the twin names its device ``twin-<n>``."""
MAX_STAGING_SLOTS = 64
MAX_STAGING_NBYTES = 64 << 30
"""Upper bounds of one rank's staging layout (a bad request, not a real GPU)."""
class CopiesRefused(Exception):
    """Daemon copies are impossible for this rank; ``reason`` is one of FALLBACK_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in FALLBACK_REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.message = message


class DeviceCopier(abc.ABC):
    """Copies between the arena and one rank's staging slots, in order, on one stream."""

    kind: str

    def __init__(self, num_slots: int, slot_nbytes: int) -> None:
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.copies = 0
        self.copied_nbytes = 0
        self.fills = [0] * num_slots
        """Per slot, the sequence number of its last copy_in (its "filled" event)."""

    @abc.abstractmethod
    def copy_in(self, slot: int, src: memoryview) -> tuple[int, asyncio.Future[None]]:
        """Issue arena ``src`` -> the slot after the rank's "consumed" event of the slot;
        returns the slot's fill sequence number (its "filled" event, recorded when the copy
        completed: the rank's compute waits on it) and the copy's completion."""

    @abc.abstractmethod
    def copy_out(self, slot: int, dst: memoryview) -> asyncio.Future[None]:
        """Issue the slot's first ``len(dst)`` bytes -> arena ``dst``, after the rank's event
        that says it wrote them; returns the copy's completion."""

    def _next_fill(self, slot: int) -> int:
        self.fills[slot] += 1
        return self.fills[slot]

    def consumed(self, slot: int) -> None:  # noqa: B027 - CUDA waits on the latest record
        """The rank recorded its "consumed" event of the slot (it sent slot_done, or wrote
        the slot for a stage_out): later copies on the slot wait for it."""

    def abandon(self) -> None:  # noqa: B027 - a dead rank's IPC events are recorded
        """The rank went away: copies waiting for its events stop waiting and fail."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop after the copies in flight; unmap the slots."""


# ---------------------------------------------------------------------------
# twin


class TwinDeviceCopier(DeviceCopier):
    """The slots are the rank's memfd; copies run on one worker thread after a random delay,
    each after the rank's "consumed" count of its slot reached what the rank announced."""

    kind = "twin"

    def __init__(self, fd: int, num_slots: int, slot_nbytes: int, *,
                 max_delay_s: float | None = None, seed: int = 0) -> None:
        super().__init__(num_slots, slot_nbytes)
        if max_delay_s is None:
            max_delay_s = float(os.environ.get(TWIN_MAX_DELAY_ENV,
                                               DEFAULT_TWIN_MAX_DELAY_S * 1e6)) * 1e-6
        self.max_delay_s = max(0.0, max_delay_s)
        self._random = random.Random(seed)
        self._map = mmap.mmap(fd, twin_staging_nbytes(num_slots, slot_nbytes))
        self._view = memoryview(self._map)
        self._events = TwinEvents(self._view, num_slots, slot_nbytes)
        self._announced = [0] * num_slots
        """Per slot, the "consumed" records the rank announced (slot_done, stage_out)."""
        self._abandoned = False
        self._stream = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="offloadd-twin-stream")

    def _slot(self, slot: int, nbytes: int) -> memoryview:
        start = slot * self.slot_nbytes
        return self._view[start : start + nbytes]

    def consumed(self, slot: int) -> None:
        self._announced[slot] += 1

    def abandon(self) -> None:
        self._abandoned = True

    def _issue(self, slot: int, dst: memoryview, src: memoryview, seq: int
               ) -> asyncio.Future[None]:
        delay_s = self._random.uniform(0.0, self.max_delay_s)
        job = self._stream.submit(self._copy, slot, self._announced[slot], dst, src, delay_s,
                                  seq)
        self.copies += 1
        self.copied_nbytes += len(src)
        return asyncio.wrap_future(job)

    def copy_in(self, slot: int, src: memoryview) -> tuple[int, asyncio.Future[None]]:
        seq = self._next_fill(slot)
        return seq, self._issue(slot, self._slot(slot, len(src)), src, seq)

    def copy_out(self, slot: int, dst: memoryview) -> asyncio.Future[None]:
        return self._issue(slot, dst, self._slot(slot, len(dst)), 0)

    def _copy(self, slot: int, consumed: int, dst: memoryview, src: memoryview, delay_s: float,
              seq: int) -> None:
        """On the stream: wait for the rank's consumer event, copy, record "filled"."""
        try:
            self._events.wait(2 * slot, consumed, f"slot {slot}'s consumed event",
                              lambda: self._abandoned)
            if delay_s:
                time.sleep(delay_s)
            dst[:] = src
        except BaseException:
            if seq:
                self._events.record_filled(slot, seq, failed=True)
            raise
        if seq:
            self._events.record_filled(slot, seq)

    def close(self) -> None:
        # Unmapped by the worker itself, after the copies queued before it: no copy can
        # touch the slots once they are gone, and the event loop never blocks on them.
        self._stream.submit(self._unmap)
        self._stream.shutdown(wait=False)

    def _unmap(self) -> None:
        self._events.release()
        self._view.release()
        self._map.close()


def open_twin_staging(peer_pid: int, peer_uid: int, fd_number: int, nbytes: int) -> int:
    """The rank's staging memfd, opened through ``/proc/<pid>/fd``: the twin's stand-in for
    cudaIpcOpenMemHandle, with the same limits (same host, an IPC/pid namespace the daemon
    shares with the rank, permission). An asyncio transport cannot receive SCM_RIGHTS.

    Hazard (the daemon's credentials): reopening through /proc grants the daemon's access,
    not the rank's, so only a memfd the rank's uid owns is accepted; and it must be sealed
    against shrinking, or the rank could truncate it under the daemon's mapping (SIGBUS)."""
    if _namespace(peer_pid) != _namespace(os.getpid()):
        raise CopiesRefused("ipc_namespace", f"rank pid {peer_pid} runs in another IPC "
                            "namespace (a container without --ipc=host); daemon copies need "
                            "the daemon's IPC namespace")
    try:
        fd = os.open(f"/proc/{peer_pid}/fd/{fd_number}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        raise CopiesRefused("ipc_refused", f"cannot open the rank's staging memfd "
                            f"{fd_number} of pid {peer_pid}: {error.strerror}") from error
    try:
        _check_staging_file(fd, peer_uid, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_staging_file(fd: int, peer_uid: int, nbytes: int) -> None:
    status = os.fstat(fd)
    if peer_uid != 0 and status.st_uid != peer_uid:
        raise CopiesRefused("ipc_refused", f"the staging fd names a file of uid "
                            f"{status.st_uid}, not the rank's uid {peer_uid}")
    try:
        file_seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as error:
        raise CopiesRefused("ipc_refused", "the staging fd is not a memfd "
                            f"(F_GET_SEALS: {error.strerror})") from error
    if not file_seals & fcntl.F_SEAL_SHRINK:
        raise CopiesRefused("ipc_refused", "the staging memfd is not sealed against "
                            "shrinking; create it with MFD_ALLOW_SEALING, fallocate it and add "
                            "F_SEAL_SHRINK before staging_open")
    if status.st_size < nbytes:
        raise CopiesRefused("ipc_refused", f"the rank's staging memfd has {status.st_size} B, "
                            f"its slots need {nbytes} B")


def _namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/ipc")
    except OSError:
        return ""


# ---------------------------------------------------------------------------
# cuda (cupy)


def normalize_uuid(uuid: str) -> str:
    """``GPU-58e2...`` / ``58e2...`` -> ``58e2...`` (lower case), as nvidia-smi and torch
    print the same device."""
    return uuid.lower().removeprefix("gpu-")


def _import_cupy() -> Any:
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]
    except ImportError as error:
        raise CopiesRefused("no_cupy", "the daemon has no cupy (pip install 'offloadd[cuda]' "
                            f"where the daemon runs): {error}") from error
    return cupy


def normalize_pci_bus_id(bus_id: str) -> tuple[int, ...]:
    """``0000:18:00.0`` / ``00000000:18:00.0`` (nvidia-smi) -> (domain, bus, device,
    function); () when ``bus_id`` is not one."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device, function = rest.split(".")
        return tuple(int(part, 16) for part in (domain, bus, device, function))
    except ValueError:
        return ()


def _uuid_matches(raw: Any, wanted: str) -> bool:
    """Whether cupy's ``uuid`` property is the GPU ``wanted`` (normalised hex). cupy's
    bytes stop before the first zero byte (seen on an H100 whose UUID holds ``00``): a
    shorter value matches when it is ``wanted``'s prefix followed there by a zero byte."""
    if not isinstance(raw, bytes):
        return normalize_uuid(str(raw)).replace("-", "") == wanted.replace("-", "")
    try:
        wanted_bytes = bytes.fromhex(wanted.replace("-", ""))
    except ValueError:
        return False
    if len(raw) >= len(wanted_bytes):
        return raw[:len(wanted_bytes)] == wanted_bytes
    return wanted_bytes.startswith(raw) and wanted_bytes[len(raw)] == 0


def find_device(cupy: Any, uuid: str, pci_bus_id: str = "") -> int:
    """The daemon's device index of the GPU at ``pci_bus_id``, else the one with ``uuid``.

    The PCI bus id comes first: cupy returns the UUID's 16 bytes through a C string, which
    stops at the first zero byte; by UUID such a GPU matches only by that prefix, and
    only when no other visible GPU shares it."""
    wanted = normalize_uuid(uuid)
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as error:  # cupy raises CUDARuntimeError without a driver
        raise CopiesRefused("cuda_unavailable", f"the daemon sees no CUDA device: {error}") \
            from error
    wanted_bus = normalize_pci_bus_id(pci_bus_id)
    if wanted_bus:
        for index in range(count):
            if normalize_pci_bus_id(runtime.deviceGetPCIBusId(index)) == wanted_bus:
                return index
    matches = [index for index in range(count)
               if _uuid_matches(runtime.getDeviceProperties(index).get("uuid", b""), wanted)]
    if len(matches) == 1:
        return matches[0]
    raise CopiesRefused("gpu_not_visible", f"GPU {uuid} (PCI {pci_bus_id or '?'}) is not "
                        "visible to the daemon "
                        f"({count} device(s); check CUDA_VISIBLE_DEVICES / the container's "
                        "--gpus of the daemon)")


class CupyDeviceCopier(DeviceCopier):
    """One rank's staging allocation opened by IPC on the daemon's context of its GPU.

    Untested on hardware in this tree (no GPU in CI): the twin runs the same protocol.
    """

    kind = "cuda"

    def __init__(self, cupy: Any, device_index: int, ipc_handle: bytes, ipc_offset: int,
                 event_handles: list[bytes], num_slots: int, slot_nbytes: int) -> None:
        super().__init__(num_slots, slot_nbytes)
        if len(event_handles) != 2 * num_slots:
            raise CopiesRefused("ipc_refused", f"{len(event_handles)} event handles for "
                                f"{num_slots} slots (need 2 per slot)")
        self._cupy = cupy
        self._runtime = runtime = cupy.cuda.runtime
        self._device = cupy.cuda.Device(device_index)
        try:
            with self._device:
                self._base = runtime.ipcOpenMemHandle(ipc_handle,
                                                      runtime.cudaIpcMemLazyEnablePeerAccess)
                self._slots_ptr = self._base + ipc_offset
                self._consumed = [runtime.ipcOpenEventHandle(h) for h in event_handles[0::2]]
                self._filled = [runtime.ipcOpenEventHandle(h) for h in event_handles[1::2]]
                self._stream = cupy.cuda.Stream(non_blocking=True)
        except Exception as error:  # CUDARuntimeError: IPC refused (namespace, driver)
            raise CopiesRefused("ipc_refused", f"cudaIpcOpen* failed: {error}") from error
        self._arena_address = 0
        self._done_events: list[Any] = []
        """Private completion events, pooled (list appends and pops are atomic)."""

    def register_arena(self, address: int, nbytes: int) -> None:
        """Pin the job's arena mapping for this process (once per arena, refcounted), so
        cudaMemcpyAsync from it is real async DMA rather than a staged pageable copy."""
        with _pinned_lock:  # two ranks' staging_open run on two executor threads
            if _pinned.get(address, 0) == 0:
                with self._device:
                    try:  # cudaHostRegisterPortable: pinned for every context of the daemon
                        self._runtime.hostRegister(address, nbytes, 1)
                    except Exception as error:  # memlock: copies work, staged and slower
                        log.warning("event=arena_pin_failed nbytes=%d error=%r: daemon copies "
                                    "run from pageable memory; raise LimitMEMLOCK of the "
                                    "daemon", nbytes, str(error))
                        return
            _pinned[address] = _pinned.get(address, 0) + 1
        self._arena_address = address

    def _completion(self) -> asyncio.Future[None]:
        """A private event after the copy just issued, synchronized off the loop (invariant
        5); the caller's lease goes back after it (invariant 6). Not the IPC "filled"
        event: a later copy into the slot may record that one again before we wait."""
        event = self._done_events.pop() if self._done_events else self._cupy.cuda.Event(
            block=False, disable_timing=True)
        event.record(self._stream)
        return asyncio.get_running_loop().run_in_executor(None, self._synchronize, event)

    def _synchronize(self, event: Any) -> None:
        with self._device:  # an executor thread has no current context of its own
            event.synchronize()
        self._done_events.append(event)

    def copy_in(self, slot: int, src: memoryview) -> tuple[int, asyncio.Future[None]]:
        runtime, stream = self._runtime, self._stream.ptr
        with self._device:
            runtime.streamWaitEvent(stream, self._consumed[slot], 0)
            runtime.memcpyAsync(self._slots_ptr + slot * self.slot_nbytes, buffer_address(src),
                                len(src), runtime.memcpyHostToDevice, stream)
            runtime.eventRecord(self._filled[slot], stream)
            done = self._completion()
        self.copies += 1
        self.copied_nbytes += len(src)
        return self._next_fill(slot), done

    def copy_out(self, slot: int, dst: memoryview) -> asyncio.Future[None]:
        runtime, stream = self._runtime, self._stream.ptr
        with self._device:
            runtime.streamWaitEvent(stream, self._consumed[slot], 0)
            runtime.memcpyAsync(buffer_address(dst), self._slots_ptr + slot * self.slot_nbytes,
                                len(dst), runtime.memcpyDeviceToHost, stream)
            done = self._completion()
        self.copies += 1
        self.copied_nbytes += len(dst)
        return done

    def close(self) -> None:
        """Blocks until the stream drained and unpins the arena: run it off the loop."""
        runtime = self._runtime
        with self._device:
            self._stream.synchronize()
            for event in (*self._consumed, *self._filled):
                runtime.eventDestroy(event)
            runtime.ipcCloseMemHandle(self._base)
            if self._arena_address:
                with _pinned_lock:
                    _pinned[self._arena_address] -= 1
                    if not _pinned[self._arena_address]:
                        del _pinned[self._arena_address]
                        runtime.hostUnregister(self._arena_address)


_pinned: dict[int, int] = {}
"""Arena mappings this daemon registered with CUDA -> copiers using them."""
_pinned_lock = threading.Lock()


def open_copier(*, kind: str, device_uuid: str, peer_pid: int, peer_uid: int, staging_fd: int,
                ipc_handle: bytes, ipc_offset: int, event_handles: list[bytes],
                num_slots: int, slot_nbytes: int, arena: memoryview,
                device_pci_bus_id: str = "", pin_arena: bool = True) -> DeviceCopier:
    """The copier for one rank's staging slots, or ``CopiesRefused`` naming why not.
    ``pin_arena``: register the arena for DMA (cudaHostRegister, which faults in every
    page; the twin faults them in as well); False where the node has no memory for the
    pages that would take (``Arena.pin_shortage``): copies then run from pageable memory."""
    if kind == "twin":
        if not device_uuid.startswith(TWIN_UUID_PREFIX):
            raise CopiesRefused("gpu_not_visible", f"GPU {device_uuid!r} is not visible to "
                                f"the daemon's twin (twin devices are named "
                                f"{TWIN_UUID_PREFIX}<n>)")
        fd = open_twin_staging(peer_pid, peer_uid, staging_fd,
                                twin_staging_nbytes(num_slots, slot_nbytes))
        if pin_arena:  # as cudaHostRegister: every page faulted in by this process
            try:
                pages.populate_write(buffer_address(arena), len(arena))
            except OSError as error:
                log.warning("event=arena_pin_failed nbytes=%d error=%r", len(arena), str(error))
        try:
            return TwinDeviceCopier(fd, num_slots, slot_nbytes)
        finally:
            os.close(fd)  # the mapping keeps the memory
    cupy = _import_cupy()
    device_index = find_device(cupy, device_uuid, device_pci_bus_id)
    copier = CupyDeviceCopier(cupy, device_index, ipc_handle, ipc_offset, event_handles,
                              num_slots, slot_nbytes)
    if pin_arena:
        copier.register_arena(buffer_address(arena), len(arena))
    return copier
