"""``trainer.init_distributed`` and ``initialize``'s process-group setup (DeepSpeed issue 14,
defect 4): under torchrun with one process ``dist.get_rank()`` works after ``initialize``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
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
    for name in trainer.dist.distributed.LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    trainer.init_distributed()
    trainer.init_distributed()  # a second call is a no-op, as in DeepSpeed
    return dist.get_rank(), dist.get_world_size()


def test_initialize_sets_up_torch_distributed_under_torchrun() -> None:
    assert run_ranks(one_process_under_torchrun, 1) == [(True, 0, 1, "gloo")]


def test_init_distributed_without_a_launcher_is_a_world_of_one() -> None:
    assert run_ranks(plain_process, 1) == [(0, 1)]


EXIT_PROBE = """
import atexit, os, sys
import torch.distributed as dist
import trainer
for name in trainer.dist.distributed.LAUNCH_VARIABLES:
    os.environ.pop(name, None)
# Registered first, so it runs last: after every exit handler the engine's package added.
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
if sys.argv[1] == "ours":
    trainer.init_distributed()
else:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
engine, _, _, _ = trainer.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
engine.close()
"""


@pytest.mark.parametrize(("creator", "destroyed"), [("ours", True), ("script", False)])
def test_a_group_init_distributed_created_is_destroyed_at_exit(creator: str,
                                                               destroyed: bool) -> None:
    """NCCL warns at every exit whose group was never destroyed: the group
    ``init_distributed`` created is destroyed at exit; a group the script made is its own."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import torch\n" + EXIT_PROBE, creator],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"initialized at exit: {not destroyed}" in done.stdout, done.stdout


def test_init_distributed_refuses_a_world_without_rendezvous(monkeypatch: Any) -> None:
    for name in trainer.dist.distributed.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(ValueError, match="torchrun variables"):
        trainer.init_distributed(world_size=4)


class WideNet(torch.nn.Module):
    """Two wide blocks: one rank's partition of a block fills most of a small arena."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.blocks(features).square().mean()


def initialize_in_a_full_arena(rank: int, world: int) -> tuple[str, str]:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              # 131k elements x 20 B = 2.6 MB per rank and block: the arena holds one.
              "offloadd": {"arena_size": 4 << 20}}
    try:
        engine, _, _, _ = trainer.initialize(model=WideNet(), config=config)
    except Exception as error:  # the outcome is the result under test
        return type(error).__name__, str(error)
    engine.close()
    return "", ""


def test_a_rank_failing_in_initialize_fails_its_peers_instead_of_hanging() -> None:
    # Without the agreement the failed rank waits in the daemon shutdown barrier (60 s) while
    # its peer waits in the next broadcast: a hang for the length of that timeout.
    outcomes = run_ranks(initialize_in_a_full_arena, 2, timeout_s=45)
    kinds = [kind for kind, _ in outcomes]
    assert all(kinds), outcomes  # every rank raised; none is left in a collective
    if "PeerSetupError" in kinds:
        text = outcomes[kinds.index("PeerSetupError")][1]
        assert "failed while registering unit" in text


def engines_one_after_another(rank: int, world: int, offload: str) -> dict[str, Any]:
    from _dist import make_batch, shared_daemon

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    groups = dist.distributed_c10d._world.pg_map
    counts = []
    with shared_daemon(rank, enabled=offload != "none") as socket_path:
        zero: dict[str, Any] = {"stage": 3}
        if offload != "none":
            zero["offload_optimizer"] = zero["offload_param"] = {"device": offload}
        for index in range(4):
            config = base_config(zero_optimization=zero)
            if socket_path:
                config["offloadd"] = {"socket": socket_path, "job": f"e{index}",
                                      "arena_size": 8 << 20}
            engine, _, _, _ = trainer.initialize(model=make_model(index), config=config)
            engine.backward(engine(*make_batch(0, 0, rank, 4)))
            engine.step()
            engine.close()
            del engine  # the engine lives on in reference cycles: no gc.collect() here
            counts.append((open_fds(), len(groups)))
    late = trainer.initialize(model=make_model(), config=base_config(
        zero_optimization={"stage": 3}))[0]
    dist.destroy_process_group()  # a script that tears the world down first
    late.close()
    return {"counts": counts}


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_closed_engines_leave_no_process_group_behind(offload: str) -> None:
    """Stage 3 reduces on a process group of its own; each holds fds (gloo: 5, NCCL: a
    communicator), so a process that builds engine after engine (a sweep, a notebook,
    a long-lived rank) ran out of fds. ``close`` destroys it, also after the world."""
    for result in run_ranks(engines_one_after_another, 2, offload):
        counts = result["counts"]
        assert counts == [counts[0]] * len(counts), counts
