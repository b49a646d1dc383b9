"""Rank side of daemon-driven device copies (``"offloadd": {"device_copies": "daemon"}``).

The rank owns a few staging slots on its compute device and lends them to the
daemon (``staging_open``): on CUDA one device allocation exported with a CUDA
IPC handle plus two interprocess events per slot; on the CPU twin a memfd the
daemon maps. It then asks for shards by id:

- parameters (H2D): ``stage_in`` fills a slot; the daemon replies when the
  copy is *issued*, with the sequence number of the slot's "filled" event,
  which the rank waits for at use (the compute stream on CUDA, the host on
  the twin), so several stage_ins are in flight at once; the rank copies the
  slot into its own buffer, records the slot's "consumed" event and reports
  ``slot_done``. ``prefetch`` stages upcoming units ahead of
  use, in free slots only.
- read-ahead: the rank may lend its last slots to the daemon
  (``readahead_slots``), which stages the shards the rank's learned trace says
  come next into them; a stage_in of such a shard is answered with the
  read-ahead slot (``Staged`` reply), the rank's own slot stays free, and the
  rank consumes the read-ahead slot and reports ``slot_done`` as for its own.
- gradients (D2H): the rank writes the reduced gradient into a free slot,
  records "consumed" (the daemon's stream waits on it) and sends
  ``stage_out``; the daemon commits the shard after its copy completed. The
  slot is free again when that reply arrived.

Hazard (slot reuse): a slot is written again only after its last use
finished, the rank's consumer event for a staged slot and the daemon's reply
for a drained one; otherwise a copy overwrites bytes still being read. The
daemon refuses a reuse it can see (``SlotBusyError``).

When daemon copies are impossible (no cupy in the daemon, the GPU not visible
to it, the expandable_segments allocator, IPC refused, another IPC namespace,
CPU compute without a device copy engine) ``open_daemon_copies`` logs one
reason, the daemon counts it, and the engine trains on with rank copies.
"""

from __future__ import annotations

import abc
import collections
import fcntl
import logging
import mmap
import os
import warnings
from typing import Any

import torch

from offloadd import protocol as p
from offloadd.protocol import TWIN_FAILED, TwinEvents, twin_staging_nbytes
from trainer.client import OffloadError
from trainer.device.copy_engine import CopyEngine

log = logging.getLogger(__name__)
TWIN_GPU_UUID_ENV = "OFFLOADD_TWIN_GPU_UUID"
"""The twin "GPU" a rank names at staging_open (default ``twin-<local rank>``); a test knob
for the gpu_not_visible fallback."""
SLOT_ALIGNMENT = 512
"""Slot starts are aligned for any dtype and for DMA."""
MAX_UNREAD_ACKS = 64
"""slot_done replies left unread before reading them (bounds the client's inbox)."""


class StagingUnavailable(Exception):
    """This rank cannot export staging slots; ``reason`` is a daemon fallback reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class DeviceCopyFailed(RuntimeError):
    """The daemon's copy into a staging slot failed after its stage_in was answered."""


class Staging(abc.ABC):
    """The rank's staging slots on its compute device and their events."""

    kind: str
    device_uuid: str

    def __init__(self, num_slots: int, slot_nbytes: int) -> None:
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.slots: list[torch.Tensor] = []

    @abc.abstractmethod
    def export(self) -> dict[str, Any]:
        """The ``staging_open`` fields that let the daemon map the slots."""

    @abc.abstractmethod
    def wait_filled(self, slot: int, seq: int) -> None:
        """Make later compute wait for the daemon's copy number ``seq`` into ``slot``."""

    @abc.abstractmethod
    def record_consumed(self, slot: int) -> None:
        """Mark the point after which the daemon may copy into/out of ``slot`` again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the slots (after the daemon let go of them)."""


