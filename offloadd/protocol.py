"""The control protocol: message types and framing, defined once for both sides.

A frame is a 4-byte little-endian payload length followed by a msgpack
payload encoding one tagged struct. Requests carry a request id (``rid``)
that the reply echoes, so an asynchronous client can keep many requests in
flight. Bulk data never crosses the socket: shards live in the shared arena
and the replies carry arena offsets.
"""

from __future__ import annotations

import functools
import struct
from typing import TYPE_CHECKING, Literal

import msgspec

from offloadd.errors import ErrorCode, InvalidRequestError

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1
HEADER = struct.Struct("<I")
HEADER_NBYTES = HEADER.size
MAX_FRAME_NBYTES = 16 << 20
"""Largest accepted payload; a longer length prefix is a bad frame and closes the connection."""

Mode = Literal["r", "w"]
JOB_SECRET_ENV = "OFFLOADD_JOB_SECRET"
"""Environment variable the client reads the job secret from (set by the launcher)."""
DTYPE_ITEMSIZE = {"uint8": 1, "int8": 1, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
                  "float32": 4, "float64": 8}
"""Element dtypes a shard may carry (torch's names), with their sizes in bytes."""
DTYPES = tuple(DTYPE_ITEMSIZE)
"""Dtype tags a shard may carry; the tag only describes the bytes, the daemon never converts."""


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Shard dtype tag -> torch dtype, shared by the daemon's optimizer and the client.

    Imports torch on first call only: the daemon does so at its first optimizer step
    (a swap-only daemon starts in a fraction of the time)."""
    import torch

    return {tag: getattr(torch, tag) for tag in DTYPES}


class Request(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    rid: int


class Hello(Request, tag="hello"):
    protocol_version: int
    job: str
    rank: int
    world_size: int
    local_rank: int = 0
    device: str = "cpu"
    arena_nbytes: int = 0  # 0: let the daemon pick a fair share
    job_secret: str = ""  # offloadd.auth: must match the secret of the job's first hello


class Alloc(Request, tag="alloc"):
    ids: list[str]
    nbytes: list[int]
    dtypes: list[str]


class Acquire(Request, tag="acquire"):
    ids: list[str]
    mode: Mode
    create_nbytes: list[int] | None = None  # create missing shards with these sizes (put)
    create_dtypes: list[str] | None = None


class Release(Request, tag="release"):
    ids: list[str]
    dirty: bool
    torn: bool = False  # a write lease ended by an exception: publish nothing, mark torn


class Drop(Request, tag="drop"):
    ids: list[str]


class Prefetch(Request, tag="prefetch"):
    ids: list[str]
    deadline_s: float = 0.0  # seconds from now when the shards are needed; 0 = soon


class StepBegin(Request, tag="step_begin"):
    pass


class Flush(Request, tag="flush"):
    tag_name: str | None = None


class Stats(Request, tag="stats"):
    pass


class CloseJob(Request, tag="close_job"):
    """This rank is done with its job: the session leaves it, and the job is freed (arena,
    swap files of a never-flushed job) once no session is left, without lingering."""


class NodeStatus(Request, tag="node_status"):
    """Admin query: every job's stats and the node's, answered with StatsOk even before hello."""


class OptimizerStep(Request, tag="optimizer_step"):
    unit: str
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = True
    grad_scale: float = 1.0


class StagingOpen(Request, tag="staging_open"):
    """Ask for daemon-driven device copies (offloadd.device_copies): the rank's staging
    slots on its GPU (CUDA IPC handles) or, on the twin, a memfd of the same layout."""

    kind: str  # "cuda" | "twin" | "none" (a report: this rank copies itself by configuration)
    device_uuid: str  # the GPU the slots live on ("GPU-..." as nvidia-smi -L prints it)
    num_slots: int
    slot_nbytes: int
    staging_fd: int = -1  # twin: the memfd's descriptor number in the rank's process
    ipc_handle: bytes = b""  # cuda: cudaIpcMemHandle_t of the staging allocation
    ipc_offset: int = 0  # cuda: byte offset of slot 0 inside that allocation
    event_handles: list[bytes] = []  # cuda: per slot, the rank's then the daemon's event
    rank_reason: str = ""  # the rank cannot export (a fallback reason): count it, copy nothing
    arena_pinned: str = "not_attempted"  # the rank's cudaHostRegister of its arena mapping
    readahead_slots: int = 0  # the last n slots are lent to the daemon to stage ahead of use
    device_pci_bus_id: str = ""  # cuda: the GPU's PCI bus id ("0000:18:00.0"), matched first


class StageIn(Request, tag="stage_in"):
    """Copy the shard's committed bytes into a staging slot; the reply is the slot's event."""

    shard_id: str
    slot: int


class StageOut(Request, tag="stage_out"):
    """Commit the slot's first ``nbytes`` as the shard's new bytes (a gradient D2H)."""

    shard_id: str
    slot: int
    nbytes: int


class SlotDone(Request, tag="slot_done"):
    """The rank consumed a staged slot: the daemon may copy into it again."""

    slot: int


AnyRequest = (
    Hello | Alloc | Acquire | Release | Drop | Prefetch | StepBegin | Flush | Stats | OptimizerStep
    | NodeStatus | CloseJob | StagingOpen | StageIn | StageOut | SlotDone
)


class Reply(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    rid: int


class HelloOk(Reply, tag="hello_ok"):
    protocol_version: int
    arena_nbytes: int
    session_id: int
    daemon_pid: int


class Placed(Reply, tag="placed"):
    """Where the requested shards live in the arena (alloc and acquire)."""

    offsets: list[int]
    nbytes: list[int]
    versions: list[int]
    dtypes: list[str]


class Ok(Reply, tag="ok"):
    pass


class StatsOk(Reply, tag="stats_ok"):
    stats: dict[str, object]


class ErrorReply(Reply, tag="error"):
    code: str
    message: str
    shard_ids: list[str] = []


class StagingOk(Reply, tag="staging_ok"):
    """Which copy path the job's rank uses: "daemon", or "rank" with the fallback reason."""

    path: str
    reason: str = ""
    readahead_slots: int = 0  # read-ahead slots the daemon took (0: it stages on demand only)


