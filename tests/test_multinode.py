"""Two "nodes" on one machine: two ``torchrun --nnodes 2 --nproc-per-node 2`` agents, each
node with its own private daemon (ZeRO-3, optimizer and parameters offloaded to NVMe),
run the DeepSpeed-style script ``tests/scripts/ds_train_gpt.py`` unchanged through
``import trainer as deepspeed``; losses and final parameters match single-process
torch AdamW on the same global batches."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _dist import free_port, max_relative_error

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ds_train_gpt.py"
ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
LR = 3e-3


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ds_train_gpt", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ds_config(nvme_path: Path) -> dict[str, Any]:
    offload = {"device": "nvme", "nvme_path": str(nvme_path)}
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_optimizer": offload,
                                  "offload_param": offload}}


def launch(tmp_path: Path, script_args: list[str], *, nnodes: int = 1, nproc: int = 2,
           env: dict[str, str] | None = None) -> None:
    """Run SCRIPT under ``nnodes`` torchrun agents (static rendezvous on loopback)."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    agents = []
    for node_rank in range(nnodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                   "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
                   "--master-addr", "127.0.0.1", "--master-port", str(port),
                   str(SCRIPT), *script_args]
        log = open(tmp_path / f"node{node_rank}.log", "wb")  # noqa: SIM115 (closed below)
        agents.append((subprocess.Popen(command, env=full_env, stdout=log, stderr=log), log))
    failures = []
    for node_rank, (agent, log) in enumerate(agents):
        try:
            code = agent.wait(timeout=240)
        except subprocess.TimeoutExpired:
            agent.kill()
            code = agent.wait()
        log.close()
        if code:
            tail = (tmp_path / f"node{node_rank}.log").read_text(errors="replace")[-3000:]
            failures.append(f"node {node_rank} exited {code}:\n{tail}")
    assert not failures, "\n".join(failures)


def reference(script: ModuleType, world: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process torch AdamW on each step's global batch, the gradient taken as data
    parallelism defines it: the mean of each rank's slice's gradient. (One backward over
    all 8 samples is the same math summed in another order; Adam turns that order's last
    bits into 1e-5 of a weight wherever a gradient is near zero.)"""
    model = script.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        slices = script.global_batch(step, 8).chunk(world)
        grads: list[list[torch.Tensor]] = []
        step_losses = []
        for ids in slices:
            model.zero_grad()
            loss = model(ids)
            loss.backward()
            step_losses.append(loss.item())
            grads.append([param.grad.clone() for param in model.parameters()])
        for index, param in enumerate(model.parameters()):
            param.grad = sum(rank_grads[index] for rank_grads in grads) / world
        optimizer.step()
        losses.append(sum(step_losses) / world)
    return losses, {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_two_torchrun_nodes_each_with_a_private_daemon_match_adamw(tmp_path: Path) -> None:
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(ds_config(tmp_path / "nvme")))
    out = tmp_path / "result.pt"
    launch(tmp_path, ["--deepspeed", "--deepspeed_config", str(config_path), "--steps",
                      str(STEPS), "--out", str(out), "--checkpoint-dir",
                      str(tmp_path / "checkpoints")], nnodes=2, nproc=2)
    result = torch.load(out, weights_only=True)
    losses, state = reference(load_script())
    assert result["batch"] == 8
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    assert max_relative_error(result["state"], state) < 1e-5
    # each node's daemon swapped into its own directory under the shared nvme_path, and
    # left nothing there once done (the dirs it created for it go when empty)
    swap_dirs = [Path(path) for path in result["scratch_dirs"]
                 if Path(path).is_relative_to(tmp_path / "nvme")]
    assert sorted(path.parent.name for path in swap_dirs) == ["node0", "node1"]
    deadline = time.monotonic() + 60
    while any(path.exists() for path in swap_dirs):
        assert time.monotonic() < deadline, "the private daemons kept their swap dirs"
        time.sleep(0.2)
    assert not [path for path in (tmp_path / "nvme").rglob("*") if not path.is_dir()]
