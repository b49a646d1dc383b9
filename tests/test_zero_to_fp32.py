"""DeepSpeed's ``zero_to_fp32`` over offloadd's checkpoints (``trainer.state.zero_to_fp32``),
as HF's and Accelerate's guides use it.

A GPT-2 with its first block frozen and a buffer of its own trains 2 steps on 2 gloo ranks
on the strict device twin, at stages 3 and 2, and saves a checkpoint whole and one without
its frozen parameters (HF Trainer's PEFT save). Compared with the engine's consolidated
fp32 weights, bit for bit:

- ``get_fp32_state_dict_from_zero_checkpoint``: every name (the tied head as the same
  tensor), the buffer; with ``exclude_frozen_parameters`` all but the frozen block, at
  stage 3 (frozen units) and stage 2 (frozen parameters outside units); the checkpoint
  without its frozen parameters gives the same;
- ``load_state_dict_from_zero_checkpoint`` into the live ZeRO-3 engine's module, whose
  parameters the engine released (DeepSpeed meets them as a size mismatch);
- the ``zero_to_fp32.py`` script ``save_checkpoint`` leaves beside ``latest``, run as the
  guides say (``python zero_to_fp32.py . out``) in a fresh interpreter: sharded
  safetensors with HF's index; ``convert_zero_checkpoint_to_fp32_state_dict`` into a
  directory, into one file (``pytorch_model.bin``, HF's guide's command), by
  ``output_file=`` (DeepSpeed before 0.15);
- ``import trainer.hf`` makes ``from deepspeed.utils.zero_to_fp32 import ...`` these.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.state.export import ExportError
from trainer.state.zero_to_fp32 import (
    SCRIPT_NAME,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

ROOT = Path(__file__).resolve().parents[1]
STAGES = (3, 2)
FROZEN = "transformer.h.0."


def make_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.h[0].requires_grad_(False)
    model.register_buffer("probe", torch.arange(3.0))  # a buffer of the model's own
    return model


def train_and_save(rank: int, world: int, root: str) -> dict[int, dict[str, Any]]:
    results = {}
    for stage in STAGES:
        config = {"train_micro_batch_size_per_gpu": 2,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": stage},
                  "units": {"module_classes": ["GPT2Block"]}}
        engine, _, _, _ = trainer.initialize(model=make_gpt2(), config=config)
        assert engine.collectives.device.type == "twin"
        for step in range(2):
            ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(
                step * 10 + rank)).to(engine.collectives.device)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(f"{root}/full{stage}")
        engine.save_checkpoint(f"{root}/lora{stage}", exclude_frozen_parameters=True)
        results[stage] = {"fp32": consolidate_fp32_state_dict(engine)}
        if stage == 3:  # HF's online recipe, the engine alive and its parameters released
            assert any(param.numel() == 0 for param in engine.module.parameters())
            model = load_state_dict_from_zero_checkpoint(engine.module, f"{root}/full3")
            results[stage]["loaded"] = {name: value.clone()
                                        for name, value in model.state_dict().items()}
        engine.close()
    return results


def assert_equal(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(expected)
    for name, value in expected.items():
        assert ours[name].dtype == torch.float32 and ours[name].device.type == "cpu", name
        assert torch.equal(ours[name], value), name


def test_zero_to_fp32_gives_the_engines_fp32_weights(tmp_path: Path) -> None:
    results = run_ranks(train_and_save, 2, str(tmp_path))[0]
    names = set(make_gpt2().state_dict())
    trained = {name for name in names if not name.startswith(FROZEN)}
    assert "probe" in names and trained != names
    for stage in STAGES:
        fp32 = results[stage]["fp32"]
        assert set(fp32) == names
        full = get_fp32_state_dict_from_zero_checkpoint(tmp_path / f"full{stage}")
        assert_equal(full, fp32)
        assert full["lm_head.weight"] is full["transformer.wte.weight"]
        wanted = {name: fp32[name] for name in trained}
        assert_equal(get_fp32_state_dict_from_zero_checkpoint(
            tmp_path / f"full{stage}", exclude_frozen_parameters=True), wanted)
        for exclude in (False, True):  # what a checkpoint without them holds
            assert_equal(get_fp32_state_dict_from_zero_checkpoint(
                tmp_path / f"lora{stage}", "global_step2", exclude), wanted)
    assert_equal(results[3]["loaded"], results[3]["fp32"])

    # the script beside `latest`, as the guides run it, in a fresh interpreter
    full3 = tmp_path / "full3"
    script = full3 / SCRIPT_NAME
    assert script.stat().st_mode & 0o111
    done = subprocess.run([sys.executable, SCRIPT_NAME, ".", str(tmp_path / "sharded"),
                           "--safe_serialization", "--max_shard_size", "8KB"], cwd=full3,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and not list((tmp_path / "sharded").glob("config.json"))
    written = {name: value for shard in shards
               for name, value in load_file(tmp_path / "sharded" / shard).items()}
    assert_equal(written, {name: value for name, value in results[3]["fp32"].items()
                           if name != "lm_head.weight"})  # a tied weight once, as HF writes

    # the same converter in-process: a directory, one file by its name, output_file=
    fp32 = results[2]["fp32"]
    full2 = tmp_path / "full2"
    convert_zero_checkpoint_to_fp32_state_dict(full2, tmp_path / "dir")
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["pytorch_model.bin"]
    assert_equal(torch.load(tmp_path / "dir" / "pytorch_model.bin", weights_only=True), fp32)
    assert main([str(full2), str(tmp_path / "pytorch_model.bin")]) == 0
    assert_equal(torch.load(tmp_path / "pytorch_model.bin", weights_only=True), fp32)
    (tmp_path / "named.bin").mkdir()  # DeepSpeed 0.15's directory of such a name
    convert_zero_checkpoint_to_fp32_state_dict(full2, tmp_path / "named.bin",
                                               exclude_frozen_parameters=True)
    assert_equal(torch.load(tmp_path / "named.bin" / "pytorch_model.bin", weights_only=True),
                 {name: fp32[name] for name in trained})
    convert_zero_checkpoint_to_fp32_state_dict(full2, output_file=tmp_path / "old" / "w.pt")
    assert_equal(torch.load(tmp_path / "old" / "w.pt", weights_only=True), fp32)

    # a checkpoint whose meta.json does not list its frozen parameters (saved before it
    # did) converts whole, and says why it cannot leave them out
    shutil.copytree(full2, tmp_path / "older")
    meta_path = tmp_path / "older" / "global_step2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["frozen"]
    meta_path.write_text(json.dumps(meta))
    assert_equal(get_fp32_state_dict_from_zero_checkpoint(tmp_path / "older"), fp32)
    with pytest.raises(ExportError, match="exclude_frozen_parameters"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "older",
                                                 exclude_frozen_parameters=True)


def test_errors_name_what_to_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match="no 'latest' file; name the checkpoint's tag"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(TypeError, match=r"output_dir .* or output_file"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path)
    assert main([str(tmp_path), str(tmp_path / "out"), "-t", "global_step9"]) == 2
    assert "missing meta.json" in capsys.readouterr().err


def test_trainer_hf_registers_it_as_deepspeeds() -> None:
    code = ("import trainer.hf\n"
            "from deepspeed.utils.zero_to_fp32 import (\n"
            "    convert_zero_checkpoint_to_fp32_state_dict as c,\n"
            "    get_fp32_state_dict_from_zero_checkpoint as g,\n"
            "    load_state_dict_from_zero_checkpoint as load)\n"
            "from trainer.state import zero_to_fp32 as z\n"
            "assert (c, g, load) == (z.convert_zero_checkpoint_to_fp32_state_dict,\n"
            "    z.get_fp32_state_dict_from_zero_checkpoint,\n"
            "    z.load_state_dict_from_zero_checkpoint)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
