"""Every script in examples/ runs under torchrun on 2 CPU ranks (as its docstring says),
with ZeRO-3 and parameters + optimizer state on NVMe, and leaves what it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _torchrun import ROOT, torchrun

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"


def swap_config(tmp_path: Path, name: str) -> Path:
    """The example's config with its NVMe path moved under tmp_path."""
    config = json.loads((EXAMPLES / name).read_text())
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["nvme_path"] = str(tmp_path / "swap")
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_every_example_is_tested() -> None:
    scripts = {path.name for path in EXAMPLES.glob("*.py")} - {"common.py"}
    tested = {"ds_train.py", "hf_finetune.py", "accelerate_train.py", "lightning_train.py"}
    assert scripts == tested


def test_deepspeed_style_script(tmp_path: Path) -> None:
    config = swap_config(tmp_path, "ds_zero3.json")
    torchrun(EXAMPLES / "ds_train.py", ["--deepspeed_config", str(config),
                                        "--checkpoint-dir", str(tmp_path / "ckpt")], tmp_path)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    assert len(list((tmp_path / "ckpt" / "global_step4").glob("rank_*.pt"))) == 2


def test_hf_trainer_finetune(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="the hf extra is not installed")
    config = swap_config(tmp_path, "ds_config.json")
    torchrun(EXAMPLES / "hf_finetune.py", ["--deepspeed", str(config), "--output-dir",
                                           str(tmp_path / "out")], tmp_path)
    assert (tmp_path / "out" / "checkpoint-4" / "global_step4").is_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    assert model.config.n_layer == 2


def test_accelerate_loop(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="the hf extra is not installed")
    torchrun(EXAMPLES / "accelerate_train.py", ["--nvme-path", str(tmp_path / "swap"),
                                                "--output-dir", str(tmp_path / "out")],
             tmp_path)
    assert (tmp_path / "out" / "state" / "latest").read_text() == "pytorch_model"
    assert len(list((tmp_path / "out" / "state" / "pytorch_model").glob("rank_*.pt"))) == 2


def test_lightning_module(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    torchrun(EXAMPLES / "lightning_train.py", ["--nvme-path", str(tmp_path / "swap"),
                                               "--output-dir", str(tmp_path / "out")],
             tmp_path)
    saved = sorted(path.name for path in (tmp_path / "out" / "checkpoints").iterdir())
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
