"""The DeepSpeed-style script ``tests/scripts/ds_train_gpt.py`` runs unchanged under the
real DeepSpeed (CPU accelerator, gloo) and under ``import trainer as deepspeed``: same
config file (ZeRO-3, optimizer and parameters offloaded to CPU, torch AdamW), same
losses and final parameters, checkpoint save/load included.

Skipped without deepspeed (it is not a project dependency; ``DS_BUILD_OPS=0 pip install
deepspeed`` works on CPU; its first run JIT-builds a small comm op, ~4 min on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_multinode import launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)"),
]

STEPS = 4


def config() -> dict[str, Any]:
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            # torch_adam: DeepSpeed's own CPUAdam would need a JIT build of its C++ op.
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.01,
                                                      "torch_adam": True}},
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}}}


def run_script(tmp_path: Path, engine: str) -> dict[str, Any]:
    workdir = tmp_path / engine
    workdir.mkdir()
    config_path = workdir / "ds_config.json"
    config_path.write_text(json.dumps(config()))
    out = workdir / "result.pt"
    launch(workdir, ["--engine", engine, "--deepspeed", "--deepspeed_config",
                     str(config_path), "--steps", str(STEPS), "--save-at", "2", "--out",
                     str(out), "--checkpoint-dir", str(workdir / "checkpoints")],
           env={"DS_ACCELERATOR": "cpu"})
    return torch.load(out, weights_only=True)


def test_the_same_script_matches_deepspeed(tmp_path: Path) -> None:
    ours = run_script(tmp_path, "trainer")
    theirs = run_script(tmp_path, "deepspeed")
    assert ours["batch"] == theirs["batch"] == 4
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
    assert set(ours["state"]) == set(theirs["state"])
    for name, value in theirs["state"].items():
        torch.testing.assert_close(ours["state"][name], value, rtol=1e-5, atol=1e-6)
