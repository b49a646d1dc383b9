"""``init_distributed()``: join (or create) the torch.distributed process group, as
``deepspeed.init_distributed()`` does.

Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set) the group
is joined through ``env://``, whatever the world size, so ``dist.get_rank()`` works
after ``initialize`` even with one process. A plain single process with no launcher
variables gets a world-of-one group on an in-memory store (no port to collide on).
A group created here is destroyed at the interpreter's exit (NCCL warns at every exit
otherwise, and DeepSpeed-style scripts never call ``destroy_process_group``); a group the
script created itself is left to it.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    """nccl when CUDA is usable, else gloo (CPU)."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(dist_backend: str | None = None, *, init_method: str | None = None,
                     timeout: timedelta | None = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise torch.distributed unless it already is (DeepSpeed's signature, trimmed).

    ``dist_backend`` defaults to nccl on CUDA, else gloo. Without ``init_method``, the
    torchrun variables select ``env://``; without them this process is a world of one.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; "
                           "install a torch with distributed support")
    if dist.is_initialized():
        return
    backend = dist_backend or default_backend()
    if init_method is not None or all(name in os.environ for name in LAUNCH_VARIABLES):
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, timeout=timeout)
    elif world_size > 1:
        raise ValueError(f"init_distributed(world_size={world_size}) needs the torchrun "
                         f"variables {', '.join(LAUNCH_VARIABLES)} or an init_method")
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    atexit.register(_destroy_at_exit, dist.group.WORLD)


def _destroy_at_exit(group: object) -> None:
    """Destroy the group ``init_distributed`` created, if it is still the live one (no
    collective: the peers may have exited already)."""
    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()
