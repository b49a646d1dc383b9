"""Property test over the config space users combine (issue 19, item 7).

Each example draws: HF Llama or GPT-2 (tiny, from a config) or a plain-torch LM of
``nn.TransformerEncoderLayer`` blocks x ZeRO stage 0-3 x
offload none / cpu / nvme x README's no-decay param groups x stage-3 prefetch
bucket (0, small, default) x gradient accumulation 1 / 3 x clipping x bf16 /
fp16 (dynamic loss scaling) / fp32 x HF activation checkpointing x a frozen first
block x built under ``zero.Init`` x stage 3's ``stage3_max_live_parameters`` below one
block x a job arena that holds the state or one that forces swapping x Twin-Flow's
``ratio`` (all offloaded, or half kept on the device) x an evaluation
before every micro-step and after the last (none, under ``torch.no_grad``, or under
``torch.inference_mode`` as Lightning validates on NCCL and as ``generate`` runs).
It trains on 2 gloo ranks on the strict device twin (one pair of long-lived rank
processes runs every example, with one shared daemon) and is compared with single-process torch
AdamW from the same initial weights: the losses of every micro-step, the final
parameters and every evaluation loss (see ``check`` for the tolerances of fp32 and
of bf16, which runs forward/backward in bf16 against an fp32 reference).

CI runs a fixed, seeded sample (``derandomize``) of ``OFFLOADD_PROPERTY_EXAMPLES``
examples (default 5) plus the two explicit ``@example`` cases; set the variable
higher for a larger sample.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _dist import STRICT_TWIN, SharedDaemon, lm_adamw_run, lm_tokens, max_relative_error, rank_pools

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("OFFLOADD_PROPERTY_EXAMPLES", "5"))
STEPS = 2
LR = 3e-3
WEIGHT_DECAY = 0.1
CLIP = 0.05
"""Small enough that clipping is active on these models."""
SMALL_BUCKET = 5_000
ROOMY_ARENA = 64 << 20
TIGHT_ARENA = 2 << 20
"""The smallest job arena (one huge page), below these models' ~2.5 MB of state."""
VOCAB = 128
TIGHT_LIVE = 1_000
"""Elements: below one block of these models (~50k)."""


@dataclass(frozen=True)
class Case:
    model: str
    stage: int
    offload: str
    groups: bool
    bucket: str
    accumulation: int
    clip: bool
    bf16: bool
    checkpointing: bool
    frozen: bool
    zero_init: bool
    tight_arena: bool
    ratio: float = 1.0
    """``offload_optimizer.ratio``: below 1, the first units' optimizer stays on the device."""
    fp16: bool = False
    """fp16 with dynamic loss scaling instead (``bf16`` false then)."""
    evaluate: str = "none"
    """An eval-mode forward before each micro-step and at the end: ``none``, ``no_grad``
    or ``inference`` (``torch.inference_mode``)."""
    tight_live: bool = False
    """Stage 3 with ``stage3_max_live_parameters`` below one block: every unit is released
    after its forward and gathered again for its backward, nothing is held or prefetched."""


@st.composite
def cases(draw: Any) -> Case:
    stage = draw(st.integers(0, 3))
    offload = draw(st.sampled_from(["none", "cpu", "nvme"])) if stage else "none"
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    return Case(model=draw(st.sampled_from(["llama", "gpt2", "torch"])), stage=stage,
                offload=offload,
                groups=draw(st.booleans()),
                bucket=draw(st.sampled_from(["zero", "small", "default"])),
                accumulation=draw(st.sampled_from([1, 3])), clip=draw(st.booleans()),
                bf16=precision == "bf16", fp16=precision == "fp16",
                checkpointing=draw(st.booleans()),
                frozen=draw(st.booleans()), zero_init=draw(st.booleans()),
                tight_arena=offload == "nvme" and draw(st.booleans()),
                ratio=draw(st.sampled_from([1.0, 0.5])) if offload != "none" else 1.0,
                evaluate=draw(st.sampled_from(["none", "no_grad", "inference"])),
                tight_live=stage == 3 and draw(st.booleans()))


def hf_config(name: str) -> Any:
    if name == "llama":
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32)
    return transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB,
                                   n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


