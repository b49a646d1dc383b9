"""The control protocol: message types and framing, defined once for both sides.

A frame is a 4-byte little-endian payload length followed by a msgpack
payload encoding one tagged struct. Requests carry a request id (``rid``)
that the reply echoes, so an asynchronous client can keep many requests in
flight. Bulk data never crosses the socket: shards live in the shared arena
and the replies carry arena offsets.
"""

from __future__ import annotations

import functools
import os
import pwd
import socket
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import msgspec

from offloadd.errors import ErrorCode, InvalidRequestError, UntrustedDaemonError

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 2
HEADER = struct.Struct("<I")
HEADER_NBYTES = HEADER.size
MAX_FRAME_NBYTES = 16 << 20
"""Largest accepted payload; a longer length prefix is a bad frame and closes the connection."""

Mode = Literal["r", "w"]
JOB_SECRET_ENV = "OFFLOADD_JOB_SECRET"
"""Environment variable the client reads the job secret from (set by the launcher)."""
ROOT_UID = 0
DAEMON_UID_ENV = "OFFLOADD_DAEMON_UID"
"""The uid (or user name) the node daemon runs as, for clients that check the socket."""
DAEMON_USER = "offloadd"
"""The system user deploy/ runs the daemon as; trusted where it exists."""
_PEERCRED = struct.Struct("3i")
DTYPE_ITEMSIZE = {"uint8": 1, "int8": 1, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
                  "float32": 4, "float64": 8}
