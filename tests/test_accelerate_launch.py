"""``accelerate launch`` of a DeepSpeed config, as Accelerate's guide runs DeepSpeed
(``--config_file`` naming ``distributed_type: DEEPSPEED`` and a ``deepspeed_config_file``),
through ``python -m trainer.hf launch``: its launcher looked for DeepSpeed before starting
torchrun (``ImportError: DeepSpeed is not installed``) and then read
``deepspeed.launcher.runner``. A script with no DeepSpeed in it
(``tests/scripts/accelerate_launch_run.py``) trains on offloadd's ZeRO-3 on 2 processes,
its losses those of the same steps in plain torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="the hf extra is not installed")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


def reference() -> list[float]:
    """Rank 0's loss at each step: accelerate gives batch 2k to rank 0 and 2k+1 to rank 1,
    and each step averages the two ranks' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    features, labels = torch.randn(32, 8, generator=generator), torch.randint(
        0, 3, (32,), generator=generator)
    losses = []
    for start in range(0, 32, 8):
        rank_losses = [torch.nn.functional.cross_entropy(
            model(features[first:first + 4]), labels[first:first + 4])
            for first in (start, start + 4)]
        (sum(rank_losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(rank_losses[0].item())
    return losses


def test_accelerate_launch_of_a_deepspeed_config_trains_on_offloadd(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "cpu"}}}))
    (tmp_path / "cfg.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n"
        "  zero3_init_flag: true\nmachine_rank: 0\nnum_machines: 1\nnum_processes: 2\n"
        "rdzv_backend: static\nsame_network: true\nmain_process_port: 0\nuse_cpu: false\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{SCRIPTS}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "trainer.hf", "launch", "--config_file", str(tmp_path / "cfg.yaml"),
         str(SCRIPTS / "accelerate_launch_run.py"), "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["distributed_type"] == "DistributedType.DEEPSPEED"
    assert result["num_processes"] == 2 and result["stage"] == 3
    assert result["engine"] == "trainer.integrations.ds_facade.DeepSpeedEngine"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference()),
                               rtol=1e-5, atol=0)
