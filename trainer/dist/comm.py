"""``deepspeed.comm``'s common calls, so ``import trainer as deepspeed`` scripts can use
``deepspeed.comm.get_rank()`` & co. unchanged: thin wrappers over torch.distributed
that also answer (as a world of one) before any process group exists."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from trainer.dist.distributed import init_distributed

__all__ = ["ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast", "get_local_rank",
           "get_rank", "get_world_size", "init_distributed", "is_initialized"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group: Any = None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group=group)


def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    if get_world_size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    if get_world_size(group) == 1:
        return None
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    if get_world_size(group) == 1:
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
