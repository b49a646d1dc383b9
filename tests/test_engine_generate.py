"""HF ``generate`` through a ZeRO-3 engine (parameters offloaded to the daemon), as a
DeepSpeed user runs it (``engine.module.generate``) and as HF's Trainer does when it
predicts with generation: 2 gloo ranks ask for different numbers of new tokens, so the
rank that finishes first keeps running forward passes (``synced_gpus=True``) while the
other still gathers every unit; greedy tokens must equal plain torch's ``generate`` on the
same weights. An engine with an optimizer (after a training step) and one without
(``inference=True``), under ``no_grad`` and ``torch.inference_mode``, on the strict device
twin (HF's generation tensors on the device, as on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dist import run_ranks, shared_daemon, tiny_gpt2

import trainer

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.slow

PROMPT = 5


def _model() -> Any:
    return tiny_gpt2(3)


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(1, 97, (2, PROMPT), generator=torch.Generator().manual_seed(rank))


def _new_tokens(rank: int) -> int:
    return 3 + 5 * rank


def generate_rank(rank: int, world: int) -> dict[bool, dict[str, Any]]:
    """Both engines in turn on the same pair of ranks (one spawn: the imports are most of
    a rank's time)."""
    with shared_daemon(rank, None) as socket_path:
        return {inference: _generate(rank, socket_path, inference)
                for inference in (True, False)}


def _generate(rank: int, socket_path: str, inference: bool) -> dict[str, Any]:
    model = _model()
    offload = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "units": {"module_classes": ["GPT2Block"]},
        "zero_optimization": {"stage": 3, "offload_param": offload,
                              "offload_optimizer": offload},
        "offloadd": {"socket": socket_path, "job": f"generate-{inference}",
                     "arena_size": 16 << 20}}
    if not inference:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    engine, _, _, _ = trainer.initialize(model=model, config=config, inference=inference)
    try:
        device = engine.collectives.device
        if not inference:  # a training step first: generate sees the stepped weights
            ids = _prompt(10 + rank).to(device)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.eval()
        outputs = {}
        for mode, context in (("no_grad", torch.no_grad), ("inference", torch.inference_mode)):
            with context():
                outputs[mode] = engine.module.generate(
                    _prompt(rank).to(device), max_new_tokens=_new_tokens(rank),
                    do_sample=False, synced_gpus=True, pad_token_id=0).cpu()
        weights = {name: value.detach().cpu().clone()
                   for name, value in _gathered_state(engine).items()}
    finally:
        engine.destroy()
    return {"outputs": outputs, "weights": weights, "device": str(device)}


@pytest.fixture(scope="module")
def generated() -> Iterator[list[dict[bool, dict[str, Any]]]]:
    with pytest.MonkeyPatch.context() as patch:  # the strict twin, for the ranks
        patch.setenv("OFFLOADD_COPY_ENGINE", "twin")
        patch.setenv("OFFLOADD_TWIN_DEVICE", "strict")
        yield run_ranks(generate_rank, 2)


def _gathered_state(engine: Any) -> dict[str, torch.Tensor]:
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    return consolidate_fp32_state_dict(engine)


@pytest.mark.parametrize("inference", [True, False], ids=["inference", "trained"])
def test_generate_through_a_stage_3_engine_matches_plain_torch(
        generated: list[dict[bool, dict[str, Any]]], inference: bool) -> None:
    results = [by_engine[inference] for by_engine in generated]
    reference = _model()
    reference.load_state_dict(results[0]["weights"])  # the weights generate ran on
    reference.eval()
    for rank, result in enumerate(results):
        assert result["device"] == "twin:0"
        with torch.no_grad():
            expected = reference.generate(_prompt(rank), max_new_tokens=_new_tokens(rank),
                                          do_sample=False, pad_token_id=0)
        assert expected.shape[1] == PROMPT + _new_tokens(rank)
        for mode, tokens in result["outputs"].items():
            assert torch.equal(tokens, expected), (rank, mode)
