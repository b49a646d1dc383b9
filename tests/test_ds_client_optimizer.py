"""DeepSpeed scripts that build their optimizer and LR scheduler as objects and hand both to
``deepspeed.initialize`` (DeepSpeed-Chat's training scripts, and DeepSpeed's own docs:
``lr_scheduler`` is "a scheduler object or a callable"): ``DeepSpeedCPUAdam`` (or
``FusedAdam``, or torch's AdamW) over no-decay param groups, ``transformers.get_scheduler``
over that optimizer, ``initialize(model=, optimizer=, lr_scheduler=, config=)``.

Before: the scheduler object was refused (only a callable was taken), and neither
``DeepSpeedCPUAdam`` nor a ``FusedAdam`` was a ``torch.optim.Optimizer``, so torch's and
transformers' schedulers could not be built over them at all; ``bias_correction`` in a
config's Adam params was an unknown key, and ``bias_correction=False`` was silently dropped.

2 gloo ranks on the strict device twin, ZeRO-3 with parameters and optimizer offloaded to
the module's daemon, against torch AdamW with the same groups and the same scheduler on the
union of both ranks' micro-batches: every step's learning rates and the final weights; for
``DeepSpeedCPUAdam`` the run is cut by a checkpoint, and the second half is a fresh process
state (new model, optimizer and scheduler objects) that loads it. The weights are saved as
DeepSpeed-Chat's ``save_zero_three_model`` does (``GatheredParameters`` over the parameters
whose ``ds_status`` is ``ZeroParamStatus.NOT_AVAILABLE``, imported from
``deepspeed.runtime.zero.partition_parameters``), which before found neither the name nor
the attribute; ``ds_status`` says whether the full value is there, inside each forward and
between steps.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from _dist import base_config, make_batch, make_model, max_relative_error, run_ranks, with_offload

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytestmark = pytest.mark.usefixtures("strict_device_twin")

STEPS, WARMUP, RANKS, MICRO = 6, 2, 2, 4
HYPER = {"lr": 2e-2, "betas": (0.9, 0.95), "eps": 1e-8}
DECAY = 0.1


def grouped(model: torch.nn.Module) -> list[dict[str, Any]]:
    """DeepSpeed-Chat's ``get_optimizer_grouped_parameters``: no decay on biases and norms."""
    plain = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    decayed = [p for n, p in model.named_parameters() if not ("bias" in n or "norm" in n)]
    return [{"params": decayed, "weight_decay": DECAY}, {"params": plain, "weight_decay": 0.0}]


def schedule(optimizer: Any) -> Any:
    from transformers import get_scheduler

    return get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=WARMUP,
                         num_training_steps=STEPS)


def build(kind: str, model: torch.nn.Module) -> Any:
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    if kind == "cpu_adam":
        return DeepSpeedCPUAdam(grouped(model), **HYPER)
    if kind == "fused_adam":
        return FusedAdam(grouped(model), **HYPER)
    return torch.optim.AdamW(grouped(model), **HYPER)


def train(engine: Any, steps: range, rank: int) -> list[list[float]]:
    lrs = []
    for step in steps:
        loss = engine(*(t.to(engine.device) for t in make_batch(step, 0, rank, MICRO)))
        engine.backward(loss)
        engine.step()
        lrs.append(engine.get_lr())
    return lrs


def save_zero_three_model(model_ema: Any, global_rank: int, save_dir: str) -> None:
    """DeepSpeed-Chat's ``utils.save_zero_three_model`` at stage 3, as written there."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def _z3_params_to_fetch(param_list: list[Any]) -> list[Any]:
        return [p for p in param_list
                if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]

    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=True):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0 and "lora" not in k:
            output_state_dict[k] = v_p
    if global_rank == 0:
        torch.save(output_state_dict, output_model_file)


def status_matches_storage(module: torch.nn.Module, seen: list[str]) -> None:
    """Record each parameter's ``ds_status`` and whether it says what its storage holds."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for name, param in module.named_parameters():
        whole = param.numel() == param.ds_numel
        assert (param.ds_status == ZeroParamStatus.AVAILABLE) == whole, (name, param.ds_status)
        seen.append(param.ds_status.name)


