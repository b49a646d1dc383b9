"""HF's non-Trainer ZeRO-Inference example (``tests/scripts/hf_zero_inference_run.py``)
runs as the guide writes it, one line added, on 2 torchrun ranks on the strict device
twin: the greedy tokens equal plain torch's ``generate`` on the same weights, and the
engine is one without an optimizer whose weights the daemon holds (fp32, nothing more).

Before: its config was refused twice, for ``stage3_prefetch_bucket_size=0.9 * h * h``
(a fraction) and for ``offload_param`` without ``offload_optimizer``, which only an engine
that trains needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _torchrun import torchrun

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

SCRIPT = Path(__file__).parent / "scripts" / "hf_zero_inference_run.py"


def test_hf_zero_inference_example_generates_torchs_tokens(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=97, n_positions=32, bos_token_id=0,
        eos_token_id=0))
    model.save_pretrained(tmp_path / "model")
    torchrun(SCRIPT, [str(tmp_path / "model"), str(tmp_path)], tmp_path)
    model.eval()
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        with torch.no_grad():
            expected = model.generate(torch.tensor([result["prompt"]]), do_sample=False,
                                      max_new_tokens=4 + 3 * rank)
        assert result["tokens"] == expected.tolist(), rank
        assert not any(result["trainable_units"])
        assert result["shard_nbytes"] == 4 * result["padded_numel"]
