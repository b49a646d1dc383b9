"""DeepSpeed's own CIFAR-10 tutorial runs on offloadd unchanged
(``tests/scripts/ds_tutorial_cifar.py``), launched as DeepSpeed's launcher does it
(``python -m trainer.deepspeed --num_gpus 2``: the facade is ``deepspeed`` in every rank,
``--local_rank`` passed): its ``from deepspeed.accelerator import get_accelerator``,
``add_config_arguments``, ``initialize(..., training_data=)`` with the loader it returns,
``model_engine.local_rank``, ``bfloat16_enabled()``/``fp16_enabled()`` and its config as
written (``"cpu_offload": false`` among DeepSpeed's deprecated keys). Before: no launcher,
``ModuleNotFoundError`` with ``import trainer as deepspeed``; the facade lacked
``add_config_arguments`` and the engine's attributes, and the config was refused.

2 torchrun ranks on the strict device twin, ZeRO-3 in fp32, against the same steps in
plain torch (AdamW with decoupled weight decay, which DeepSpeed's ``"Adam"`` is; WarmupLR's
log warm-up; clipping at 1.0; each step's global batch is the two ranks' shards of
``DistributedSampler``): rank 0's losses and the final weights, read back with
``deepspeed.utils.zero_to_fp32``. The tutorial's default dtype (fp16, dynamic loss
scaling) runs too, at stage 2, close to the fp32 reference.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import free_port, max_relative_error
from torch.utils.data import DistributedSampler

from trainer.state.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

SCRIPTS = Path(__file__).parent / "scripts"
EPOCHS, RANKS, MICRO = 2, 2, 8


def _cifar() -> Any:
    spec = importlib.util.spec_from_file_location("_cifar_net", SCRIPTS / "_cifar_net.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The tutorial's steps in plain torch: rank 0's loss at each step, the final weights."""
    cifar = _cifar()
    trainset, _ = cifar.datasets()
    torch.manual_seed(0)
    net = cifar.Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.0, betas=(0.8, 0.999), eps=1e-8,
                                  weight_decay=3e-7)
    shards = [list(DistributedSampler(trainset, num_replicas=RANKS, rank=rank))
              for rank in range(RANKS)]
    images, labels = trainset.tensors
    losses, step = [], 0
    for _epoch in range(EPOCHS):  # the sampler's order, the same each epoch (no set_epoch)
        for start in range(0, len(shards[0]), MICRO):
            rank_losses = [torch.nn.functional.cross_entropy(
                net(images[shard[start:start + MICRO]]), labels[shard[start:start + MICRO]])
                for shard in shards]
            (sum(rank_losses) / RANKS).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            # DeepSpeed's WarmupLR: warmup_min_lr before its first step(), then the log
            # warm-up from the iteration step() counted (0 at the first)
            for group in optimizer.param_groups:
                group["lr"] = 0.001 * math.log(max(step, 1)) / math.log(1000)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(rank_losses[0].item())
            step += 1
    return losses, net.state_dict()


def run(out: Path, stage: int, dtype: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "trainer.deepspeed", "--num_gpus", str(RANKS),
               "--master_port", str(free_port()), str(SCRIPTS / "ds_tutorial_cifar.py"),
               "--stage", str(stage), "--dtype", dtype, "--out", str(out)]
    with open(out / "launch.log", "wb") as log:
        code = subprocess.call(command, stdout=log, stderr=log, cwd=out, timeout=280, env={
            **os.environ, "PYTHONPATH": str(SCRIPTS.parent.parent), "OMP_NUM_THREADS": "1"})
    assert code == 0, (out / "launch.log").read_text(errors="replace")[-4000:]
    losses = json.loads((out / "losses.json").read_text())["losses"]
    return losses, get_fp32_state_dict_from_zero_checkpoint(out / "ckpt")


def test_deepspeeds_cifar_tutorial_runs_unchanged_and_trains_as_torch(tmp_path: Path) -> None:
    expected_losses, expected = reference()
    assert len(expected_losses) == EPOCHS * 64 // (RANKS * MICRO)
    losses, weights = run(tmp_path / "fp32", 3, "fp32")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses),
                               rtol=1e-5, atol=0)
    assert set(weights) == set(expected)
    assert max_relative_error(weights, expected) < 1e-5

    # fp16 forward/backward against the fp32 reference: Adam turns their rounding into
    # steps of up to lr, so the weights are held to the update's direction and size
    losses, weights = run(tmp_path / "fp16", 2, "fp16")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses),
                               rtol=1e-2, atol=0)
    cifar = _cifar()
    torch.manual_seed(0)
    initial = cifar.Net().state_dict()
    names = sorted(expected)
    ours = torch.cat([(weights[name] - initial[name]).flatten() for name in names])
    theirs = torch.cat([(expected[name] - initial[name]).flatten() for name in names])
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    assert (ours - theirs).abs().max() < theirs.abs().max()


def test_the_launcher_refuses_what_it_cannot_do(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.integrations.ds_launch import parse

    for argv in (["--num_nodes", "2", "train.py"], ["--hostfile", "hosts", "--num_nodes", "2",
                                                   "train.py"], ["--num_gpus", "0", "train.py"]):
        with pytest.raises(SystemExit):
            parse(argv)
    assert "one node only" in capsys.readouterr().err
    args = parse(["--num_gpus", "2", "--no_local_rank", "train.py", "--lr", "3", "--x"])
    assert (args.num_gpus, args.no_local_rank, args.user_script) == (2, True, "train.py")
    assert args.user_args == ["--lr", "3", "--x"]
