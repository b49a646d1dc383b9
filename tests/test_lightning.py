"""Lightning on offloadd (``Trainer(strategy=OffloaddStrategy(config=cfg))``), 2 torchrun
ranks on the strict device twin (``TwinAccelerator``: what a GPU refuses fails here; the
kept engine's module moved to the CPU at ``fit``'s teardown did), ZeRO-3 with parameters
and optimizer on NVMe: ``configure_optimizers``' torch AdamW
and per-step LambdaLR, ``gradient_clip_val``, validation every 3 steps and a
ModelCheckpoint every 3 steps, after a baseline ``trainer.validate(model)``, then, as
Lightning's DeepSpeed guide goes on,
``trainer.test()``, ``trainer.predict()`` and ``trainer.validate(model)``. Losses (training,
validation, test, each prediction) and final weights match the same script with
``strategy="ddp"``; ``fit(ckpt_path=<step-3 checkpoint>)`` repeats the uninterrupted run's
later losses and weights bit for bit; a fresh process's ``trainer.test(fresh_module,
ckpt_path=<last checkpoint>)`` and ``predict`` give the first run's test and predictions
bit for bit, through an engine that holds the weights and no optimizer state;
``convert_zero_checkpoint_to_fp32_state_dict`` makes that checkpoint one file a regular
LightningModule loads (``load_from_checkpoint``) with the final weights; the module's
hyper-parameters hold an ``argparse.Namespace`` throughout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchrun import torchrun

pytest.importorskip("lightning", reason="the lightning extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "lightning_run.py"


TWIN = {"OFFLOADD_TWIN_DEVICE": "strict"}
"""offloadd's runs on the strict device twin (Lightning's ``TwinAccelerator``): batches,
module and engine on a device that refuses host tensors, as a GPU does."""


def run(out: Path, *args: str) -> tuple[dict[str, float], dict[str, Any]]:
    torchrun(SCRIPT, ["--out", str(out), *args], out,
             env=TWIN if "offloadd" in args else None)
    losses: dict[str, float] = json.loads((out / "result.json").read_text())
    return losses, torch.load(out / "final.pt", weights_only=True)


def test_strategy_matches_ddp_and_resumes_exactly(tmp_path: Path) -> None:
    losses, weights = run(tmp_path / "full", "--mode", "offloadd")
    ddp_losses, ddp_weights = run(tmp_path / "ddp", "--mode", "ddp")
    assert (tmp_path / "full" / "device.txt").read_text() == "twin:0"
    assert (tmp_path / "ddp" / "device.txt").read_text() == "cpu"
    # a baseline validation, the same steps, validation at 3 and 6, then test, predict,
    # validate
    assert list(losses) == list(ddp_losses)
    assert list(losses)[:2] == ["val/0", "baseline"]
    assert list(losses)[-4:] == ["test", "predict", "validate", "test/3"]
    assert losses["test/3"] != losses["test"]  # the step-3 checkpoint reached the engine
    predictions = losses.pop("predict")
    assert predictions == pytest.approx(ddp_losses.pop("predict"), rel=1e-5)
    assert losses == pytest.approx(ddp_losses, rel=1e-5)
    # validate(model) after fit evaluates the weights fit left: the last validation's
    assert losses["validate"] == losses["val/6"]
    assert set(weights) == set(ddp_weights)
    for name, value in ddp_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)

    # Stage 2 on the twin: the kept engine's module must keep its parameters on its
    # buffers through fit's teardown, or test(ckpt_path=<step 3>) evaluates fit's end. Its
    # checkpoints leave the frozen position embeddings out (exclude_frozen_parameters),
    # and test(ckpt_path=<step 3>) reads one with the module's strict_loading = False.
    stage2, stage2_weights = run(tmp_path / "stage2", "--mode", "offloadd", "--stage", "2",
                                 "--exclude-frozen")
    saved = tmp_path / "stage2" / "checkpoints" / "step=3.ckpt" / "checkpoint"
    assert json.loads((saved / "meta.json").read_text())["frozen_excluded"] is True
    untracked = torch.load(saved / "rank_00000.pt", weights_only=False)["untracked"]
    assert "model.transformer.wpe.weight" not in untracked  # at stage 2 it is untracked
    stage2_predictions = stage2.pop("predict")
    assert stage2_predictions == pytest.approx(predictions, rel=1e-5)
    assert stage2 == pytest.approx(losses, rel=1e-5)
    for name, value in ddp_weights.items():
        torch.testing.assert_close(stage2_weights[name], value, rtol=1e-4, atol=1e-5, msg=name)

    checkpoint = tmp_path / "full" / "checkpoints" / "step=3.ckpt"
    assert (checkpoint / "checkpoint" / "rank_00001.pt").exists()
    resumed, resumed_weights = run(tmp_path / "resumed", "--mode", "offloadd",
                                   "--ckpt-path", str(checkpoint))
    assert resumed.pop("predict") == predictions
    assert resumed == {key: value for key, value in losses.items() if key != "baseline"
                       and ("/" not in key or (int(key.split("/")[1]) >= 3 and key != "val/3"))}
    for name, value in weights.items():
        assert torch.equal(resumed_weights[name], value), name

    # A fresh process evaluates the last checkpoint; its module starts from the same
    # initial weights as fit's, so only reading the checkpoint gives fit's figures.
    out = tmp_path / "evaluate"
    torchrun(SCRIPT, ["--out", str(out), "--mode", "offloadd", "--evaluate",
                      str(tmp_path / "full" / "checkpoints" / "step=6.ckpt")], out, env=TWIN)
    evaluated = json.loads((out / "result.json").read_text())
    units = evaluated.pop("first_units")  # an evaluation engine: the weights and no more
    assert units and not any(units) and evaluated.pop("first_weights_only") is True
    assert evaluated == {"test": losses["test"], "predict": predictions,
                         "second": predictions, "first_closed": True}
    # the second Trainer's run destroyed the first's idle engine: its module holds the
    # checkpoint's (the final) weights, whole
    first = torch.load(out / "first.pt", weights_only=True)
    for name, value in weights.items():
        assert torch.equal(first[name], value), name

    # The guide's single-file checkpoint, which a regular LightningModule loads, through
    # Lightning's own name for the conversion (it asked for DeepSpeed before)
    import trainer.lightning

    assert trainer.lightning.OffloaddStrategy  # imported first, it takes that name
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    single = tmp_path / "single.ckpt"
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "full" / "checkpoints" / "step=6.ckpt",
                                               single)
    loaded = language_module().load_from_checkpoint(single, weights_only=False).state_dict()
    assert set(loaded) == set(weights)
    for name, value in weights.items():
        assert torch.equal(loaded[name], value), name
    saved = torch.load(single, weights_only=False)
    assert saved["global_step"] == 6 and "optimizer_states" not in saved
    assert saved["hyper_parameters"]["run_args"].mode == "offloadd"


def language_module() -> Any:
    """The script's LightningModule's shape (``tests/scripts/lightning_run.py``)."""
    import lightning.pytorch as pl
    from transformers import GPT2Config, GPT2LMHeadModel

    class LanguageModel(pl.LightningModule):
        def __init__(self, run_args: Any = None) -> None:
            super().__init__()
            self.model = GPT2LMHeadModel(GPT2Config(
                n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    return LanguageModel