class TwinStaging(Staging):
    """The twin's "device" slots: a memfd the daemon maps, ending with the events area
    both sides map (see offloadd.protocol.TwinEvents). The host plays the compute stream: it
    waits for a slot's "filled" event at use."""

    kind = "twin"

    def __init__(self, num_slots: int, slot_nbytes: int, local_rank: int) -> None:
        super().__init__(num_slots, slot_nbytes)
        self.device_uuid = os.environ.get(TWIN_GPU_UUID_ENV, f"twin-{local_rank}")
        self.fd = os.memfd_create("offloadd-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        nbytes = twin_staging_nbytes(num_slots, slot_nbytes)
        os.ftruncate(self.fd, nbytes)
        # Backed now and sealed: the daemon maps it and must never fault on it (SIGBUS on a
        # page tmpfs cannot supply, or on a file shrunk under its mapping).
        os.posix_fallocate(self.fd, 0, nbytes)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self._map = mmap.mmap(self.fd, nbytes)
        self._events = TwinEvents(memoryview(self._map), num_slots, slot_nbytes)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.slots = [whole[i * slot_nbytes : (i + 1) * slot_nbytes] for i in range(num_slots)]

    def export(self) -> dict[str, Any]:
        return {"staging_fd": self.fd}

    def wait_filled(self, slot: int, seq: int) -> None:
        word = self._events.wait(2 * slot + 1, seq, f"slot {slot}'s filled event {seq}")
        if word & TWIN_FAILED and word & ~TWIN_FAILED == seq:
            raise DeviceCopyFailed(f"the daemon's copy {seq} into staging slot {slot} failed "
                                   "(see the daemon's log)")

    def record_consumed(self, slot: int) -> None:
        self._events.record_consumed(slot)

    def close(self) -> None:
        self.slots = []
        self._events.release()
        os.close(self.fd)
        try:
            self._map.close()
        except BufferError:  # a caller still holds a slot view: the GC unmaps it later
            pass


class CudaStaging(Staging):
    """One device allocation exported by CUDA IPC, and per slot two IPC events.

    Untested on hardware in this tree (no GPU in CI); the twin runs the same protocol.
    """

    kind = "cuda"

    def __init__(self, device: torch.device, num_slots: int, slot_nbytes: int) -> None:
        super().__init__(num_slots, slot_nbytes)
        check_allocator_exportable()
        self.device = device
        self.buffer = torch.empty(num_slots * slot_nbytes, dtype=torch.uint8, device=device)
        try:
            shared = self.buffer.untyped_storage()._share_cuda_()
        except RuntimeError as error:
            raise StagingUnavailable("ipc_refused", f"cannot export the staging buffer by "
                                     f"CUDA IPC: {error}") from error
        self._ipc_handle, self._ipc_offset = cuda_ipc_mem_handle(bytes(shared[1])), int(shared[3])
        self._ipc_ref_counter: tuple[Any, ...] | None = (shared[4], shared[5])
        """torch's cross-process count of this export. Its consumer is the daemon's cupy,
        which never decrements it, so torch would keep the block forever ("producer
        terminated before all shared CUDA tensors released"): ``close`` gives it back."""
        self.slots = [self.buffer[i * slot_nbytes : (i + 1) * slot_nbytes]
                      for i in range(num_slots)]
        self.consumed = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
        self.filled = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
        properties: Any = torch.cuda.get_device_properties(device)  # pci_* are not typed
        self.device_uuid = str(properties.uuid)
        self.device_pci_bus_id = (f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:"
                                  f"{properties.pci_device_id:02x}.0")

    def export(self) -> dict[str, Any]:
        handles = []
        with torch.cuda.device(self.device):
            for consumed, filled in zip(self.consumed, self.filled, strict=True):
                handles += [bytes(consumed.ipc_handle()), bytes(filled.ipc_handle())]
        return {"ipc_handle": self._ipc_handle, "ipc_offset": self._ipc_offset,
                "event_handles": handles}

    def wait_filled(self, slot: int, seq: int) -> None:
        # The daemon recorded the IPC event on its stream before it replied, and records it
        # again only after this slot's next slot_done: its latest record is copy ``seq``.
        torch.cuda.current_stream(self.device).wait_event(self.filled[slot])

    def record_consumed(self, slot: int) -> None:
        self.consumed[slot].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        self.slots = []
        if self._ipc_ref_counter is not None:
            counter, self._ipc_ref_counter = self._ipc_ref_counter, None
            torch.UntypedStorage._release_ipc_counter(*counter, device=self.device)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)


CUDA_IPC_HANDLE_NBYTES = 64
"""sizeof(cudaIpcMemHandle_t)."""


def cuda_ipc_mem_handle(torch_handle: bytes) -> bytes:
    """The raw ``cudaIpcMemHandle_t`` inside the handle ``_share_cuda_`` returns.

    torch (c10 ``CUDACachingAllocator::shareIpcHandle``) writes ``[version][type][payload]``:
    type ``'c'`` is a cudaMalloc block followed by its 64-byte handle, ``'e'`` an expandable
    segment (not a cudaIpcMemHandle_t at all); torch before versioning wrote the bare 64
    bytes."""
    if len(torch_handle) == CUDA_IPC_HANDLE_NBYTES:
        return torch_handle
    if len(torch_handle) >= 2 + CUDA_IPC_HANDLE_NBYTES and torch_handle[1] == ord("c"):
        return torch_handle[2 : 2 + CUDA_IPC_HANDLE_NBYTES]
    if len(torch_handle) >= 2 and torch_handle[1] == ord("e"):
        raise StagingUnavailable("expandable_segments", "the staging buffer lives in an "
                                 "expandable segment, which cudaIpcOpenMemHandle cannot open; "
                                 "unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF")
    raise StagingUnavailable("ipc_refused", f"unknown torch CUDA IPC handle layout "
                             f"({len(torch_handle)} B, type byte {torch_handle[1:2]!r})")


