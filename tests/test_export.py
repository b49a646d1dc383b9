"""Exports on 2 gloo ranks: ``engine.save_16bit_model`` and ``python -m trainer.export``
turn a trained ZeRO GPT-2 (stages 3 and 2, bf16) into plain state dicts that load
strictly into a fresh model and match the engine's consolidated weights."""

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
from trainer.checkpoint import consolidate_fp32_state_dict
from trainer.export import INDEX_FILE, ExportError, export_checkpoint, main

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
        results.append(consolidate_fp32_state_dict(engine))
        engine.close()
    return results


def _export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "trainer.export", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_exports_load_into_a_fresh_model() -> None:
    root = tempfile.mkdtemp(prefix="offloadd-export-")
    consolidated = run_ranks(train_and_save, 2, root)[0]
    keys = list(make_gpt2().state_dict())
    for stage, fp32 in zip((3, 2), consolidated, strict=True):
        # save_16bit_model: the training dtype, state_dict keys, tied weights kept tied.
        sixteen = torch.load(f"{root}/model{stage}/pytorch_model.bin", weights_only=True)
        assert list(sixteen) == keys
        assert sixteen["lm_head.weight"].dtype == torch.bfloat16
        for name in keys:
            assert torch.equal(sixteen[name], fp32[name].to(torch.bfloat16)), name
        fresh = make_gpt2()
        fresh.load_state_dict(sixteen, strict=True)
        assert fresh.lm_head.weight is fresh.transformer.wte.weight

        # offline, one file: the fp32 masters exactly, without torch.distributed.
        if stage == 3:  # the command once (a fresh interpreter), the function otherwise
            done = _export_cli(f"{root}/ckpt{stage}", f"{root}/plain{stage}.bin")
            assert done.returncode == 0, done.stderr
        else:
            export_checkpoint(f"{root}/ckpt{stage}", f"{root}/plain{stage}.bin")
        plain = torch.load(f"{root}/plain{stage}.bin", weights_only=True)
        assert sorted(plain) == sorted(keys)
        for name in keys:
            assert torch.equal(plain[name], fp32[name]), name

        # offline, one shard per unit + the HF index.
        shards = export_checkpoint(f"{root}/ckpt{stage}", f"{root}/sharded{stage}",
                                   dtype=torch.bfloat16)
        index = json.loads((shards / INDEX_FILE).read_text())
        assert sorted(index["weight_map"]) == sorted(keys)
        assert len(set(index["weight_map"].values())) == 3  # root unit + 2 blocks
        merged: dict[str, torch.Tensor] = {}
        for filename in sorted(set(index["weight_map"].values())):
            merged.update(torch.load(shards / filename, weights_only=True))
        fresh = make_gpt2()
        fresh.load_state_dict(merged, strict=True)
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, fp32[name].to(torch.bfloat16).float()), name


def test_export_without_a_checkpoint_names_the_problem(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match="no 'latest' file"):
        export_checkpoint(tmp_path, tmp_path / "out.bin")
    assert main([str(tmp_path), str(tmp_path / "out.bin"), "--tag", "nope"]) == 2
    assert "missing meta.json" in capsys.readouterr().err
