"""Pretrained HF weights into ZeRO models on 2 gloo ranks (issue 19, items 2 and 8).

A small Llama (saved by ``save_pretrained`` in many tiny safetensors shards)
and GPT-2 (one safetensors file; and a plain ``pytorch_model.bin``) reach a
model built under ``trainer.zero.Init`` through ``trainer.load_pretrained``
before or after ``initialize``, and through ``from_pretrained`` inside
``zero.Init``. The engine's logits equal the HF model's (both bf16), and the
first fine-tuning step's loss is the pretrained model's loss on that batch. A
model built without loading is the control: its logits are far from them.
transformers' own ZeRO-3 load (the HF Trainer's, through ``import trainer.hf``)
goes through the facade's ``GatheredParameters``, which leaves parameters not
yet materialised to ``initialize``.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import lm_tokens, run_ranks, shared_daemon, with_offload
from safetensors import safe_open

import trainer
from trainer.integrations.ds_facade import GatheredParameters as FacadeGatheredParameters
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.state.hf_checkpoint import CheckpointError
from trainer.state.pretrained import PretrainedError
from trainer.zero import GatheredParameters, Init
from trainer.zero.init import ZeroInitError

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

VOCAB = 97


def llama_config(num_layers: int = 2, width: int = 32) -> Any:
    return transformers.LlamaConfig(hidden_size=width, intermediate_size=2 * width,
                                    num_hidden_layers=num_layers, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=VOCAB,
                                    max_position_embeddings=32)


def gpt2_config() -> Any:
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                   n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


MODELS = {"llama": lambda: transformers.LlamaForCausalLM(llama_config()),
          "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2_config())}


def pretrained(kind: str) -> Any:
    """The "pretrained" model: seeded, so not what a fresh init under zero.Init gives."""
    torch.manual_seed(1)
    return MODELS[kind]()


def save_checkpoints(root: Path) -> dict[str, Path]:
    """The pretrained models as users have them on disk."""
    paths = {"llama": root / "llama", "gpt2": root / "gpt2", "gpt2_bin": root / "gpt2_bin"}
    pretrained("llama").save_pretrained(paths["llama"], max_shard_size="20KB")
    model = pretrained("gpt2")
    model.save_pretrained(paths["gpt2"])
    paths["gpt2_bin"].mkdir()
    model.config.save_pretrained(paths["gpt2_bin"])
    torch.save(model.state_dict(), paths["gpt2_bin"] / "pytorch_model.bin")
    return paths


def ds_config(stage: int, device: str, socket_path: str, job: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage}}
    return with_offload(config, device, socket_path, job)


# (name, model, checkpoint, how, stage, offload device)
CASES = [
    ("llama-before", "llama", "llama", "before", 3, "none"),
    ("llama-from_pretrained", "llama", "llama", "from_pretrained", 3, "cpu"),
    ("gpt2-after", "gpt2", "gpt2", "after", 3, "cpu"),
    ("gpt2-bin-before", "gpt2", "gpt2_bin", "before", 2, "none"),
    ("llama-not-loaded", "llama", "llama", "none", 3, "none"),
]


def build(kind: str, path: Path, how: str, config: dict[str, Any]) -> Any:
    with Init(config_dict_or_path=config):
        if how == "from_pretrained":
            return transformers.AutoModelForCausalLM.from_pretrained(path)
        return MODELS[kind]()


def load_rank(rank: int, world: int, paths: dict[str, Path]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with shared_daemon(rank, None, arena_size=64 << 20) as socket_path:
        for index, (name, kind, checkpoint, how, stage, device) in enumerate(CASES):
            config = ds_config(stage, device, socket_path, f"pretrained{index}")
            model = build(kind, paths[checkpoint], how, config)
            on_meta = all(p.is_meta for p in model.parameters())
            if how == "before":
                trainer.load_pretrained(model, paths[checkpoint])
            engine, _, _, _ = trainer.initialize(model=model, config=config)
            if how == "after":
                report = trainer.load_pretrained(engine, paths[checkpoint])
                assert not report.missing, report
            engine.eval()
            with torch.no_grad():
                logits = engine(input_ids=lm_tokens(0, 0)).logits.float()
            engine.train()
            ids = lm_tokens(1, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            results[name] = {"on_meta": on_meta, "logits": logits, "first_loss": loss.item()}
            engine.close()
    return results


def reference(path: Path, rank: int) -> tuple[torch.Tensor, float]:
    """The HF model as from_pretrained gives it, in bf16: logits and rank's first loss."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=lm_tokens(0, 0)).logits.float()
        ids = lm_tokens(1, rank)
        loss = model(input_ids=ids, labels=ids).loss.item()
    return logits, loss


@pytest.mark.slow
def test_pretrained_weights_reach_zero_init_models() -> None:
    paths = save_checkpoints(Path(tempfile.mkdtemp(prefix="offloadd-pretrained-")))
    assert len(list(paths["llama"].glob("model-*-of-*.safetensors"))) > 3  # really sharded
    results = run_ranks(load_rank, 2, paths)
    for name, _, checkpoint, how, _, _ in CASES:
        ref_path = paths["gpt2" if checkpoint == "gpt2_bin" else checkpoint]
        for rank in range(2):
            got = results[rank][name]
            assert got["on_meta"], name
            expected_logits, expected_loss = reference(ref_path, rank)
            error = (got["logits"] - expected_logits).abs().max().item()
            if how == "none":  # the control: HF init, not the checkpoint
                assert error > 0.1, (name, error)
                continue
            assert error < 1e-2, (name, rank, error)
            assert abs(got["first_loss"] - expected_loss) < 5e-3, (name, rank, got, expected_loss)


