"""The HF Trainer on offloadd (``import trainer.hf`` + ``TrainingArguments(deepspeed=cfg)``),
2 torchrun ranks, state offloaded to NVMe through a private daemon whose arena is smaller
than the state:

- the Trainer's own AdamW and schedule (no optimizer/scheduler sections, "auto" values,
  ZeRO-2, gradient accumulation, clipping) match the same script under torch DDP: losses,
  eval loss, and the ``save_model`` output loaded with ``from_pretrained``;
- the config's AdamW and WarmupDecayLR ("auto" filled by the Trainer), ZeRO-3, bf16:
  resuming from the step-3 checkpoint gives the uninterrupted run's losses and weights
  bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchrun import torchrun

pytest.importorskip("accelerate", reason="the hf extra is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "hf_trainer_run.py"


def run(out: Path, *args: str) -> dict[str, Any]:
    torchrun(SCRIPT, ["--out", str(out), *args], out)
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    model = transformers.GPT2LMHeadModel.from_pretrained(out / "final")
    return {name: value.float() for name, value in model.state_dict().items()}


def test_trainer_defaults_match_ddp(tmp_path: Path) -> None:
    ours = run(tmp_path / "offloadd", "--mode", "offloadd", "--variant", "trainer_optim",
               "--stage", "2", "--offload", "nvme")
    reference = run(tmp_path / "ddp", "--mode", "ddp")
    assert ours["global_step"] == reference["global_step"] == 6
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    trained, expected = final_weights(tmp_path / "offloadd"), final_weights(tmp_path / "ddp")
    torch.manual_seed(0)  # the script's initial weights
    initial = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(
        tmp_path / "ddp" / "final"))
    assert set(trained) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)
    moved = (trained["transformer.wte.weight"] - initial.transformer.wte.weight).abs().max()
    assert moved > 1e-3  # it trained


def test_config_optimizer_zero3_bf16_resume_is_exact(tmp_path: Path) -> None:
    common = ["--mode", "offloadd", "--variant", "config_optim", "--stage", "3", "--bf16"]
    full = run(tmp_path / "full", *common)
    checkpoint = tmp_path / "full" / "run" / "checkpoint-3"
    assert (checkpoint / "global_step3").is_dir() and (checkpoint / "latest").exists()
    resumed = run(tmp_path / "resumed", *common, "--resume-from", str(checkpoint))
    assert resumed["global_step"] == full["global_step"] == 6
    assert resumed["losses"] == full["losses"]
    assert resumed["eval_loss"] == full["eval_loss"]
    resumed_weights, full_weights = final_weights(tmp_path / "resumed"), final_weights(
        tmp_path / "full")
    for name, value in full_weights.items():
        assert torch.equal(resumed_weights[name], value), name