def check_allocator_exportable() -> None:
    """CUDA IPC cannot export expandable-segments memory (torch's caching allocator)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
            raise StagingUnavailable(
                "expandable_segments", f"{name} enables expandable_segments, whose memory "
                "CUDA IPC cannot export; unset it to use device_copies \"daemon\"")


def make_staging(copies: CopyEngine, num_slots: int, slot_nbytes: int,
                 local_rank: int) -> Staging:
    """Staging slots for the rank's copy engine, or ``StagingUnavailable``."""
    if copies.kind == "cuda":
        return CudaStaging(copies.device, num_slots, slot_nbytes)
    if copies.zero_copy:
        raise StagingUnavailable("host_compute", "compute reads the arena directly (no device "
                                 "copy engine): there is nothing for the daemon to copy")
    return TwinStaging(num_slots, slot_nbytes, local_rank)


class DaemonCopies:
    """Shards in and out of the rank's staging slots by the daemon's copies."""

    def __init__(self, client: Any, staging: Staging, readahead_slots: int = 0) -> None:
        self.client = client
        self.staging = staging
        self.own_slots = staging.num_slots - readahead_slots
        """Slots ``[0, own_slots)`` are the rank's; the rest the daemon's read-ahead slots."""
        self._free = collections.deque(range(self.own_slots))
        self._staged: collections.OrderedDict[str, tuple[int, Any]] = collections.OrderedDict()
        """Shard id -> (slot, reply handle of its stage_in), oldest first."""
        self._draining: collections.OrderedDict[str, tuple[int, Any]] = (
            collections.OrderedDict())
        """Shard id -> (slot, reply handle of its stage_out): committed at the reply."""
        self._acks: list[Any] = []
        """Reply handles of slot_done requests not yet read (one round trip saved per read:
        the daemon handles a connection's requests in order, so the slot is free for any
        later stage_in even before this reply is read)."""
        self.staged_ahead = 0
        """Stage-ins issued by ``prefetch`` (ahead of use)."""
        self.prefetch_hits = 0
        """Reads served by a slot staged ahead."""
        self.readahead = {"hit": 0, "miss": 0, "stale": 0}
        """The daemon's answers to this rank's stage_ins: from its read-ahead or not."""

    # -- slots ----------------------------------------------------------------------

    def _take_slot(self) -> int:
        if not self._free and self._draining:
            self._settle_out(next(iter(self._draining)))
        if not self._free and self._staged:
            self.discard(next(iter(self._staged)))  # the oldest prefetch loses its slot
        return self._free.popleft()

    def _consumed(self, slot: int) -> None:
        self.staging.record_consumed(slot)
        self._acks.append(self.client.request_async(p.SlotDone(0, slot)))
        if slot < self.own_slots:  # a read-ahead slot goes back to the daemon
            self._free.append(slot)
        if len(self._acks) >= MAX_UNREAD_ACKS:
            self._read_acks()

    def _read_acks(self) -> None:
        acks, self._acks = self._acks, []
        failure: BaseException | None = None
        for ack in acks:
            try:
                ack.wait()
            except BaseException as error:  # read the rest: their replies must not linger
                failure = failure or error
        if failure is not None:
            raise failure

    def _settle_out(self, shard_id: str) -> None:
        slot, handle = self._draining.pop(shard_id)
        try:
            handle.wait()
        finally:
            self._free.append(slot)

    def _filled(self, slot: int, handle: Any) -> int:
        """Wait for a stage_in's copy into ``slot`` to be issued, then for the copy itself
        (at use: the compute stream on CUDA); returns the slot holding the shard (a
        read-ahead slot of the daemon's when it staged the shard ahead: ``slot`` is free
        again). A failed copy gives the slot back and raises."""
        try:
            handle.wait()
        except BaseException:
            self._free.append(slot)  # the daemon freed the slot of a failed stage_in
            raise
        reply = handle.reply
        assert isinstance(reply, p.Staged), reply
        if reply.outcome:
            self.readahead[reply.outcome] = self.readahead.get(reply.outcome, 0) + 1
        if reply.slot != slot:
            self._free.append(slot)
        try:
            self.staging.wait_filled(reply.slot, reply.seq)
        except BaseException:
            self._consumed(reply.slot)
            raise
        return reply.slot

    def _stage(self, shard_id: str) -> tuple[int, Any]:
        slot = self._take_slot()
        try:
            return slot, self.client.request_async(p.StageIn(0, shard_id, slot))
        except BaseException:
            self._free.append(slot)
            raise

    # -- operations ----------------------------------------------------------------

    def settle(self, shard_id: str) -> None:
        """Wait for the shard's stage_out (its new bytes are committed after it)."""
        if shard_id in self._draining:
            self._settle_out(shard_id)

    def read_into(self, shard_id: str, out: torch.Tensor) -> bool:
        """Copy the shard's committed bytes into device ``out``; True when staged ahead."""
        self.settle(shard_id)
        entry = self._staged.pop(shard_id, None)
        hit = entry is not None
        slot, handle = entry if entry is not None else self._stage(shard_id)
        slot = self._filled(slot, handle)
        out.view(-1).copy_(self.staging.slots[slot][: out.nbytes].view(out.dtype))
        self._consumed(slot)
        self.prefetch_hits += hit
        return hit

    def write_from(self, shard_id: str, src: torch.Tensor) -> None:
        """Start committing device ``src`` as the shard's new bytes (returns at once)."""
        self.settle(shard_id)
        self.discard(shard_id)
        slot = self._take_slot()
        self.staging.slots[slot][: src.nbytes].view(src.dtype).copy_(src.reshape(-1))
        self.staging.record_consumed(slot)
        try:
            handle = self.client.request_async(p.StageOut(0, shard_id, slot, src.nbytes))
        except BaseException:
            self._free.append(slot)
            raise
        self._draining[shard_id] = (slot, handle)

    def prefetch(self, shard_ids: list[str]) -> None:
        """Stage ``shard_ids`` ahead of use, in slots nobody needs (one stays free)."""
        for shard_id in shard_ids:
            if shard_id in self._staged or shard_id in self._draining or len(self._free) < 2:
                continue
            self._staged[shard_id] = self._stage(shard_id)
            self.staged_ahead += 1

    def discard(self, shard_id: str) -> None:
        """Forget a stage-in made ahead (its bytes are about to change, or its slot is
        needed): wait for the copy (nothing may write the slot under it), then give the
        slot back."""
        entry = self._staged.pop(shard_id, None)
        if entry is None:
            return
        self._consumed(self._filled(*entry))

    def drain(self) -> None:
        """Every copy finished and every slot free (first failure re-raised)."""
        failure: BaseException | None = None
        for shard_id in list(self._draining):
            try:
                self._settle_out(shard_id)
            except BaseException as error:
                failure = failure or error
        for shard_id in list(self._staged):
            try:
                self.discard(shard_id)
            except BaseException as error:
                failure = failure or error
        try:
            self._read_acks()
        except BaseException as error:
            failure = failure or error
        if failure is not None:
            raise failure

    def close(self) -> None:
        try:
            if not self.client.closed:
                self.drain()
        finally:
            self.staging.close()