class TorchLM(torch.nn.Module):
    """A causal LM of torch's own layers (``nn.TransformerEncoderLayer``: its
    ``MultiheadAttention`` has only ``_reset_parameters``), called as HF's are."""

    def __init__(self) -> None:
        super().__init__()
        width = 64
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(16, width))
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True,
                                             norm_first=True) for _ in range(3))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB, bias=False)
        self.checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        self.checkpointing = True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.position[:length]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(length, device=x.device)
        for layer in self.layers:
            if self.checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, mask, None, True,
                                                      use_reentrant=False)
            else:
                x = layer(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def build_model(case: Case, config: dict[str, Any] | None = None) -> Any:
    """The model, built under ``zero.Init`` when the case (and a config) says so."""
    import trainer

    torch.manual_seed(0)

    def construct() -> torch.nn.Module:
        if case.model == "torch":
            return TorchLM()
        cls = (transformers.LlamaForCausalLM if case.model == "llama"
               else transformers.GPT2LMHeadModel)
        return cls(hf_config(case.model))

    if case.zero_init and config is not None:
        with trainer.zero.Init(config_dict_or_path=config):
            model = construct()
    else:
        model = construct()
    if case.frozen:
        for param in first_block(model).parameters():
            param.requires_grad_(False)
    return model


def first_block(model: Any) -> Any:
    if isinstance(model, TorchLM):
        return model.layers[0]
    return model.model.layers[0] if hasattr(model, "model") else model.transformer.h[0]


ZERO_GRADIENT = ("c_attn.bias", "self_attn.in_proj_bias")
"""Attention biases whose key part has an exactly-zero true gradient (softmax is shift
invariant): Adam turns their float noise into lr-sized steps (see test_engine_hf)."""


def param_groups(case: Case) -> Any:
    """README's no-decay groups over the trainable parameters (or one group)."""
    def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not case.groups:
            return [{"params": trainable}]
        return [{"params": [p for p in trainable if p.ndim >= 2]},
                {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    return groups


def tokens(step: int, rank: int) -> torch.Tensor:
    """``lm_tokens`` whose last token also appears first (a token seen only last has an
    exactly-zero true embedding gradient, whose float noise Adam would amplify)."""
    ids = lm_tokens(step, rank, vocab=VOCAB)
    ids[:, -1] = ids[:, 0]
    return ids


def probe_tokens(rank: int) -> torch.Tensor:
    """Rank ``rank``'s evaluation batch (never trained on)."""
    return tokens(1000, rank)


def evaluation(engine: Any, mode: str, rank: int) -> list[float]:
    """The evaluation loss of this rank's probe batch in eval mode under ``mode``'s grad
    context, the engine back in train mode after; ``[]`` for ``none``."""
    if mode == "none":
        return []
    context = torch.inference_mode() if mode == "inference" else torch.no_grad()
    engine.eval()
    with context:
        ids = probe_tokens(rank)
        loss = engine(input_ids=ids.to(engine.collectives.device), labels=ids.to(
            engine.collectives.device)).loss.item()
    engine.train()
    return [loss]


def ds_config(case: Case, swap_dir: str, socket_path: str, job: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case.stage}
    if case.offload != "none":
        zero["offload_optimizer"] = {"device": case.offload, "nvme_path": swap_dir,
                                     "ratio": case.ratio}
        if case.stage == 3:
            zero["offload_param"] = {"device": case.offload, "nvme_path": swap_dir}
    if case.bucket != "default":
        zero["stage3_prefetch_bucket_size"] = 0 if case.bucket == "zero" else SMALL_BUCKET
    if case.tight_live:
        zero["stage3_max_live_parameters"] = TIGHT_LIVE
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": case.accumulation,
        "gradient_clipping": CLIP if case.clip else 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "bf16": {"enabled": case.bf16},
        # a loss scale these small models' fp16 gradients never overflow at: a skipped
        # step would be right, but the fp32 reference has none to compare with
        "fp16": {"enabled": case.fp16, "initial_scale_power": 8},
        "zero_optimization": zero}
    if case.offload != "none":
        config["offloadd"] = {"socket": socket_path, "job": job,
                              "arena_size": TIGHT_ARENA if case.tight_arena else ROOMY_ARENA}
    return config


# ------------------------------------------------------------------ rank side


def train_case(rank: int, world: int, shared: SharedDaemon, case_fields: dict[str, Any]
               ) -> dict[str, Any]:
    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict
    from trainer.zero.param_state import full_fp32_param

    case = Case(**case_fields)
    shared.examples += 1
    config = ds_config(case, shared.swap_dir, shared.socket_path, f"example{shared.examples}")
    model = build_model(case, config)
    if case.checkpointing:
        model.gradient_checkpointing_enable()
    engine, _, _, _ = trainer.initialize(model=model, config=config,
                                         model_parameters=param_groups(case)(model))
    try:
        assert engine.collectives.device.type == "twin", engine.collectives.device
        initial = consolidate_fp32_state_dict(engine)
        losses, probes = [], []
        for micro in range(STEPS * case.accumulation):
            probes += evaluation(engine, case.evaluate, rank)
            ids = tokens(micro, rank).to(engine.collectives.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        probes += evaluation(engine, case.evaluate, rank)
        final = consolidate_fp32_state_dict(engine)
        # DeepSpeed's per-parameter read (safe_get_full_fp32_param) is the consolidated
        # master, bit for bit, whatever the example; None for frozen parameters.
        for name, param in model.named_parameters():
            value = full_fp32_param(param)
            if not param.requires_grad:
                assert value is None, name
            elif name in final:
                assert value is not None and torch.equal(value.cpu(), final[name]), name
        stats = engine.offload_stats() if case.offload != "none" else {}
    finally:
        engine.close()
    swapped = {key: value for key, value in stats.items()
               if "swap" in key or "nvme" in key or "evict" in key}
    return {"initial": initial, "final": final, "losses": losses, "probes": probes,
            "swapped": swapped}


# ------------------------------------------------------------------ parent side


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    with rank_pools(2, SharedDaemon, STRICT_TWIN) as get:  # the ranks on the strict twin
        yield get


def reference(case: Case, initial: dict[str, torch.Tensor],
              dtype: torch.dtype = torch.float32,
              probes: list[list[float]] | None = None) -> Any:
    model = build_model(case)
    model.load_state_dict(initial)
    model.to(dtype)
    return lm_adamw_run(model, STEPS, tokens, LR, WEIGHT_DECAY, param_groups=param_groups(case),
                        accumulation=case.accumulation, clip=CLIP if case.clip else 0.0,
                        probes=probes,
                        probe_tokens=probe_tokens if case.evaluate != "none" else None)


def update_cosine(initial: dict[str, torch.Tensor], ours: dict[str, torch.Tensor],
                  expected: dict[str, torch.Tensor]) -> float:
    """Cosine similarity of our whole-model update with the reference's."""
    names = sorted(expected)
    delta = torch.cat([(ours[n].float() - initial[n].float()).flatten() for n in names])
    reference_delta = torch.cat([(expected[n].float() - initial[n].float()).flatten()
                                 for n in names])
    return float(torch.nn.functional.cosine_similarity(delta, reference_delta, dim=0))


def check(case: Case, ranks: list[dict[str, Any]]) -> None:
    """fp32: parameters within 5e-5 of the reference (relative to each tensor's largest
    value). bf16 (and fp16) trains in bf16 against an fp32 reference: where a gradient is near zero
    Adam turns rounding into lr-sized steps of either sign, so the parameters are held to
    the update's direction (cosine >= 0.95) and to 2 lr per step of any element."""
    initial = ranks[0]["initial"]
    expected_probes: list[list[float]] = []
    expected, expected_losses = reference(case, initial, probes=expected_probes)
    final = ranks[0]["final"]
    exact = {name: value for name, value in expected.items()
             if not any(part in name for part in ZERO_GRADIENT)}
    if case.bf16 or case.fp16:
        cosine = update_cosine(initial, final, exact)
        assert cosine >= 0.95, (case, cosine)
    else:
        ours = {name: final[name] for name in exact}
        error = max_relative_error(ours, exact)
        if error >= 5e-5:
            # Where gradients nearly cancel over accumulated micro-batches and clipping
            # scales them down, Adam turns fp32 rounding into visible steps: the fp32
            # reference itself is then that far from the exact result (llama, stage 0,
            # accumulation 3, clipping: ours 6.1e-5 from it, both ~7e-5 from fp64). Held
            # to fp64 then: no farther from it than the fp32 reference, with margin.
            precise = reference(case, initial, torch.float64)[0]
            precise = {name: precise[name] for name in exact}
            ours_off = max_relative_error(ours, precise)
            reference_off = max_relative_error(exact, precise)
            assert ours_off <= 2 * reference_off + 5e-5, (case, error, ours_off, reference_off)
    for name in expected:
        worst = (final[name] - expected[name]).abs().max().item()
        assert worst <= 2 * LR * STEPS, (case, name, worst)
    if case.frozen:
        for name, value in initial.items():
            if any(f"{prefix}.0." in f".{name}" for prefix in (".layers", ".h")):
                assert torch.equal(final[name], value), (case, name)
    tolerance = 3e-2 if case.bf16 or case.fp16 else 1e-5
    for rank, result in enumerate(ranks):
        ours = torch.tensor(result["losses"])
        theirs = torch.tensor([micro[rank] for micro in expected_losses])
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=0,
                                   msg=lambda m, rank=rank: f"{case} rank {rank}: {m}")
        probes = torch.tensor(result["probes"])
        expected_rank = torch.tensor([probe[rank] for probe in expected_probes])
        torch.testing.assert_close(probes, expected_rank, rtol=tolerance, atol=0,
                                   msg=lambda m, rank=rank: f"{case} rank {rank} eval: {m}")


ITEM_1 = Case(model="llama", stage=3, offload="nvme", groups=True, bucket="default",
              accumulation=1, clip=False, bf16=False, checkpointing=False, frozen=False,
              zero_init=False, tight_arena=False)
"""Issue 19's crash: README's groups + NVMe + default prefetch."""
EVERYTHING = Case(model="gpt2", stage=3, offload="nvme", groups=True, bucket="default",
                  accumulation=3, clip=True, bf16=True, checkpointing=True, frozen=True,
                  zero_init=True, tight_arena=True, ratio=0.5, evaluate="inference")
"""The issue's whole recipe at once, with swapping, half the optimizer on the device
(Twin-Flow), speculative steps that clipping reverts, and evaluations under
``torch.inference_mode`` between the micro-steps."""
EVALUATE = Case(model="llama", stage=3, offload="cpu", groups=False, bucket="default",
                accumulation=1, clip=False, bf16=False, checkpointing=False, frozen=False,
                zero_init=False, tight_arena=False, evaluate="inference")
"""Evaluation under ``torch.inference_mode`` (Lightning's validation on NCCL): the copy
into a partition buffer first allocated there failed ("Inplace update to inference
tensor outside InferenceMode")."""
PRECISION = Case(model="llama", stage=0, offload="none", groups=False, bucket="zero",
                 accumulation=3, clip=True, bf16=False, checkpointing=False, frozen=False,
                 zero_init=False, tight_arena=False)
"""Found by a random sample: fp32 rounding alone puts the reference 6.1e-5 from ours
(``check`` asks fp64 then)."""

TORCH_LAYERS = Case(model="torch", stage=3, offload="cpu", groups=True, bucket="small",
                    accumulation=1, clip=False, bf16=False, checkpointing=True, frozen=False,
                    zero_init=True, tight_arena=False, evaluate="no_grad")
"""torch's own layers under zero.Init with the README's groups: ``MultiheadAttention`` has
no ``reset_parameters`` (refused), and a ``Linear`` split over two units re-read its
released weight (initialize failed)."""


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@example(case=ITEM_1)
@example(case=EVERYTHING)
@example(case=PRECISION)
@example(case=EVALUATE)
@example(case=TORCH_LAYERS)
@given(case=cases())
def test_training_matches_torch_adamw(case: Case, pool: Any) -> None:
    ranks = pool().run(train_case, asdict(case))
    check(case, ranks)
    if case.tight_arena:
        assert any(ranks[0]["swapped"].values()), ranks[0]["swapped"]
