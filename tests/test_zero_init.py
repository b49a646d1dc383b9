"""zero.Init on 2 gloo ranks: a GPT-2 built on meta, materialised unit by unit by
``initialize`` with HF's own init, trains like plain torch AdamW from the same start
(stages 2 and 3, offload none and nvme); GatheredParameters reads and edits weights."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from _dist import (
    base_config,
    lm_adamw_reference,
    lm_engine_train,
    lm_tokens,
    lm_tokens_alternating,
    max_relative_error,
    run_ranks,
    shared_daemon,
)
from test_engine_parity import HAS_NVME_TIER

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero import GatheredParameters, Init
from trainer.zero.init import KEEP_CONSTRUCTED_NUMEL, ZeroInitError

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

STEPS = 4
LR = 3e-3
N_LAYER = 2


def gpt2_config() -> Any:
    return transformers.GPT2Config(n_layer=N_LAYER, n_embd=32, n_head=2, vocab_size=97,
                                   n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def ds_config(stage: int, device: str, swap_dir: str | None, socket_path: str,
              job: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if device != "none":
        zero["offload_optimizer"] = {"device": device, "nvme_path": swap_dir}
        if stage == 3:
            zero["offload_param"] = {"device": device, "nvme_path": swap_dir}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero, "units": {"module_classes": ["GPT2Block"]}}
    if device != "none":
        config["offloadd"] = {"socket": socket_path, "job": job, "arena_size": 8 << 20}
    return config


def _edit_and_check(engine: Any, model: Any, rank: int) -> dict[str, Any]:
    """GatheredParameters without and with a modifier rank, after training."""
    wte = model.transformer.wte.weight
    before = consolidate_fp32_state_dict(engine)
    with GatheredParameters([wte, model.transformer.h[1].ln_1.weight]):
        gathered_shape = tuple(wte.shape)
        gathered_sum = float(wte.detach().double().sum())
    with GatheredParameters(wte, modifier_rank=0), torch.no_grad():
        if rank == 0:
            wte[3].fill_(0.5)
        else:
            wte[4].fill_(-7.0)  # not the modifier: must be discarded
    after = consolidate_fp32_state_dict(engine)
    ids = lm_tokens(0, 0)
    everything = list(model.parameters())
    with torch.no_grad():
        engine.eval()
        loss = engine(input_ids=ids, labels=ids).loss.item()
        # Inside GatheredParameters the parameters stay whole through a forward (its hooks
        # released each unit after use) and through a nested context's exit (it released
        # them for the outer context too).
        with GatheredParameters(everything):
            inside = engine(input_ids=ids, labels=ids).loss.item()
            whole = [p.numel() == _numel(p) for p in everything]
            with GatheredParameters([wte]):
                pass
            whole += [p.numel() == _numel(p) for p in everything]
        engine.train()
    return {"shape": gathered_shape, "sum": gathered_sum, "before": before, "after": after,
            "loss": loss, "inside": inside, "whole": whole}


def _numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def train_rank(rank: int, world: int, device: str) -> list[Any]:
    swap_dir = tempfile.mkdtemp(prefix="offloadd-swap-") if device == "nvme" else None
    results = []
    with shared_daemon(rank, swap_dir, enabled=device != "none") as socket_path:
        for stage in (3, 2):
            config = ds_config(stage, device, swap_dir, socket_path, f"init{stage}")
            with Init(config_dict_or_path=config):
                model = transformers.GPT2LMHeadModel(gpt2_config())
            on_meta = all(p.device.type == "meta" for p in model.parameters())
            engine, _, _, _ = trainer.initialize(model=model, config=config)
            initial = consolidate_fp32_state_dict(engine)
            losses = lm_engine_train(engine, STEPS, rank, lm_tokens_alternating)
            final = consolidate_fp32_state_dict(engine)
            edits = _edit_and_check(engine, model, rank) if device == "none" else None
            results.append({"stage": stage, "on_meta": on_meta, "initial": initial,
                            "final": final, "losses": losses, "edits": edits})
            engine.close()
    return results


def reference(initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = transformers.GPT2LMHeadModel(gpt2_config())
    model.load_state_dict(initial)
    return lm_adamw_reference(model, STEPS, lm_tokens_alternating, LR)


def _check_init(initial: dict[str, torch.Tensor]) -> None:
    """HF GPT-2's own init ran on every unit (not zeros, not torch defaults)."""
    assert torch.equal(initial["transformer.h.1.ln_1.weight"], torch.ones(32))
    assert torch.equal(initial["transformer.h.0.attn.c_attn.bias"], torch.zeros(96))
    std = initial["transformer.h.1.mlp.c_fc.weight"].std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02
    proj = initial["transformer.h.0.attn.c_proj.weight"].std().item()
    assert 0.6 * 0.02 / (2 * N_LAYER) ** 0.5 < proj < 1.4 * 0.02 / (2 * N_LAYER) ** 0.5
    assert torch.equal(initial["lm_head.weight"], initial["transformer.wte.weight"])


