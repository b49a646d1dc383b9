"""Parameters a unit's forward uses that another unit owns (``trainer.zero.external``),
against plain torch.

DeepSpeed's ZeRO-3 tutorial has a parent module reuse its child's weight after the child
ran; models also read a later block's weight before that block runs, or keep a parameter
in a module that is never called. Under stage 3 with ``stage3_max_live_parameters`` so
small that every unit is released after its forward, such reads met an empty tensor
(``size mismatch``). 2 gloo ranks on the strict twin train ``ExternalNet`` (all of those
uses, a frozen parameter used from another unit, the user's block recomputed by activation
checkpointing, in one case each module split into a unit per parameter group) and must
end where a single-process torch AdamW on the union of their micro-batches ends. One use
is declared the tutorial's way, through the facade's
``deepspeed.zero.register_external_parameter``, one through ``GatheredParameters``'
``fwd_module`` (as PEFT passes it), and are never gathered on demand; the others are
found once each, on the first pass. An evaluation forward afterwards gives
torch's outputs and leaves nothing gathered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist import adamw_steps, base_config, run_ranks, shared_daemon
from torch.utils.checkpoint import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

WIDTH = 6
WORLD = 2
STEPS = 3
ACCUMULATION = 2
FOUND_ON_DEMAND = 2
"""Uses ``ExternalNet``'s first pass gathers on demand: layer2 reads the bank's two units
(trainable and frozen). layer3 reads the bank while layer2's use still holds it; the
root's reuse of layer1 is declared in ``__init__`` and layer2's read of layer3's weight
through ``GatheredParameters(fwd_module=layer2)`` after ``initialize``."""


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.peer: Layer | None = None
        self.bank: Bank | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(hidden))
        if self.peer is not None:  # a later unit's weight, before that unit runs
            out = out + hidden @ self.peer.lin.weight.t()
        if self.bank is not None:  # a never-called module's parameters
            out = out * self.bank.scale + self.bank.shift
        return out


class Bank(torch.nn.Module):
    """Holds parameters other units read; its own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.shift = torch.nn.Parameter(torch.linspace(-0.1, 0.1, WIDTH), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("never called")


class ExternalNet(torch.nn.Module):
    def __init__(self, register: Callable[[torch.nn.Module, torch.nn.Parameter], None] | None,
                 recompute: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(7, WIDTH)
        self.layer1, self.layer2, self.layer3 = Layer(), Layer(), Layer()
        self.bank = Bank()
        self.head = torch.nn.Linear(WIDTH, 5)
        self.recompute = recompute
        # plain attributes, not submodules: the parameters keep one owner each
        object.__setattr__(self.layer2, "peer", self.layer3)
        object.__setattr__(self.layer2, "bank", self.bank)
        object.__setattr__(self.layer3, "bank", self.bank)
        if register is not None:  # the tutorial's declaration of the parent's reuse
            register(self, self.layer1.lin.weight)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.layer1(self.inp(features))
        second = (checkpoint(self.layer2, hidden, use_reentrant=False) if self.recompute
                  else self.layer2(hidden))
        hidden = second + hidden @ self.layer1.lin.weight.t()  # the parent reuses its child's
        hidden = self.layer3(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden).float(), labels)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 7, generator=generator), torch.randint(0, 5, (4,), generator=generator)


def _config(device: str, socket: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_max_live_parameters": 64,
                            "stage3_prefetch_bucket_size": 0}
    config = base_config(zero_optimization=zero, gradient_accumulation_steps=ACCUMULATION,
                         units={"module_classes": ["Layer", "Bank"]})
    if device != "none":
        zero["offload_param"] = zero["offload_optimizer"] = {"device": device}
        config["offloadd"] = {"socket": socket, "job": f"external-{device}",
                              "arena_size": 8 << 20}
    return config


