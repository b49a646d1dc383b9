"""The suite's rank harness (``tests/_dist.py``): a rank that fails inside ``shared_daemon``
while its peer waits in a collective is reported at once, with its traceback. Before, the
failing rank waited at the closing barrier, the peer in its collective, and the test ran to
``run_ranks``' time-out with no error to read (seen once in a suite beside two burners)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks, shared_daemon


def fail_on_rank_1(rank: int, world: int) -> str:
    with shared_daemon(rank, None):
        if rank == 1:
            raise RuntimeError("rank 1 fails mid-step")
        dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes
    return "done"


def test_a_failing_rank_is_reported_at_once_not_at_the_time_out() -> None:
    # a hang ends in run_ranks' TimeoutError (no rank's error), which this does not match
    with pytest.raises(RuntimeError, match="rank 1 fails mid-step"):
        run_ranks(fail_on_rank_1, 2, timeout_s=120)