def _check_cases(results: list[list[Any]]) -> None:
    for case_rank0, case_rank1 in zip(*results, strict=True):
        assert case_rank0["on_meta"] and case_rank1["on_meta"]
        initial, final = case_rank0["initial"], case_rank0["final"]
        _check_init(initial)
        expected = reference(initial)
        # c_attn.bias's key part has an exactly-zero true gradient (see test_engine_hf).
        exact = {name: value for name, value in expected.items() if "c_attn.bias" not in name}
        error = max_relative_error({name: final[name] for name in exact}, exact)
        assert error < 1e-5, (case_rank0["stage"], error)
        assert case_rank0["losses"][-1] < case_rank0["losses"][0]


def test_zero_init_offload_none_matches_eager() -> None:
    results = run_ranks(train_rank, 2, "none")
    _check_cases(results)
    for case in results[0]:
        edits = case["edits"]
        assert edits["shape"] == (97, 32)
        before, after = edits["before"], edits["after"]
        wte = "transformer.wte.weight"
        assert torch.equal(after[wte][3], torch.full((32,), 0.5))
        assert torch.equal(after[wte][4], before[wte][4])  # rank 1's edit was discarded
        mask = torch.ones(97, dtype=torch.bool)
        mask[3] = False
        assert torch.equal(after[wte][mask], before[wte][mask])  # fp32 master kept exactly
        assert torch.equal(after["lm_head.weight"], after[wte])
        assert all(edits["whole"]) and edits["inside"] == edits["loss"]
    for case0, case1 in zip(results[0], results[1], strict=True):
        assert case0["edits"]["sum"] == case1["edits"]["sum"]
        assert case0["edits"]["loss"] == case1["edits"]["loss"]


@pytest.mark.skipif(not HAS_NVME_TIER, reason="the daemon's NVMe tier is not in this tree")
def test_zero_init_offload_nvme_matches_eager() -> None:
    _check_cases(run_ranks(train_rank, 2, "nvme"))


def test_plain_modules_use_reset_parameters_and_seeded_units() -> None:
    """A non-HF model gets each module's reset_parameters(); the same seed, the same values."""
    from trainer.zero.init import materialise

    def build() -> torch.nn.Module:
        with Init(config_dict_or_path={}, seed=5):
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
        assert all(p.device.type == "meta" for p in model.parameters())
        materialise(model, model, list(model.parameters()), "root")
        return model

    first, second = build(), build()
    assert torch.equal(first[0].weight, second[0].weight)
    assert first[0].weight.abs().max() <= 1 / 8 and first[0].weight.std() > 0.01
    assert torch.equal(first[1].weight, torch.ones(64))
    assert torch.nn.Parameter(torch.ones(2)).device.type == "cpu"  # patch is scoped


