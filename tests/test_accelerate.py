"""An Accelerate loop on offloadd (``import trainer.hf`` +
``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))``), 2 torchrun ranks,
ZeRO-3 with parameters and optimizer on NVMe: ``prepare(model, optimizer, loader,
scheduler)`` with a torch AdamW and a torch LambdaLR, ``accumulate``, ``backward``,
``clip_grad_norm_``; losses and ``get_state_dict`` weights match the same loop under
torch DDP, and ``load_state`` of a ``save_state`` taken at step 3 continues exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchrun import torchrun

pytest.importorskip("accelerate", reason="the hf extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_run.py"
SAVE_AT = 3
MICRO_PER_STEP = 2


def run(out: Path, *args: str) -> tuple[list[float], dict[str, Any]]:
    torchrun(SCRIPT, ["--out", str(out), *args], out)
    losses: list[float] = json.loads((out / "result.json").read_text())["losses"]
    return losses, torch.load(out / "final.pt", weights_only=True)


def test_accelerate_loop_matches_ddp_and_resumes_exactly(tmp_path: Path) -> None:
    losses, weights = run(tmp_path / "full", "--mode", "offloadd", "--save-at", str(SAVE_AT))
    ddp_losses, ddp_weights = run(tmp_path / "ddp", "--mode", "ddp")
    assert losses == pytest.approx(ddp_losses, rel=1e-5)
    assert set(weights) == set(ddp_weights)
    for name, value in ddp_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert (tmp_path / "full" / "state" / "pytorch_model" / "rank_00000.pt").exists()

    resumed, resumed_weights = run(tmp_path / "resumed", "--mode", "offloadd", "--save-at",
                                   str(SAVE_AT), "--resume-from",
                                   str(tmp_path / "full" / "state"))
    assert resumed == losses[SAVE_AT * MICRO_PER_STEP:]
    for name, value in weights.items():
        assert torch.equal(resumed_weights[name], value), name
