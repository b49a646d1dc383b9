"""How a torchrun test script's ranks end: together, and the reference without teardown."""

from __future__ import annotations

import os
import sys

import torch


def leave_group(*, skip_teardown: bool) -> None:
    """Leave the process group together; with ``skip_teardown``, exit 0 at once.

    A rank exiting while gloo's threads still run aborts ("terminate called without an
    active exception"), seen under load in DDP runs, so the ranks meet at a barrier and
    destroy the group first. The DDP references still aborted at interpreter teardown
    under load, after their results were written (the wrapped module keeps the group
    alive until then): with ``skip_teardown`` (no daemon to stop) the process leaves
    without running C++ static destructors.
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if skip_teardown:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