def _groups(model: torch.nn.Module, split: bool) -> list[dict[str, Any]]:
    """README's no-decay groups (each module then has a unit per group) or one group."""
    params = list(model.parameters())
    if not split:
        return [{"params": params}]
    return [{"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _run(rank: int, world: int, device: str, recompute: bool, groups: bool) -> dict[str, Any]:
    import trainer.hf

    trainer.hf.install()  # deepspeed.zero is offloadd's in this rank, as in a user's script
    return _train(rank, device, recompute, groups)


def _train(rank: int, device: str, recompute: bool, groups: bool) -> dict[str, Any]:
    from deepspeed.zero import GatheredParameters, register_external_parameter

    import trainer
    with shared_daemon(rank, enabled=device != "none") as socket:
        model = ExternalNet(register_external_parameter, recompute)
        engine, *_ = trainer.initialize(model=model, model_parameters=_groups(model, groups),
                                        config=_config(device, socket))
        assert engine.external is not None
        with GatheredParameters([model.layer3.lin.weight], fwd_module=model.layer2):
            pass
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                batch = [t.to(engine.device) for t in _batch(step, micro, rank)]
                engine.backward(engine(*batch))
                engine.step()
            if step == 0:
                first_pass_found = engine.external.num_found
        engine.eval()
        with torch.no_grad():
            eval_loss = engine(*[t.to(engine.device) for t in _batch(99, 0, rank)]).item()
        live_after_eval = engine.placement.live_numel
        engine.train()
        state = {}
        with GatheredParameters(list(model.parameters())):
            for name, param in model.named_parameters():
                state[name] = param.detach().cpu().clone()
        plain = type(copy.deepcopy(model).__dict__["_parameters"]) is dict
        engine.close()
        return {"state": state, "eval_loss": eval_loss, "found": engine.external.num_found,
                "first_pass_found": first_pass_found, "live_after_eval": live_after_eval,
                "copy_is_plain": plain,
                "watched_after_close": type(model.__dict__["_parameters"]) is not dict}


def _reference(recompute: bool, groups: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = ExternalNet(None, recompute)
    adamw_steps(model, STEPS, lambda step, micro, rank: model(*_batch(step, micro, rank)),
                world_size=WORLD, accumulation=ACCUMULATION, params=_groups(model, groups))
    with torch.no_grad():
        model.eval()
        eval_losses = [model(*_batch(99, 0, rank)).item() for rank in range(WORLD)]
    return {name: param.detach().clone() for name, param in model.named_parameters()}, eval_losses


@pytest.mark.parametrize(("device", "recompute", "groups"),
                         [("none", True, True), ("cpu", False, False)])
def test_units_reading_other_units_parameters_train_as_torch(device: str, recompute: bool,
                                                             groups: bool) -> None:
    results = run_ranks(_run, WORLD, device, recompute, groups)
    reference, eval_losses = _reference(recompute, groups)
    for rank, result in enumerate(results):
        assert set(result["state"]) == set(reference)
        for name, expected in reference.items():
            torch.testing.assert_close(result["state"][name], expected, rtol=2e-5, atol=2e-6,
                                       msg=f"rank {rank} {name}")
        assert result["eval_loss"] == pytest.approx(eval_losses[rank], rel=1e-5, abs=1e-6)
        # found on the first pass, once each; the declared use never on demand
        assert result["first_pass_found"] == result["found"] == FOUND_ON_DEMAND
        assert result["live_after_eval"] == 0
        assert result["copy_is_plain"] and not result["watched_after_close"]


class SharedScaleNet(torch.nn.Module):
    """The root's ``scale`` is read by the head and, through a plain attribute, inside a
    block checkpointed reentrantly: it accumulates twice in one backward (the checkpoint
    runs a backward of its own), before the root's input layer gets its gradient."""

    def __init__(self, reentrant_reads_other_unit: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(7, WIDTH)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.layer1, self.layer2 = Layer(), Layer()
        self.head = torch.nn.Linear(WIDTH, 5)
        object.__setattr__(self.layer1, "bank", _ScaleOnly(self))
        if reentrant_reads_other_unit:  # layer1's recompute also reads layer2's weight
            object.__setattr__(self.layer1, "peer", self.layer2)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.layer1, self.inp(features), use_reentrant=True)
        hidden = self.layer2(hidden) * self.scale
        return torch.nn.functional.cross_entropy(self.head(hidden).float(), labels)


class _ScaleOnly:
    """What ``Layer`` reads as its bank: the root's scale, no shift."""

    def __init__(self, root: SharedScaleNet) -> None:
        self.root = root
        self.shift = 0.0

    @property
    def scale(self) -> torch.Tensor:
        return self.root.scale


def _run_shared(rank: int, world: int, reentrant_reads_other_unit: bool) -> Any:
    import trainer

    model = SharedScaleNet(reentrant_reads_other_unit)
    config = _config("none", "")
    config["gradient_accumulation_steps"] = 1
    engine, *_ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                    config=config)
    try:
        for step in range(STEPS):
            batch = [t.to(engine.device) for t in _batch(step, 0, rank)]
            engine.backward(engine(*batch))
            engine.step()
        with engine_gathered(model):
            return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    except Exception as error:  # the typed error, by name, for the test to check
        return type(error).__name__
    finally:
        engine.close()


def engine_gathered(model: torch.nn.Module) -> Any:
    from trainer.zero import GatheredParameters

    return GatheredParameters(list(model.parameters()))


def test_a_parameter_accumulated_twice_in_one_backward_counts_once() -> None:
    """Counted per accumulation, the root's unit was reduced and released one parameter
    early, and the input layer's backward met its released weight (``size mismatch``);
    the weights must be torch's."""
    _check_shared(run_ranks(_run_shared, WORLD, False), False)


def test_a_reentrant_recompute_reading_another_units_weight_trains_as_torch() -> None:
    """layer1's reentrant recompute reads layer2's weight after layer2's own backward:
    layer2's gradients were reduced before that part arrived (lost: training silently off
    by ~8%, then refused with LateGradientError). An owner of parameters other units read
    now hands its gradients on at the end of the backward."""
    _check_shared(run_ranks(_run_shared, WORLD, True), True)


def _check_shared(results: list[Any], reentrant_reads_other_unit: bool) -> None:
    model = SharedScaleNet(reentrant_reads_other_unit)
    adamw_steps(model, STEPS, lambda step, _micro, rank: model(*_batch(step, 0, rank)),
                world_size=WORLD)
    for rank, state in enumerate(results):
        for name, expected in model.named_parameters():
            torch.testing.assert_close(state[name], expected.detach(), rtol=2e-5, atol=2e-6,
                                       msg=f"rank {rank} {name}")


def _wav2vec2_config() -> Any:
    import transformers

    return transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, vocab_size=12, feat_extract_norm="group",
        mask_time_prob=0.0, layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0)


def _speech(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return (torch.randn(2, 1600, generator=generator),
            torch.randint(1, 12, (2, 5), generator=generator))


def _run_wav2vec2(rank: int, world: int, base: str) -> list[float]:
    import trainer.hf

    trainer.hf.install()
    return _train_wav2vec2(rank, base)


def _train_wav2vec2(rank: int, base: str) -> list[float]:
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 100}}
    hf_config = HfDeepSpeedConfig(config)  # noqa: F841  - kept alive: ZeRO-3 from_pretrained
    model = transformers.Wav2Vec2ForCTC.from_pretrained(base)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    losses = []
    for step in range(STEPS):
        inputs, labels = _speech(step, rank)
        loss = engine(input_values=inputs.to(engine.device), labels=labels.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def test_wav2vec2_declares_its_conv_weights_and_fine_tunes_under_zero3_as_torch(
        tmp_path: Any) -> None:
    """transformers' Wav2Vec2 (and HuBERT, WavLM, SEW, UniSpeech, SpeechT5, SeamlessM4T)
    calls ``deepspeed.zero.register_external_parameter`` for its weight-normed positional
    conv when ZeRO-3 is on: ``from_pretrained`` under the facade raised AttributeError.
    Fine-tuned from a checkpoint on 2 ranks, every unit released after its forward, the
    losses are torch's."""
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    torch.manual_seed(0)
    transformers.Wav2Vec2ForCTC(_wav2vec2_config()).save_pretrained(tmp_path / "base")
    ranks = run_ranks(_run_wav2vec2, WORLD, str(tmp_path / "base"))
    model = transformers.Wav2Vec2ForCTC.from_pretrained(tmp_path / "base")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    reference: list[list[float]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(WORLD):
            inputs, labels = _speech(step, rank)
            loss = model(input_values=inputs, labels=labels).loss
            (loss / WORLD).backward()
            reference[rank].append(loss.item())
        optimizer.step()
    for rank, losses in enumerate(ranks):
        assert losses == pytest.approx(reference[rank], rel=1e-5)


def test_registration_checks_its_arguments() -> None:
    from trainer.zero.external import register_external_parameter, unregister_external_parameter

    module = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Parameter"):
        register_external_parameter(module, torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        register_external_parameter(object(), module.weight)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="was not registered"):
        unregister_external_parameter(module, module.weight)
    register_external_parameter(module, module.bias)
    unregister_external_parameter(module, module.bias)