def test_module_without_init_names_param_init_fn() -> None:
    """A module with no init of its own: a large parameter is refused, naming
    ``param_init_fn``; a small one keeps its constructor's value, as built eagerly (a
    plain model's ``nn.Parameter(torch.zeros(...))`` position table)."""
    from trainer.zero.init import materialise

    class Bare(torch.nn.Module):
        def __init__(self, numel: int) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(numel))

    with Init(config_dict_or_path={}):
        model = Bare(KEEP_CONSTRUCTED_NUMEL + 1)
    with pytest.raises(ZeroInitError, match="param_init_fn"):
        materialise(model, model, list(model.parameters()), "root")

    with Init(config_dict_or_path={}):
        model = Bare(3)
    materialise(model, model, list(model.parameters()), "root")
    assert torch.equal(model.scale.detach(), torch.ones(3))

    with Init(config_dict_or_path={}, param_init_fn=lambda m: torch.nn.init.constant_(
            m.scale, 2.0) if isinstance(m, Bare) else None):
        model = Bare(KEEP_CONSTRUCTED_NUMEL + 1)
    materialise(model, model, list(model.parameters()), "root")
    assert torch.equal(model.scale.detach(), torch.full((KEEP_CONSTRUCTED_NUMEL + 1,), 2.0))


