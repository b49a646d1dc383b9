"""``trainer.init_distributed`` and ``initialize``'s process-group setup (DeepSpeed issue 14,
defect 4): under torchrun with one process ``dist.get_rank()`` works after ``initialize``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch.distributed as dist
from _dist import base_config, make_model, run_ranks

import trainer


def one_process_under_torchrun(rank: int, world: int) -> tuple[Any, ...]:
    assert os.environ["WORLD_SIZE"] == "1" and not dist.is_initialized()
    model = make_model()
    engine, _, _, _ = trainer.initialize(model=model, config=base_config())
    try:
        return dist.is_initialized(), dist.get_rank(), dist.get_world_size(), dist.get_backend()
    finally:
        engine.close()


def plain_process(rank: int, world: int) -> tuple[Any, ...]:
    for name in trainer.distributed.LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    trainer.init_distributed()
    trainer.init_distributed()  # a second call is a no-op, as in DeepSpeed
    return dist.get_rank(), dist.get_world_size()


def test_initialize_sets_up_torch_distributed_under_torchrun() -> None:
    assert run_ranks(one_process_under_torchrun, 1) == [(True, 0, 1, "gloo")]


def test_init_distributed_without_a_launcher_is_a_world_of_one() -> None:
    assert run_ranks(plain_process, 1) == [(0, 1)]


def test_init_distributed_refuses_a_world_without_rendezvous(monkeypatch: Any) -> None:
    for name in trainer.distributed.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(ValueError, match="torchrun variables"):
        trainer.init_distributed(world_size=4)
