"""Generation between training steps as TRL's online trainers (GRPO, Online DPO, RLOO) run
it under ZeRO-3: ``trl.models.utils.unwrap_model_for_generation`` gathers every parameter
with ``deepspeed.zero.GatheredParameters(model.parameters())``, then takes DeepSpeed's
parameter hooks off through ``model.optimizer.parameter_offload`` (it clears each
parameter's ``ds_active_sub_modules``, the module's and its ``ds_external_parameters()``,
and removes the ``forward_hooks`` / ``backward_hooks`` handles), generates with the
unwrapped model, and registers the hooks again (``_register_deepspeed_module``, by the
DeepSpeed version it reads). The same calls are made here in that order (TRL is not a
dependency of the suite).

Before: ``parameter_offload``, ``ds_active_sub_modules`` and ``ds_external_parameters``
did not exist (AttributeError). Now: 2 gloo ranks on the strict device twin, an
Accelerate loop over offloadd (``import trainer.hf``, ZeRO-3 with parameters and optimizer
offloaded to the module's daemon; HF activation checkpointing switched on through the
engine, ``engine.gradient_checkpointing_enable()``, as DeepSpeed-Chat does): a step, a
generation, a step. The greedy tokens equal
plain HF ``generate`` on the weights the first step made, the generation gathers no unit
(everything is held by ``GatheredParameters``), and the final weights equal two steps of
torch AdamW on both ranks' batches.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from _dist import max_relative_error, run_ranks, tiny_gpt2

# Hazard: not importorskip. The ranks import this module to find their function, and an
# accelerate imported there before the rank's `import trainer.hf` has already decided that
# DeepSpeed is absent (trainer.hf then refuses to start).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin"),
              pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in
                                         ("accelerate", "transformers")),
                                 reason="the hf extra is not installed")]

NEW_TOKENS = 4


def gpt2() -> Any:
    return tiny_gpt2(2)


def adamw(params: Any) -> torch.optim.AdamW:
    # eps above the float noise of GPT-2's key bias, whose true gradient is 0 (softmax
    # ignores a constant added to every key): at 1e-8 Adam turns that noise into full steps
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(1, 97, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def generate_as_trl(accelerator: Any, model: Any, prompt: torch.Tensor) -> tuple[Any, int]:
    """TRL's ``unwrap_model_for_generation`` (ZeRO-3, ``gather_deepspeed3_params=True``)
    around a greedy ``generate``; returns the tokens and the unit gathers it made."""
    import deepspeed
    from packaging import version

    assert accelerator.state.deepspeed_plugin.zero_stage == 3
    gathers = model.engine.placement.full
    with deepspeed.zero.GatheredParameters(model.parameters()):
        offload = model.optimizer.parameter_offload  # remove_hooks
        module = offload.module
        for _, param in [*module.named_parameters(), *module.ds_external_parameters()]:
            param.ds_active_sub_modules.clear()
        for handle in [*offload.forward_hooks, *offload.backward_hooks]:
            handle.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        before = gathers.num_gathers
        with torch.no_grad():
            out = accelerator.unwrap_model(model).generate(
                prompt.to(model.device), max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0)
        made = gathers.num_gathers - before
        if version.parse(deepspeed.__version__) >= version.parse("0.16.4"):  # add_hooks
            offload._register_deepspeed_module(offload.module)
        else:
            offload._register_hooks_recursively(offload.module)
    return out.cpu(), made


def step(accelerator: Any, model: Any, optimizer: Any, number: int, rank: int) -> None:
    ids = tokens(number, rank).to(model.device)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()


def trl_loop(rank: int, world: int, socket: str) -> dict[str, Any]:
    import trainer.hf  # noqa: F401  - the line an Accelerate script adds, first

    # isort: split
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    from trainer.state.checkpoint import consolidate_fp32_state_dict

    offload = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "offload_param": offload,
                                    "offload_optimizer": offload},
              "offloadd": {"socket": socket, "job": "trl", "arena_size": 16 << 20}}
    PartialState(cpu=True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = gpt2()
    optimizer = adamw(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    model.gradient_checkpointing_enable()  # the model's method, through the engine (DeepSpeed's)
    step(accelerator, model, optimizer, 0, rank)
    stepped = consolidate_fp32_state_dict(model.engine)
    generated, gathers = generate_as_trl(accelerator, model, tokens(7, rank)[:, :5])
    model.train()
    step(accelerator, model, optimizer, 1, rank)
    final = consolidate_fp32_state_dict(model.engine)
    model.engine.close()
    return {"stepped": stepped, "generated": generated, "gathers": gathers, "final": final}


def test_trl_style_generation_between_zero3_steps(daemon: Any) -> None:
    results = run_ranks(trl_loop, 2, str(daemon.socket_path))
    reference = gpt2()
    optimizer = adamw(reference.parameters())
    for number in range(2):
        if number == 1:  # greedy generate on the weights the first step made
            stepped = gpt2()
            stepped.load_state_dict(results[0]["stepped"])
            stepped.gradient_checkpointing_enable()  # as the engine's model: HF's generation
            stepped.train()  # differs in train mode with checkpointing (no KV cache, ...)
            for rank, result in enumerate(results):
                with torch.no_grad():
                    expected = stepped.generate(tokens(7, rank)[:, :5],
                                                max_new_tokens=NEW_TOKENS, do_sample=False,
                                                pad_token_id=0)
                assert torch.equal(result["generated"], expected), rank
                assert result["gathers"] == 0, rank
        optimizer.zero_grad()
        for rank in range(2):
            ids = tokens(number, rank)
            (reference(input_ids=ids, labels=ids).loss / 2).backward()
        optimizer.step()
        if number == 0:
            wanted = {k: v.detach().clone() for k, v in reference.state_dict().items()}
            assert max_relative_error(results[0]["stepped"], wanted) < 2e-5
    final = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    assert max_relative_error(results[0]["final"], final) < 2e-5