def test_load_pretrained_errors_name_the_fix(tmp_path: Path) -> None:
    model = pretrained("llama")
    model.save_pretrained(tmp_path / "llama")
    with Init(config_dict_or_path={}):
        meta = transformers.LlamaForCausalLM(model.config)
    with pytest.raises(ZeroInitError, match="load_pretrained"):
        GatheredParameters(meta.lm_head.weight, modifier_rank=0)
    other = transformers.LlamaForCausalLM(llama_config(width=16))
    with pytest.raises(PretrainedError, match="shapes differ"):
        trainer.load_pretrained(other, tmp_path / "llama")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors\.index\.json"):
        trainer.load_pretrained(model, tmp_path)
    deeper = transformers.LlamaForCausalLM(llama_config(num_layers=3))
    with pytest.raises(PretrainedError, match="strict=False"):
        trainer.load_pretrained(deeper, tmp_path / "llama")
    base = transformers.LlamaModel(llama_config())  # saved without the "model." prefix
    base.save_pretrained(tmp_path / "base")
    target = transformers.LlamaForCausalLM(llama_config())
    report = trainer.load_pretrained(target, tmp_path / "base", strict=False)
    assert report.missing == ["lm_head.weight"] and not report.unexpected
    assert torch.equal(target.model.layers[0].self_attn.q_proj.weight,
                       base.layers[0].self_attn.q_proj.weight)
    report = trainer.load_pretrained(deeper, tmp_path / "llama", strict=False)
    assert report.missing and all(name.startswith("model.layers.2.") for name in report.missing)
    assert torch.equal(deeper.model.layers[1].mlp.up_proj.weight,
                       model.model.layers[1].mlp.up_proj.weight)


def test_the_facades_gather_leaves_unmaterialised_parameters_to_initialize() -> None:
    """``deepspeed.zero.GatheredParameters`` as ``import trainer.hf`` serves it (transformers'
    ZeRO-3 load on rank 0): a load into parameters zero.Init has not materialised passes
    over them, without torch's meta-copy warning (initialize streams the checkpoint);
    reading their values, or editing a meta parameter zero.Init did not build (the new
    embedding of resize_token_embeddings), raises ZeroInitError naming the way round."""
    source = pretrained("gpt2")
    with Init(config_dict_or_path={}):
        meta = transformers.GPT2LMHeadModel(source.config)
    layer = meta.transformer.h[0].mlp.c_fc
    state = source.transformer.h[0].mlp.c_fc.state_dict()
    errors: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FacadeGatheredParameters(list(layer.parameters()), modifier_rank=0):
            layer._load_from_state_dict(state, "", {}, True, [], [], errors)
    assert not errors and all(param.is_meta for param in layer.parameters())
    embedding = meta.transformer.wte.weight
    with pytest.raises(ZeroInitError, match="resize_token_embeddings"), \
            FacadeGatheredParameters(embedding):
        embedding.sum().item()
    resized = torch.nn.Embedding(VOCAB + 3, embedding.shape[1], device="meta")
    with pytest.raises(ZeroInitError, match="did not build"):
        FacadeGatheredParameters([embedding, resized.weight], modifier_rank=0)


def test_load_after_initialize_fills_frozen_units_and_gathered_edits_stick(
        tmp_path: Path) -> None:
    """Stage 3 with frozen units, one process, fp32: the engine's weights are the
    checkpoint's exactly; an edit of a frozen weight under GatheredParameters is kept."""
    pretrained("gpt2").save_pretrained(tmp_path)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    model = MODELS["gpt2"]()
    frozen = [p for n, p in model.named_parameters() if n.startswith("transformer.h.0.")]
    for param in frozen:
        param.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = trainer.initialize(model=model, config=config)
    try:
        assert any(not unit.trainable for unit in engine.units)
        report = trainer.load_pretrained(model, tmp_path)  # the engine's model: after init
        assert not report.missing
        state = consolidate_fp32_state_dict(engine)
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
        weight = model.transformer.h[0].mlp.c_fc.weight
        with GatheredParameters(weight, modifier_rank=0), torch.no_grad():
            weight[0].fill_(3.0)
        state = consolidate_fp32_state_dict(engine)
        assert torch.equal(state["transformer.h.0.mlp.c_fc.weight"][0], torch.full((128,), 3.0))
        # DeepSpeed's exclude_frozen_parameters: only the trained part is exported.
        engine.save_16bit_model(tmp_path / "trained", exclude_frozen_parameters=True)
        with safe_open(str(tmp_path / "trained" / "model.safetensors"), "pt") as exported:
            names = set(exported.keys())
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert names == trainable and "transformer.h.0.mlp.c_fc.weight" not in names
    finally:
        engine.close()