class Staged(Reply, tag="staged"):
    """A stage_in's reply on a session with read-ahead slots: the slot that holds the shard
    (the one named, or a read-ahead slot) and the version copied; outcome hit|miss|stale."""

    slot: int
    version: int
    outcome: str = ""


AnyReply = HelloOk | Placed | Ok | StatsOk | ErrorReply | StagingOk | Staged

DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)
"""What decoding a hostile payload may raise (msgspec reports bad UTF-8 in a str as
UnicodeDecodeError, not DecodeError); anything else is a bug."""

_request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(AnyRequest)
reply_decoder = msgspec.msgpack.Decoder(AnyReply)


class _Envelope(msgspec.Struct, array_like=True):
    """The first two fields every message starts with; later fields are ignored."""

    tag: str
    rid: int


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def peek_rid(payload: bytes | memoryview) -> int:
    """The request id of a frame that does not decode as a whole (0 when even that fails),
    so the reply to a bad request reaches the caller that is waiting for it."""
    try:
        return _envelope_decoder.decode(payload).rid
    except DECODE_ERRORS:
        return 0


def decode_reply(payload: bytes | memoryview) -> Reply:
    """Decode a reply; one that does not decode (say an unknown tag from a newer daemon)
    becomes an ErrorReply for its request id, so it fails one request, not the connection."""
    try:
        return reply_decoder.decode(payload)
    except DECODE_ERRORS as exc:
        return ErrorReply(peek_rid(payload), ErrorCode.BAD_FRAME.value,
                          f"cannot decode the daemon's reply ({exc}); install matching "
                          "offloadd versions on clients and daemon")


def encode_frame(message: msgspec.Struct) -> bytes:
    """Serialise one message with its length prefix."""
    payload = _request_encoder.encode(message)
    return HEADER.pack(len(payload)) + payload


def check_length(nbytes: int) -> None:
    """Reject a length prefix the daemon will never read (raises ValueError)."""
    if nbytes > MAX_FRAME_NBYTES:
        raise ValueError(f"frame of {nbytes} bytes exceeds the {MAX_FRAME_NBYTES}-byte limit")


def check_ids(ids: list[str], *lists: list | None) -> None:
    """Batched requests carry parallel lists; they must be the same length.

    Raises InvalidRequestError (a ValueError), so the daemon answers ``invalid``, not
    ``internal``.
    """
    for other in lists:
        if other is not None and len(other) != len(ids):
            raise InvalidRequestError(
                f"{len(ids)} ids but a parallel list of {len(other)} entries")
