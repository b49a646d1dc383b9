"""An Accelerate loop on offloadd (``import trainer.hf`` +
``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))``), 2 torchrun ranks,
ZeRO-3 with parameters and optimizer on NVMe: ``prepare(model, optimizer, loader,
scheduler)`` with a torch AdamW and a torch LambdaLR, ``accumulate``, ``backward``,
``clip_grad_norm_``; losses and ``get_state_dict`` weights match the same loop under
torch DDP, and ``load_state`` of a ``save_state`` taken at step 3 continues exactly.

Accelerate's guide as written (``tests/scripts/accelerate_guide_run.py``): the keyword
``DeepSpeedPlugin(zero_stage=3, offload_*_device="nvme", ...)``, a ``from_pretrained``
model left in eval mode (it trains in eval mode, dropout off, as under DDP), a torch
LambdaLR stepped after ``optimizer.step()``: the losses match DDP's and the run raises
no warning (none about keys accelerate wrote, none from torch's scheduler)."""

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
GUIDE_SCRIPT = Path(__file__).parent / "scripts" / "accelerate_guide_run.py"
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


def test_the_guides_keyword_plugin_loop_in_eval_mode_matches_ddp_without_warnings(
        tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.5)  # eval mode must keep it off
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "base")
    results = {}
    for mode in ("offloadd", "ddp"):
        out = tmp_path / mode
        torchrun(GUIDE_SCRIPT, ["--out", str(out), "--base", str(tmp_path / "base"),
                                "--mode", mode], out)
        results[mode] = json.loads((out / "result.json").read_text())
    assert results["offloadd"]["losses"] == pytest.approx(results["ddp"]["losses"], rel=1e-5)
    assert results["offloadd"]["warnings"] == []