def open_daemon_copies(client: Any, copies: CopyEngine, *, num_slots: int, slot_nbytes: int,
                       local_rank: int, arena_pinned: str, readahead_slots: int = 0
                       ) -> tuple[DaemonCopies | None, str]:
    """Daemon copies for this rank, or (None, reason) after one logged fallback warning.

    ``readahead_slots`` of the ``num_slots`` are lent to the daemon to stage shards ahead
    of use from the rank's learned trace (a daemon without read-ahead takes none)."""
    slot_nbytes = -(-slot_nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    staging: Staging | None = None
    detail = ""
    request = p.StagingOpen(0, copies.kind, "", num_slots, slot_nbytes,
                            arena_pinned=arena_pinned, readahead_slots=readahead_slots)
    try:
        staging = make_staging(copies, num_slots, slot_nbytes, local_rank)
        request.kind, request.device_uuid = staging.kind, staging.device_uuid
        request.device_pci_bus_id = getattr(staging, "device_pci_bus_id", "")
        for key, value in staging.export().items():
            setattr(request, key, value)
    except StagingUnavailable as unavailable:
        request.rank_reason, detail = unavailable.reason, str(unavailable)
    try:
        reply = client.request(request)
        assert isinstance(reply, p.StagingOk)
        reason = reply.reason
        if reply.path == "daemon":
            assert staging is not None
            return DaemonCopies(client, staging, reply.readahead_slots), ""
        if not request.rank_reason:
            detail = "refused by the daemon (see its log)"
    except OffloadError as error:  # a daemon without staging_open, say
        reason, detail = "ipc_refused", f"staging_open failed: {error}"
    if staging is not None:
        staging.close()
    warnings.warn(f'offloadd.device_copies "daemon" is not possible here ({reason}: {detail});'
                  " training on with rank copies", RuntimeWarning, stacklevel=3)
    return None, reason


def report_rank_copies(client: Any, arena_pinned: str) -> None:
    """Tell the daemon this rank copies to its device itself, and how pinning its arena
    went (metrics only: a daemon that does not know the request is no reason to fail)."""
    try:
        client.request(p.StagingOpen(0, "none", "", 0, 0, arena_pinned=arena_pinned))
    except OffloadError as error:
        log.info("the daemon did not take the device report: %s", error)
