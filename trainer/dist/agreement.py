"""Setup steps that every rank finishes together, or none does.

A rank that fails half-way through engine setup (its daemon arena is full, a
shard allocation is refused) must not leave its peers waiting in the next
collective of a loop it has left: they would hang until the process-group
timeout. ``agree`` runs one step, then all-reduces a failure flag, so every
rank raises — the failing one its own error, the others one naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trainer.dist.collectives import Collectives


class PeerSetupError(RuntimeError):
    """Another rank failed during a setup step this rank completed."""


@contextmanager
def agree(collectives: Collectives, what: str) -> Iterator[None]:
    """Run the body on every rank; if it raised on any rank, raise on every rank."""
    failure: BaseException | None = None
    try:
        yield
    except BaseException as error:  # reported to the peers, then re-raised below
        failure = error
    if collectives.world_size > 1:
        # On the data-parallel group: a device tensor (NCCL refuses host ones).
        flag = torch.tensor([1 if failure is not None else 0], dtype=torch.int32,
                            device=collectives.device)
        collectives.all_reduce(flag)
        if int(flag) and failure is None:
            reports = collectives.all_gather_object(None)
            failed = {rank: text for rank, text in enumerate(reports) if text is not None}
            raise PeerSetupError(f"rank(s) {sorted(failed)} failed while {what}: "
                                 + "; ".join(failed.values()))
        if int(flag):
            collectives.all_gather_object(f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
