"""What both clients send and read besides the protocol's own frames: dtype tags, the
bytes of what is put, and replies turned into typed errors.

The lowest layer of the client package: it imports only :mod:`offloadd.protocol` and
:mod:`offloadd.errors`, and every other client module may import it. Frames themselves
are ``offloadd.protocol.encode_frame``, the daemon's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from offloadd import protocol as p
from offloadd.errors import ReplyTimeoutError, error_from_code

TAG_TORCH_DTYPES = p.torch_dtypes()  # the daemon's own tag -> torch dtype table
TORCH_DTYPE_TAGS = {dtype: tag for tag, dtype in TAG_TORCH_DTYPES.items()}


def as_bytes(data: Any) -> tuple[memoryview, str]:
    """A flat byte view of ``data`` (bytes-like, numpy array or CPU tensor) and its dtype tag."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"put() needs a CPU tensor, got one on {data.device}")
        tag = TORCH_DTYPE_TAGS.get(data.dtype)
        if tag is None:
            raise ValueError(f"unsupported tensor dtype {data.dtype}; use one of {p.DTYPES}")
        flat = data.detach().contiguous().reshape(-1).view(torch.uint8)
        return flat.numpy().data, tag
    if isinstance(data, np.ndarray):
        tag = str(data.dtype) if str(data.dtype) in p.DTYPES else "uint8"
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data, tag
    view = memoryview(data)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view, "uint8"


def as_list(ids: str | Iterable[str]) -> list[str]:
    return [ids] if isinstance(ids, str) else list(ids)


def check_reply(reply: p.Reply) -> p.Reply:
    """``reply`` itself, or the typed error an ErrorReply stands for, raised."""
    if isinstance(reply, p.ErrorReply):
        raise error_from_code(reply.code, reply.message, reply.shard_ids)
    return reply


def reply_timeout_error(reply_timeout_s: float | None) -> ReplyTimeoutError:
    return ReplyTimeoutError(
        f"no reply from offloadd within {reply_timeout_s} s (reply_timeout_s); the daemon may "
        "be stopped or overloaded (`offloadd status`); the client is closed")