def chat_style(rank: int, world: int, socket: str, tmp: str, kind: str, cut: int
               ) -> tuple[list[list[float]], dict[str, torch.Tensor], list[str]]:
    import trainer.deepspeed  # noqa: F401  - the line a DeepSpeed script adds, first

    # isort: split
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.utils import see_memory_usage

    from trainer.state.checkpoint import consolidate_fp32_state_dict

    # DeepSpeed-Chat's main.py preamble (the twin has one device a process: device_name(i)
    # names it, where DeepSpeed-Chat builds torch.device("cuda", local_rank))
    get_accelerator().set_device(rank)
    device = torch.device(get_accelerator().device_name(rank))
    get_accelerator().manual_seed_all(1234)
    see_memory_usage("before initialize", force=True)

    def initialize() -> Any:
        model = make_model()
        optimizer = build(kind, model)
        config = with_offload(base_config(zero_optimization={"stage": 3}), "cpu", socket,
                              f"chat-{kind}")
        del config["optimizer"]
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          lr_scheduler=schedule(optimizer), config=config,
                                          dist_init_required=True)
        assert isinstance(engine, DeepSpeedEngine) and engine.device == device
        get_accelerator().empty_cache()
        block = model.blocks[1]  # a unit; its fc1 runs while it is gathered
        block.fc1.register_forward_pre_hook(lambda *_: status_matches_storage(block, seen))
        return engine

    seen: list[str] = []

    engine = initialize()
    try:
        lrs = train(engine, range(cut), rank)
        if cut < STEPS:
            engine.save_checkpoint(tmp, tag="cut")
            engine.close()
            engine = initialize()
            engine.load_checkpoint(tmp, tag="cut")
        lrs += train(engine, range(cut, STEPS), rank)
        status_matches_storage(engine.module, seen)
        save_zero_three_model(engine, rank, tmp)
        return lrs, consolidate_fp32_state_dict(engine.engine), seen
    finally:
        engine.close()


def reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    model = make_model()
    optimizer = torch.optim.AdamW(grouped(model), **HYPER)
    scheduler = schedule(optimizer)
    lrs = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(RANKS):
            (model(*make_batch(step, 0, rank, MICRO)) / RANKS).backward()
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr())
    return lrs, {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize(("kind", "cut"), [("cpu_adam", 3), ("fused_adam", STEPS),
                                           ("torch_adamw", STEPS)])
def test_optimizer_and_scheduler_objects_train_as_torch(daemon: Any, tmp_path: Any, kind: str,
                                                        cut: int) -> None:
    expected_lrs, expected = reference()
    assert expected_lrs[0] != expected_lrs[-1]  # the schedule moves: warm-up, then cosine
    results = run_ranks(chat_style, RANKS, str(daemon.socket_path), str(tmp_path), kind, cut)
    for lrs, _, seen in results:
        assert len(lrs) == STEPS
        for ours, theirs in zip(lrs, expected_lrs, strict=True):
            assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(ours, theirs,
                                                                         strict=True))
        assert {"AVAILABLE", "NOT_AVAILABLE"} <= set(seen)
    assert max_relative_error(results[0][1], expected) < 2e-5
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert max_relative_error(saved, expected) < 2e-5


def test_a_scheduler_over_another_optimizer_or_an_unsupported_adam_names_the_fix() -> None:
    from trainer.config import parse_config
    from trainer.integrations.ds_facade import DeepSpeedCPUAdam, FusedAdam, initialize

    model = make_model()
    stray = schedule(torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match="not built over the optimizer passed as optimizer="):
        initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters()),
                   lr_scheduler=stray, config={"train_micro_batch_size_per_gpu": 4})
    for adam in (DeepSpeedCPUAdam, FusedAdam):
        with pytest.raises(ValueError, match="bias_correction=False"):
            adam(model.parameters(), bias_correction=False)
        with pytest.raises(RuntimeError, match=r"engine\.step"):
            adam(model.parameters()).step()
    section = {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": True}}
    assert parse_config({"train_micro_batch_size_per_gpu": 1,
                         "optimizer": section}).optimizer.bias_correction
    section["params"]["bias_correction"] = False
    with pytest.raises(ValueError, match=r"optimizer\.params\.bias_correction"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "optimizer": section})