"""Element dtypes a shard may carry (torch's names), with their sizes in bytes."""
DTYPES = tuple(DTYPE_ITEMSIZE)
"""Dtype tags a shard may carry; the tag only describes the bytes, the daemon never converts."""


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Shard dtype tag -> torch dtype, shared by the daemon's optimizer and the client.

    Imports torch on first call only: the daemon does so only where its native module is
    not built, at its first optimizer step."""
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
    job_secret: str = ""  # offloadd.service.auth: must match the secret of the job's first hello


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


StepUndo = Literal["none", "keep", "commit", "redo", "revert"]
"""A speculative optimizer step's part (``OptimizerStep.undo``), in the order a rank sends
them: ``keep`` steps out of place, writing the stepped master and moments into
``{unit}.next.*`` (and the parameter) and leaving the state as it was; then exactly one of
``commit`` (the step stands: the state adopts ``{unit}.next.*``'s bytes, no copy),
``redo`` (step the state again, in place, with this request's arguments) or ``revert``
(no step: the parameter is rewritten from the master). The last two drop
``{unit}.next.*``."""


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
    drop_grad: bool = False
    """Forget ``{unit}.grad`` once the step has consumed it (the rank's next gradient
    window re-creates it): dead gradient bytes are then never written back or read in."""
    undo: StepUndo = "none"
    """Part of a speculative step (``StepUndo``); the daemon runs a unit's requests in the
    order they came, so a rank sends ``commit``/``redo``/``revert`` without waiting."""


class StagingOpen(Request, tag="staging_open"):
    """Ask for daemon-driven device copies (offloadd.service.device_copies): the rank's staging
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
    """A stage_in's reply, sent when the copy is issued: the slot that holds the shard (the
    one named, or a read-ahead slot), the version copied, the read-ahead's outcome
    (hit|miss|stale; "" without read-ahead slots), and the slot's fill sequence number:
    the rank waits at use for the slot's "filled" event of that number."""

    slot: int
    version: int
    outcome: str = ""
    seq: int = 0


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


# -- who listens: a client checks the daemon before it sends anything ------------------------
#
# A socket path in a world-writable dir can be taken by anyone first; the listener's uid,
# which the kernel reports (SO_PEERCRED), cannot be forged. A hello carries the job secret.


def socket_peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process on the other end of a connected unix socket."""
    pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def expected_daemon_uid(daemon_uid: int | str | None = None) -> int:
    """The daemon's uid: ``daemon_uid`` (a uid or a user name), else $OFFLOADD_DAEMON_UID,
    else the ``offloadd`` system user where one exists, else root."""
    value = daemon_uid if daemon_uid is not None else os.environ.get(DAEMON_UID_ENV) or None
    if value is None:
        try:
            return pwd.getpwnam(DAEMON_USER).pw_uid
        except KeyError:
            return ROOT_UID
    if isinstance(value, int) or value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid
    except KeyError:
        raise ValueError(f"daemon uid {value!r} ({DAEMON_UID_ENV} or daemon_uid) is neither "
                         "a number nor a user on this host") from None


def check_daemon_peer(sock: socket.socket, socket_path: str,
                      daemon_uid: int | str | None = None) -> None:
    """Raise UntrustedDaemonError unless the listener runs as root, as this process's own
    uid (a private daemon), or as the expected daemon uid (``expected_daemon_uid``)."""
    pid, uid = socket_peer(sock)
    expected = expected_daemon_uid(daemon_uid)
    if uid in (ROOT_UID, os.geteuid(), expected):
        return
    raise UntrustedDaemonError(
        f"the process listening on {socket_path} (pid {pid}) runs as uid {uid}, not as the "
        f"daemon's uid {expected}; it may have taken the socket before the daemon, so "
        f"nothing was sent to it. Connect to the daemon's --socket, or set {DAEMON_UID_ENV} "
        "(or daemon_uid=) to the uid offloadd runs as")


# -- the twin's staging layout ------------------------------------------------------------
# Daemon copies on the CPU twin share a staging memfd between a rank and the daemon; both
# sides read and write its event words, so its layout is part of the contract.

TWIN_EVENT_TIMEOUT_S = 60.0
"""How long a twin stream waits for the other side's event before failing the copy (the
other process died, or never records it)."""
TWIN_FAILED = 1 << 63
"""Set in a slot's "filled" word when the copy of that sequence number failed."""


def twin_events_offset(num_slots: int, slot_nbytes: int) -> int:
    """Where the twin staging memfd's events area starts (after the slots, 64-aligned)."""
    return -(-num_slots * slot_nbytes // 64) * 64


def twin_staging_nbytes(num_slots: int, slot_nbytes: int) -> int:
    """Size of a twin staging memfd: the slots, then per slot two 64-bit event words."""
    return twin_events_offset(num_slots, slot_nbytes) + 16 * num_slots


class TwinEventTimeout(RuntimeError):
    """A twin stream waited ``TWIN_EVENT_TIMEOUT_S`` for the other process's event."""


class TwinEvents:
    """The twin's interprocess events of one staging memfd: per slot the rank's "consumed"
    count (words ``2 * slot``) and the daemon's "filled" sequence number (``2 * slot + 1``).

    Hazard (torn words): each word is written by one side only, as one aligned 8-byte
    store (a memoryview item), which x86-64 makes atomic; the slot bytes are written
    before the word that publishes them (stores are not reordered there either)."""

    def __init__(self, buffer: memoryview, num_slots: int, slot_nbytes: int) -> None:
        start = twin_events_offset(num_slots, slot_nbytes)
        self.words = buffer[start : start + 16 * num_slots].cast("Q")

    def consumed(self, slot: int) -> int:
        return int(self.words[2 * slot])

    def record_consumed(self, slot: int) -> None:
        self.words[2 * slot] += 1

    def filled(self, slot: int) -> int:
        return int(self.words[2 * slot + 1])

    def record_filled(self, slot: int, seq: int, failed: bool = False) -> None:
        self.words[2 * slot + 1] = seq | (TWIN_FAILED if failed else 0)

    def wait(self, index: int, target: int, what: str,
             abandoned: Callable[[], bool] = lambda: False) -> int:
        """Block until word ``index`` reaches ``target`` (the failed bit aside); returns the
        word. Polls with a growing pause: a twin, not a hot path."""
        deadline = time.monotonic() + TWIN_EVENT_TIMEOUT_S
        pause_s = 1e-6
        while (word := int(self.words[index])) & ~TWIN_FAILED < target:
            if abandoned():
                raise TwinEventTimeout(f"{what}: the other side went away")
            if time.monotonic() > deadline:
                raise TwinEventTimeout(f"{what}: no event after {TWIN_EVENT_TIMEOUT_S} s")
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 1e-3)
        return word

    def release(self) -> None:
        self.words.release()
