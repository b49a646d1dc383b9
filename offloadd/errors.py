"""Typed errors shared by the daemon and its clients.

Every failure that crosses the socket is an :class:`ErrorCode` plus a message
that says what to change. The client turns a reply back into the matching
exception class, so callers catch ``UnknownShardError`` rather than parsing
strings.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    BAD_FRAME = "bad_frame"  # the bytes did not decode as a request
    VERSION_MISMATCH = "version_mismatch"  # client and daemon speak different protocol versions
    NO_SESSION = "no_session"  # a request came before hello
    PERMISSION = "permission"  # peer uid not allowed, or a shard of another job
    UNKNOWN_SHARD = "unknown_shard"  # no shard with that id for this job and rank
    EXISTS = "exists"  # alloc of an id that already exists with another size or dtype
    OVER_BUDGET = "over_budget"  # the request can never fit in the arena or swap budget
    LEASE_CONFLICT = "lease_conflict"  # writer vs reader on the same shard
    NOT_LEASED = "not_leased"  # release of a shard this session does not hold
    INVALID = "invalid"  # a well-formed request with a bad argument
    IO_ERROR = "io_error"  # reading or writing the swap tier failed
    CHECKSUM = "checksum"  # a swapped block did not match its checksum
    NO_SWAP = "no_swap"  # persistence asked of a daemon without --swap-dir
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping
    LIMIT = "limit"  # a per-client limit of the daemon config (offloadd.service.limits) was reached
    QUARANTINED = "quarantined"  # the job's swap state could not be recovered; see status
    TORN = "torn"  # the shard's last write lease ended by an error; write it again
    SLOT_BUSY = "slot_busy"  # a staging slot reused before the rank's consumer event
    INTERNAL = "internal"  # a daemon bug; the session survives


class OffloadError(Exception):
    """Base class of every error the daemon reports."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, shard_ids: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.shard_ids = list(shard_ids or [])


class BadFrameError(OffloadError):
    code = ErrorCode.BAD_FRAME


class VersionMismatchError(OffloadError):
    code = ErrorCode.VERSION_MISMATCH


class NoSessionError(OffloadError):
    code = ErrorCode.NO_SESSION


class PermissionDeniedError(OffloadError):
    code = ErrorCode.PERMISSION


class UnknownShardError(OffloadError, KeyError):
    code = ErrorCode.UNKNOWN_SHARD

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class ShardExistsError(OffloadError):
    code = ErrorCode.EXISTS


class OverBudgetError(OffloadError):
    code = ErrorCode.OVER_BUDGET


class LeaseConflictError(OffloadError):
    code = ErrorCode.LEASE_CONFLICT


class NotLeasedError(OffloadError):
    code = ErrorCode.NOT_LEASED


class InvalidRequestError(OffloadError, ValueError):
    code = ErrorCode.INVALID


class SwapIOError(OffloadError):
    code = ErrorCode.IO_ERROR


class ChecksumError(OffloadError):
    code = ErrorCode.CHECKSUM


class TornShardError(OffloadError):
    code = ErrorCode.TORN


class NoSwapError(OffloadError):
    code = ErrorCode.NO_SWAP


class ShuttingDownError(OffloadError):
    code = ErrorCode.SHUTTING_DOWN


class InternalError(OffloadError):
    code = ErrorCode.INTERNAL


class LimitExceededError(OffloadError):
    """A per-client limit was reached; the message names the config key that sets it."""

    code = ErrorCode.LIMIT


class JobQuarantinedError(OffloadError):
    """The job's manifest could not be recovered; its swap files are kept untouched."""

    code = ErrorCode.QUARANTINED


class SlotBusyError(OffloadError):
    """A device staging slot was reused before its last use finished
    (offloadd.service.device_copies): send slot_done after consuming a staged slot, and wait
    for a stage_out's reply."""

    code = ErrorCode.SLOT_BUSY


class DaemonUnavailableError(OffloadError, ConnectionError):
    """Raised on the client side when the daemon cannot be reached or went away."""

    code = ErrorCode.INTERNAL


class ReplyTimeoutError(OffloadError, TimeoutError):
    """Raised on the client side when no reply came within ``reply_timeout_s``; the client
    closes its connection (a late reply would arrive out of step)."""

    code = ErrorCode.INTERNAL


class UntrustedDaemonError(PermissionDeniedError):
    """Raised on the client side, before anything is sent, when the process listening on
    the socket runs as a uid the client does not trust as the daemon's (socket squatting)."""


ERROR_CLASSES: dict[ErrorCode, type[OffloadError]] = {
    cls.code: cls
    for cls in (
        BadFrameError,
        VersionMismatchError,
        NoSessionError,
        PermissionDeniedError,
        UnknownShardError,
        ShardExistsError,
        OverBudgetError,
        LeaseConflictError,
        NotLeasedError,
        InvalidRequestError,
        SwapIOError,
        ChecksumError,
        TornShardError,
        NoSwapError,
        ShuttingDownError,
        InternalError,
        LimitExceededError,
        JobQuarantinedError,
        SlotBusyError,
    )
}


def error_from_code(code: str, message: str, shard_ids: list[str]) -> OffloadError:
    """Rebuild the typed exception for an error reply (unknown codes become InternalError)."""
    try:
        cls = ERROR_CLASSES[ErrorCode(code)]
    except ValueError:
        cls = InternalError
    return cls(message, shard_ids)