def test_an_hf_model_inside_a_wrapper_gets_hf_init() -> None:
    """A wrapper without ``_init_weights`` (a LightningModule's ``configure_model``, a head
    around a backbone) built under Init: the HF model's units get HF's own init, exactly
    as the bare model's, and the wrapper's own layers their ``reset_parameters``."""
    from trainer.zero.init import materialise

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(gpt2_config())
            self.head = torch.nn.Linear(32, 3)

    with Init(config_dict_or_path={}):
        wrapped = Wrapper()
        bare = transformers.GPT2LMHeadModel(gpt2_config())
    block = wrapped.gpt.transformer.h[0]
    materialise(wrapped, block, list(block.parameters()), "gpt.transformer.h.0")
    materialise(bare, bare.transformer.h[0], list(bare.transformer.h[0].parameters()),
                "gpt.transformer.h.0")
    for (name, ours), theirs in zip(block.named_parameters(),
                                    bare.transformer.h[0].parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    std = gpt2_config().initializer_range
    assert abs(block.mlp.c_fc.weight.std().item() - std) < std / 4  # HF's normal init
    materialise(wrapped, wrapped, [wrapped.head.weight, wrapped.head.bias], "<root>")
    assert wrapped.head.weight.abs().max() <= 32 ** -0.5  # Linear.reset_parameters' bound
    assert wrapped.head.weight.std() > 0.05


def test_weight_normed_modules_get_the_plain_modules_init() -> None:
    """A module parametrized under Init (``weight_norm``, as Wav2Vec2's positional conv)
    keeps its magnitude and direction as ``original0``/``original1``: its init now runs
    on the plain weight and the parametrization takes it apart (``right_inverse``), so
    the weight is the plain module's, draw for draw. They were left as whatever bytes
    the allocator had (Wav2Vec2 from a config trained on NaN)."""
    from trainer.zero.init import materialise

    def build(normed: bool) -> torch.nn.Module:
        with Init(config_dict_or_path={}, seed=5):
            model = torch.nn.Sequential(torch.nn.Linear(16, 16))
            if normed:
                torch.nn.utils.parametrizations.weight_norm(model[0])
        materialise(model, model, list(model.parameters()), "root")
        return model

    plain, normed = build(False), build(True)
    assert torch.equal(normed[0].bias, plain[0].bias)
    with torch.no_grad():
        torch.testing.assert_close(normed[0].weight, plain[0].weight)


class Partial(torch.nn.Module):
    """reset_parameters() writes ``weight`` only: ``scale`` keeps its constructor's value
    (as CLIP's ``logit_scale``), ``extra`` (large, ``torch.empty``) gets nothing."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(3))
        self.scale = torch.nn.Parameter(torch.full((2,), 2.5))
        if extra:
            self.extra = torch.nn.Parameter(torch.empty(KEEP_CONSTRUCTED_NUMEL + 1))

    def reset_parameters(self) -> None:
        torch.nn.init.uniform_(self.weight)


def test_parameters_no_init_covers_keep_their_values_or_are_refused() -> None:
    """Built under Init, a parameter the model's init leaves alone had no values (training
    started from stale allocator bytes; CLIP's ``logit_scale``): a small one now keeps the
    value it was constructed with, as an eager build does, and a large one is refused at
    ``initialize``, naming its shape and the way out."""
    config = base_config(zero_optimization={"stage": 3}, units={})
    with Init(config_dict_or_path={}):
        model = Partial(extra=False)
    engine, *_ = trainer.initialize(model=model, config=config)
    with GatheredParameters(list(model.parameters())):
        assert torch.equal(model.scale.detach().cpu(), torch.full((2,), 2.5))
        assert torch.isfinite(model.weight).all()
    engine.close()
    with Init(config_dict_or_path={}):
        model = Partial(extra=True)
    with pytest.raises(ZeroInitError, match=rf"1 parameter\(s\) of unit <root> .*"
                                            rf"\({KEEP_CONSTRUCTED_NUMEL + 1},\)"):
        trainer.initialize(model=model, config=config)


def _wav2vec2_from_config(rank: int, world: int) -> dict[str, Any]:
    import trainer.hf

    trainer.hf.install()
    return _train_wav2vec2_from_config()


def _train_wav2vec2_from_config() -> dict[str, Any]:
    import deepspeed
    from test_external_params import _speech, _wav2vec2_config
    from transformers.integrations import HfDeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    hf_config = HfDeepSpeedConfig(config)  # noqa: F841  - kept alive: ZeRO-3 _from_config
    model = transformers.Wav2Vec2ForCTC._from_config(_wav2vec2_config())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    conv = model.wav2vec2.encoder.pos_conv_embed.conv
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        magnitude = conv.parametrizations.weight.original0.detach().clone()
        direction = conv.parametrizations.weight.original1.detach().clone()
    losses = []
    for step in range(2):
        inputs, labels = _speech(step, 0)
        loss = engine(input_values=inputs.to(engine.device), labels=labels.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return {"magnitude": magnitude, "direction": direction, "losses": losses}


def test_wav2vec2_from_a_config_under_zero3_trains_on_a_weight_normed_conv() -> None:
    result = run_ranks(_wav2vec2_from_config, 1)[0]
    direction = result["direction"]
    # weight norm over dim 2: the magnitude is the direction's norm over the other dims
    expected = direction.norm(dim=(0, 1), keepdim=True)
    torch.testing.assert_close(result["magnitude"], expected)
    assert torch.isfinite(direction).all() and direction.std() > 0
    assert all(torch.isfinite(torch.tensor(result["losses"])))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(24, 24)
        self.norm = torch.nn.LayerNorm(24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)) + x)


def _no_decay_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The README's groups: matrices decay, vectors (biases, norms) do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _groups_under_init(rank: int, world: int) -> dict[str, Any]:
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    config = base_config(zero_optimization={"stage": 3}, units={"module_classes": ["_Block"]},
                         optimizer={"type": "AdamW", "params": {"lr": 1e-2,
                                                                "weight_decay": 0.5}})
    with Init(config_dict_or_path=config, seed=3):
        model = torch.nn.Sequential(*(_Block() for _ in range(3)), torch.nn.Linear(24, 4))
    engine, *_ = trainer.initialize(model=model, config=config,
                                    model_parameters=_no_decay_groups(model))
    initial = consolidate_fp32_state_dict(engine)
    for step in range(3):
        x = torch.randn(4, 24, generator=torch.Generator().manual_seed(step * 2 + rank))
        loss = engine(x.to(engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    final = consolidate_fp32_state_dict(engine)
    engine.close()
    return {"initial": initial, "final": final}


def test_readme_no_decay_groups_under_init_split_a_linear_across_units() -> None:
    """Stage 3 under Init with the README's decay/no-decay groups puts each Linear's weight
    and bias in two units: the bias's unit ran ``Linear.reset_parameters`` again, which
    reads the weight's fan-in, after the weight's unit had been partitioned and released
    ("Fan in and fan out can not be computed"). Both get the plain module's bounds and the
    run trains as torch AdamW with the same groups."""
    results = run_ranks(_groups_under_init, 2)
    initial = results[0]["initial"]
    for name, value in initial.items():
        assert torch.isfinite(value).all(), name
        if name.endswith("fc.weight") or name.endswith("fc.bias"):
            assert value.abs().max() <= 24 ** -0.5 and value.std() > 0.05, name
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones(24))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(_Block() for _ in range(3)), torch.nn.Linear(24, 4))
    model = model.to_empty(device="cpu")
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(_no_decay_groups(model), lr=1e-2, weight_decay=0.5)
    for step in range(3):
        x = torch.cat([torch.randn(4, 24, generator=torch.Generator().manual_seed(step * 2 + r))
                       for r in range(2)])
        losses = [model(part).pow(2).mean() for part in x.split(4)]
        optimizer.zero_grad()
        (sum(losses) / 2).backward()
        optimizer.step()
    expected = dict(model.state_dict())
    assert max_relative_error(results[0]["final"], expected) < 1e-5
    assert not torch.equal(results[0]["final"]["0.fc.weight"], initial["0.fc.weight"])


def test_torch_transformer_layers_get_their_constructors_init() -> None:
    """torch's ``MultiheadAttention`` has no ``reset_parameters`` (its constructor runs
    ``_reset_parameters``: refused before), and ``nn.Transformer``'s constructor
    re-initialises every matrix its layers built with Xavier: unit by unit, each unit
    gets what the eager constructors give, in distribution."""
    config = base_config(zero_optimization={"stage": 3},
                         units={"module_classes": ["TransformerEncoderLayer",
                                                   "TransformerDecoderLayer"]})

    def build() -> torch.nn.Module:
        return torch.nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2,
                                    num_decoder_layers=2, dim_feedforward=256, dropout=0.0,
                                    batch_first=True)

    torch.manual_seed(0)
    eager = build()
    with Init(config_dict_or_path=config):
        model = build()
    engine, *_ = trainer.initialize(model=model, config=config)
    with GatheredParameters(list(model.parameters())):
        ours = {name: param.detach().cpu().clone() for name, param in model.named_parameters()}
    engine.close()
    for name, reference in eager.named_parameters():
        value = ours[name]
        assert torch.isfinite(value).all(), name
        if reference.dim() > 1:  # Xavier over the whole model (Linear's own: 1/sqrt(fan-in))
            bound = (6 / sum(reference.shape[:2])) ** 0.5
            assert value.abs().max() <= bound, name
            assert value.abs().max() > 0.9 * reference.abs().max(), name
        elif torch.all(reference == reference.flatten()[0]):  # zero biases, unit norms
            assert torch.equal(value, reference), name
        else:  # Linear biases: uniform within their fan-in's bound, as the eager draw
            assert 0.8 < value.abs().max() / reference.abs().max() < 1.25, name


def test_init_of_a_built_module_keeps_its_values_for_initialize() -> None:
    """``deepspeed.zero.Init(module=model)`` converts a model built already (DeepSpeed's
    docs; it was refused): the model is left as it is and ``initialize`` partitions it
    with the values it was built with."""
    config = base_config(zero_optimization={"stage": 3}, units={})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    built = {name: value.detach().clone() for name, value in model.state_dict().items()}
    Init(module=model, config_dict_or_path=config)
    engine, *_ = trainer.initialize(model=model, config=config)
    assert consolidate_fp32_state_dict(engine).keys() == built.keys()
    for name, value in consolidate_fp32_state_dict(engine).items():
        assert torch.equal(value, built[name]), name
    engine.close()
