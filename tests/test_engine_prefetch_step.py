"""Stage-3 prefetch against the optimizer step (issue 19, item 1), on 2 gloo ranks.

README's no-decay parameter groups split the HF root module into two units
(embeddings + head, final norm); the final norm sits early in the forward
order yet finishes its backward first, and the default prefetch gathered it
again in backward under a read lease on ``u1.param`` while its optimizer step
(through the daemon, NVMe offload) wanted to write it:
``LeaseConflictError`` at step 2-3. Two guards, each tested here:

- backward prefetch passes over units whose gradients are already final (a
  backward with every unit kept from forward gathers nothing);
- a unit's step starts only after any all-gather still reading its partition
  is finished (a gather left in flight before ``engine.step()`` is harmless).

Each run matches plain torch AdamW with the same groups.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from _dist import lm_adamw_run, lm_tokens, max_relative_error, run_ranks, shared_daemon
from test_engine_parity import HAS_NVME_TIER

import trainer
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero.gather import GatherState

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAS_NVME_TIER, reason="the daemon's NVMe tier is absent")]

STEPS = 4
LR = 3e-3
WEIGHT_DECAY = 0.1
CLIPS = (0.0, 1.0, 1.0)
STRAY_GATHER = (False, False, True)


def make_llama(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=97,
                                      max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def tokens(step: int, rank: int) -> torch.Tensor:
    """``lm_tokens`` whose last token also appears first: a token seen only last has an
    exactly-zero true embedding gradient, whose float noise Adam normalises into lr-sized
    steps that depend on summation order (see test_engine_hf's c_attn.bias)."""
    ids = lm_tokens(step, rank)
    ids[:, -1] = ids[:, 0]
    return ids


def readme_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """README's groups, verbatim."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def ds_config(clip: float, swap_dir: str, socket_path: str, job: str) -> dict[str, Any]:
    offload = {"device": "nvme", "nvme_path": swap_dir}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": 3, "offload_param": offload,
                                  "offload_optimizer": dict(offload)},
            "offloadd": {"socket": socket_path, "job": job}}


def watch_step_starts(engine: Any) -> list[tuple[int, str]]:
    """(unit, gather state) of every optimizer step that started while an all-gather of
    its unit was in flight or done: the daemon would find ``u{N}.param`` leased."""
    full, start = engine.placement.full, engine.backend.step_async
    unsafe: list[tuple[int, str]] = []

    def step_async(unit: int, **kwargs: Any) -> Any:
        state = full.state(engine.units[unit])
        if state is not GatherState.FREE:
            unsafe.append((unit, state.value))
        return start(unit, **kwargs)

    engine.backend.step_async = step_async
    return unsafe


def train(engine: Any, rank: int, *, stray_gather: bool) -> tuple[list[float], list[int]]:
    """The losses, and the all-gathers each backward issued."""
    full = engine.placement.full
    losses, backward_gathers = [], []
    for step in range(STEPS):
        ids = tokens(step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        before = full.num_gathers
        engine.backward(loss)
        backward_gathers.append(full.num_gathers - before)
        if stray_gather:  # the final norm's unit, gathering (read lease held) into the step
            full.prefetch([engine.units[1]], 1 << 40)
        engine.step()
        losses.append(loss.item())
    return losses, backward_gathers


def train_rank(rank: int, world: int) -> list[Any]:
    swap_dir = tempfile.mkdtemp(prefix="offloadd-prefetch-step-")
    results = []
    with shared_daemon(rank, swap_dir) as socket_path:
        for case, (clip, stray) in enumerate(zip(CLIPS, STRAY_GATHER, strict=True)):
            model = make_llama()
            engine, _, _, _ = trainer.initialize(
                model=model, config=ds_config(clip, swap_dir, socket_path, f"case{case}"),
                model_parameters=readme_groups(model))
            assert engine.units[0].module is engine.units[1].module is model  # the split root
            unsafe = watch_step_starts(engine)
            losses, gathers = train(engine, rank, stray_gather=stray)
            results.append((consolidate_fp32_state_dict(engine), losses, gathers, unsafe))
            engine.close()
    return results


def test_groups_nvme_default_prefetch_match_adamw() -> None:
    ranks = run_ranks(train_rank, 2)
    for case, clip in enumerate(CLIPS):
        expected, expected_losses = lm_adamw_run(make_llama(), STEPS, tokens, LR,
                                                 WEIGHT_DECAY, param_groups=readme_groups,
                                                 clip=clip)
        state = ranks[0][case][0]
        assert max_relative_error(state, expected) < 1e-5, case
        for rank in (0, 1):
            _, losses, gathers, unsafe = ranks[rank][case]
            assert unsafe == [], case
            torch.testing.assert_close(losses, [step[rank] for step in expected_losses],
                                       rtol=1e-5, atol=0)
            # Every unit stays gathered from its forward to its backward (default reuse
            # distance) once the order is known: later backwards gather nothing.
            assert gathers[1:] == [0] * (STEPS - 1), (case, gathers)
