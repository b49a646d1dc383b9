"""Exports on 2 gloo ranks (issue 19, items 3 and 9): ``engine.save_16bit_model`` and
``python -m trainer.export`` turn a trained ZeRO GPT-2 (stages 3 and 2, bf16) into HF
model directories that ``AutoModelForCausalLM.from_pretrained(dir)`` loads as written
(config.json, generation_config.json, safetensors, sharded with an index above
``max_shard_size``, or ``.bin`` where asked) and that give the engine's logits; and into
plain state dicts equal to the engine's consolidated weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.state.export import ExportError, export_checkpoint, main

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def make_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def train_and_save(rank: int, world: int, root: str) -> list[Any]:
    results = []
    for stage in (3, 2):
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": stage},
                  "units": {"module_classes": ["GPT2Block"]}}
        engine, _, _, _ = trainer.initialize(model=make_gpt2(), config=config)
        for step in range(2):
            ids = torch.randint(0, 97, (2, 16),
                                generator=torch.Generator().manual_seed(step * 10 + rank))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(f"{root}/ckpt{stage}")
        assert engine.save_16bit_model(f"{root}/model{stage}") is True
        engine.save_16bit_model(f"{root}/bin{stage}", "pytorch_model.bin", max_shard_size="4KB")
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=IDS).logits.float()
        results.append({"fp32": consolidate_fp32_state_dict(engine), "logits": logits})
        engine.close()
    return results


IDS = torch.arange(16).reshape(1, 16) * 5 % 97


def hf_logits(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()  # type: ignore[no-any-return]


def _export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "trainer.export", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_exports_load_with_from_pretrained() -> None:
    root = Path(tempfile.mkdtemp(prefix="offloadd-export-"))
    results = run_ranks(train_and_save, 2, str(root))[0]
    keys = set(make_gpt2().state_dict())
    for stage, result in zip((3, 2), results, strict=True):
        fp32 = result["fp32"]
        # save_16bit_model: one safetensors file in the training dtype, the HF configs.
        model_dir = root / f"model{stage}"
        assert sorted(p.name for p in model_dir.iterdir()) == [
            "config.json", "generation_config.json", "model.safetensors"]
        config = json.loads((model_dir / "config.json").read_text())
        assert config["dtype"] == "bfloat16" and config["architectures"] == ["GPT2LMHeadModel"]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        assert loaded.dtype == torch.bfloat16
        assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, fp32[name].to(torch.bfloat16)), name
        assert torch.allclose(hf_logits(model_dir), result["logits"], atol=1e-2), stage

        # .bin where asked, sharded under max_shard_size with HF's index.
        bin_dir = root / f"bin{stage}"
        index = json.loads((bin_dir / "pytorch_model.bin.index.json").read_text())
        assert set(index["weight_map"]) == keys
        assert len(set(index["weight_map"].values())) > 3
        loaded = transformers.AutoModelForCausalLM.from_pretrained(bin_dir)
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, fp32[name].to(torch.bfloat16)), name
        assert torch.allclose(hf_logits(bin_dir), result["logits"], atol=1e-2), stage

        # offline, one file: the fp32 masters exactly, without torch.distributed.
        if stage == 3:  # the command once (a fresh interpreter), the function otherwise
            done = _export_cli(f"{root}/ckpt{stage}", f"{root}/plain{stage}.bin")
            assert done.returncode == 0, done.stderr
        else:
            export_checkpoint(f"{root}/ckpt{stage}", f"{root}/plain{stage}.bin")
        plain = torch.load(f"{root}/plain{stage}.bin", weights_only=True)
        assert set(plain) == keys
        for name in keys:
            assert torch.equal(plain[name], fp32[name]), name

        # offline, an HF directory in sharded safetensors (fp32 masters) with the configs
        # save_checkpoint kept.
        if stage == 3:
            done = _export_cli(f"{root}/ckpt{stage}", f"{root}/hf{stage}",
                               "--max-shard-size", "8KB")
            assert done.returncode == 0, done.stderr
        else:
            export_checkpoint(f"{root}/ckpt{stage}", f"{root}/hf{stage}", max_shard_size="8KB")
        hf_dir = root / f"hf{stage}"
        index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 3
        assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "float32"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, fp32[name]), name
        assert torch.allclose(hf_logits(hf_dir), result["logits"], atol=3e-2), stage


def test_export_without_a_checkpoint_names_the_problem(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match="no 'latest' file"):
        export_checkpoint(tmp_path, tmp_path / "out.bin")
    assert main([str(tmp_path), str(tmp_path / "out.bin"), "--tag", "nope"]) == 2
    assert "missing meta.json" in capsys.readouterr().err
