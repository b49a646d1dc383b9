"""Peak rank memory of loading pretrained weights: about one unit plus one tensor.

A ~100 MB fp32 checkpoint (48 blocks, safetensors) is loaded into a model built
under ``zero.Init`` with ``trainer.load_pretrained`` before ``initialize`` and
after it, each in a fresh process (peak RSS, VmHWM, only grows), params and
optimizer state offloaded to NVMe through a private daemon (its own process).
The comparison is the same model built eagerly and loaded the same way: its
peak holds the whole model. Every build checks one loaded weight against the
file, so a load that skipped the weights would fail rather than look small.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("offloadd.swap.nvme") is None,
                                 reason="the daemon's NVMe tier is not in this tree")]

ROOT = Path(__file__).resolve().parents[1]
WIDTH, DEPTH = 512, 48

MODEL = r'''
import torch

class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))

class Net(torch.nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()
'''

PROBE = MODEL + r'''
import json, sys
import trainer
from trainer.zero import GatheredParameters, Init

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

mode, checkpoint, swap, width, depth = sys.argv[1:6]
width, depth = int(width), int(depth)
torch.set_num_threads(1)
offload = {"device": "nvme", "nvme_path": swap}
config = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_optimizer": offload,
                                "offload_param": offload},
          "units": {"module_classes": ["Block"]}, "offloadd": {"arena_size": 16 << 20}}
base = status("VmRSS:")
if mode == "eager":
    model = Net(width, depth)
else:
    with Init(config_dict_or_path=config):
        model = Net(width, depth)
if mode != "after":
    trainer.load_pretrained(model, checkpoint)
engine, _, _, _ = trainer.initialize(model=model, config=config)
if mode == "after":
    trainer.load_pretrained(engine, checkpoint)
peak = status("VmHWM:") - base
with GatheredParameters(model.blocks[depth - 3].a.weight):
    probe = model.blocks[depth - 3].a.weight.detach()[:4, :4].tolist()
fp32_bytes = sum(slot.numel for unit in engine.units for slot in unit.slots) * 4
engine.close()
print(json.dumps({"peak": peak, "fp32_bytes": fp32_bytes, "probe": probe}))
'''


def _write_checkpoint(directory: Path) -> list[list[float]]:
    from safetensors.torch import save_file

    namespace: dict[str, object] = {}
    exec(MODEL, namespace)  # the probe's own model class
    torch.manual_seed(3)
    model = namespace["Net"](WIDTH, DEPTH)  # type: ignore[operator]
    state = {name: value.contiguous() for name, value in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return state[f"blocks.{DEPTH - 3}.a.weight"][:4, :4].tolist()  # type: ignore[no-any-return]


def _probe(mode: str, checkpoint: Path, swap: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE, mode, str(checkpoint), str(swap),
                           str(WIDTH), str(DEPTH)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_pretrained_load_peak_rss_is_about_one_unit(tmp_path: Path) -> None:
    expected = _write_checkpoint(tmp_path)
    before = _probe("before", tmp_path, tmp_path / "swap-before")
    after = _probe("after", tmp_path, tmp_path / "swap-after")
    eager = _probe("eager", tmp_path, tmp_path / "swap-eager")
    model_bytes = eager["fp32_bytes"]
    assert isinstance(model_bytes, int) and model_bytes > 90 << 20
    for result in (before, after, eager):
        assert result["probe"] == expected  # the weights really arrived
    # The eager model holds all of its weights at once; the streamed loads about a unit
    # (2 MiB) and a tensor (1 MiB), plus the 16 MiB arena window and allocator slack.
    assert eager["peak"] > model_bytes, eager  # type: ignore[operator]
    assert before["peak"] < 0.5 * model_bytes, (before, eager)  # type: ignore[operator]
    assert after["peak"] < 0.5 * model_bytes, (after, eager)  # type: ignore[operator]
