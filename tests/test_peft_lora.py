"""PEFT LoRA under the HF Trainer on offloadd, in the order PEFT's and transformers' guides
write it: ``TrainingArguments(deepspeed=<ZeRO-3 config>)`` first, then
``AutoModelForCausalLM.from_pretrained`` (built inside ``deepspeed.zero.Init``: every
parameter on ``meta``), then ``get_peft_model`` (which re-parents the base model's modules
and moves its new adapters to the base weights' device, ``meta``), then
``Trainer.train()``; 2 torchrun ranks, parameters and optimizer on NVMe through an arena
smaller than the state. The same script under torch DDP is the reference:

- the checkpoint reaches the re-parented base weights (the first loss is the base
  model's) and the adapters keep the values PEFT gave them: the losses and the eval loss
  match DDP's;
- frozen base weights get no optimizer step (the daemon's Adam saw only LoRA elements);
- the adapter ``save_model`` wrote loads with ``PeftModel.from_pretrained`` and gives the
  Trainer's eval loss;
- the Trainer's checkpoints (``save_steps``) hold the adapters' state and none of the base
  model (HF asks for ``exclude_frozen_parameters`` for PEFT models), and
  ``train(resume_from_checkpoint=...)`` (which loads with ``load_module_strict=False``)
  continues bit for bit;
- PEFT's ``get_nb_trainable_parameters`` (``print_trainable_parameters``) counts the
  partitioned parameters as DDP's whole ones (DeepSpeed's ``ds_numel``).
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
peft = pytest.importorskip("peft", reason="the test extra is not installed")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "peft_lora_run.py"
STEPS = 4


def tiny_qwen2(path: Path) -> None:
    """A tiny Qwen2 (tied embeddings, as Qwen2-0.5B) saved where from_pretrained reads it."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)


def run(out: Path, base: Path, *args: str) -> dict[str, Any]:
    torchrun(SCRIPT, ["--out", str(out), "--base", str(base), "--max-steps", str(STEPS),
                      *args], out)
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def test_lora_under_zero3_matches_ddp_and_the_adapter_loads(tmp_path: Path) -> None:
    base = tmp_path / "base"
    tiny_qwen2(base)
    reference = run(tmp_path / "ddp", base, "--mode", "ddp")
    assert reference["losses"]["1"] != reference["losses"][str(STEPS)]  # it trained

    tight = ("--arena-bytes", str(96 << 10))  # smaller than the state: it swaps
    ours = run(tmp_path / "offloadd", base, "--mode", "offloadd", "--save-steps", "2", *tight)
    assert ours["global_step"] == reference["global_step"] == STEPS
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    # PEFT counts partitioned parameters from their ds_numel (0 each before)
    assert ours["peft_counts"] == reference["peft_counts"]

    stats = ours["offload_stats"]
    assert stats["swap"]["dirs"][0]["written_nbytes"] > 0  # the state really went to NVMe
    base_numel = sum(p.numel() for p in
                     transformers.AutoModelForCausalLM.from_pretrained(base).parameters())
    assert ours["frozen_numel"] == base_numel
    # Adam ran over the adapters only, every step on both ranks' partitions.
    assert stats["optimizer"]["elements"] == ours["trainable_numel"] * STEPS

    adapter = tmp_path / "offloadd" / "final"
    assert (adapter / "adapter_model.safetensors").exists()
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), adapter)
    model.eval()
    ids = torch.randint(0, 97, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eval_loss = float(model(input_ids=ids, labels=ids).loss)
    assert eval_loss == pytest.approx(ours["eval_loss"], rel=1e-5)

    saved = tmp_path / "offloadd" / "run" / "checkpoint-2"
    meta = json.loads((saved / "global_step2" / "meta.json").read_text())
    assert meta["frozen_excluded"] is True
    for rank in range(2):
        payload = torch.load(saved / "global_step2" / f"rank_{rank:05d}.pt", weights_only=True)
        assert payload["untracked"] == {}
        kept = [unit for unit in meta["units"] if unit["index"] in payload["units"]]
        assert sum(unit["numel"] for unit in kept) == ours["trainable_numel"]  # adapters only
    resumed = run(tmp_path / "resumed", base, "--mode", "offloadd", "--resume-from",
                  str(saved), *tight)
    assert resumed["global_step"] == STEPS
    assert resumed["losses"] == ours["losses"]  # steps 3 and 4 trained again, bit for bit
    assert resumed["eval_loss"] == ours["eval_loss"]
