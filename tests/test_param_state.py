"""DeepSpeed's per-parameter state API (``from deepspeed.utils import safe_get_full_grad``
and kin, ``trainer.zero.param_state``) on offloadd, against plain torch.

2 gloo ranks on the strict twin train TinyNet with ZeRO stages 0-3, the optimizer in the
rank, the daemon's DRAM and its NVMe tier, two micro-batches a step. After every backward
each rank reads every parameter's gradient (whole and its fragment); after every step the
fp32 parameter and both Adam moments. At one step it edits them: half the parameters
through the whole-parameter setters, half through the fragment setters. A single-process
torch AdamW on the union of the ranks' micro-batches, with the same edits, is the
reference: every read must equal torch's ``param.grad`` (the loss divided by the
accumulation steps) and ``optimizer.state``, before and after the edit, and the ranks'
fragments side by side must be the whole parameter.

At the last step it replaces the window's gradients between the backward that ends it
and ``engine.step()`` (``safe_set_full_grad``, ``safe_set_local_grad``), as a gradient
surgery would, and torch's step on the same edited ``param.grad`` is the reference.
Without clipping each unit's step starts during that backward (``step_in_backward``):
there the write is refused, naming the setting that makes the steps wait.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from _dist import (
    base_config,
    config_adamw,
    make_batch,
    make_model,
    run_ranks,
    shared_daemon,
    zero_section,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

WORLD = 2
STEPS = 3
ACCUMULATION = 2
EDIT_AFTER_STEP = 1
EDIT_GRADS_AT_STEP = STEPS - 1
MOMENTS = ("exp_avg", "exp_avg_sq")


def _cases() -> list[tuple[str, dict[str, Any]]]:
    cases = []
    for stage, device, in_backward in ((0, "none", False), (1, "cpu", False), (2, "cpu", True),
                                       (3, "cpu", False), (3, "none", False)):
        zero = {**zero_section(stage, device), "step_in_backward": in_backward}
        cases.append((f"stage{stage}-{device}", base_config(
            zero_optimization=zero, gradient_accumulation_steps=ACCUMULATION)))
    # Twin-Flow: the first units' optimizer state on the device, the rest in the daemon.
    split = {**zero_section(3, "cpu"), "step_in_backward": False}
    split["offload_optimizer"]["ratio"] = 0.5
    cases.append(("stage3-cpu-ratio", base_config(zero_optimization=split,
                                                  gradient_accumulation_steps=ACCUMULATION)))
    # The NVMe tier frees a gradient its step consumed: with clipping the steps wait for
    # engine.step() (speculative ones keep theirs until then), so it is there to read.
    cases.append(("stage2-nvme", base_config(zero_optimization=zero_section(2, "nvme"),
                                             gradient_accumulation_steps=ACCUMULATION,
                                             gradient_clipping=1e6)))
    return cases


def _edits_grads(config: dict[str, Any]) -> bool:
    """The case's steps wait for engine.step(): its gradients can be replaced."""
    return (config.get("gradient_clipping", 0) > 0
            or not config["zero_optimization"].get("step_in_backward", True))


def _edit(name_index: int, value: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference's edit: params and exp_avg halved, exp_avg_sq doubled, plus a ramp so
    no element keeps its old value by chance."""
    ramp = torch.linspace(-1e-3, 1e-3, value.numel()).view(value.shape) * (name_index + 1)
    ramp = ramp.to(value.device)
    return value * (2.0 if kind == "exp_avg_sq" else 0.5) + ramp.abs() * (kind != "param")


def _train(rank: int, world: int, name: str, config: dict[str, Any], socket: str,
           swap_dir: str) -> dict[str, Any]:
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    import trainer
    from trainer.zero.param_state import ParamStateTimingError

    zero = config["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key, {}).get("device") == "nvme":
            zero[key]["nvme_path"] = swap_dir
    if "offload_optimizer" in zero:
        config["offloadd"] = {"socket": socket, "job": name, "arena_size": 16 << 20}
    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
    named = list(model.named_parameters())
    out: dict[str, Any] = {"grads": [], "local_grads": [], "states": [], "local_states": []}
    try:
        out["grad_before_backward"] = [safe_get_full_grad(param) for _, param in named]
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                batch = make_batch(step, micro, rank, engine.train_micro_batch_size_per_gpu())
                engine.backward(engine(*(t.to(engine.device) for t in batch)))
                out["grads"].append({n: safe_get_full_grad(p).cpu() for n, p in named})
                out["local_grads"].append({n: safe_get_local_grad(p).cpu() for n, p in named})
                if micro == ACCUMULATION - 1 and step == 0:
                    try:  # the window's steps may be running: refused, nothing written
                        safe_set_full_fp32_param(named[0][1],
                                                 safe_get_full_fp32_param(named[0][1]) * 0)
                        out["write_in_step"] = "accepted"
                    except ParamStateTimingError as error:
                        out["write_in_step"] = str(error)
                if micro == ACCUMULATION - 1 and step == EDIT_GRADS_AT_STEP:
                    try:
                        _edit_grads(named, rank, world)
                        out["edited_grads"] = {n: safe_get_full_grad(p).cpu() for n, p in named}
                    except ParamStateTimingError as error:
                        out["edited_grads"] = str(error)
                engine.step()
            out["grad_after_step"] = [safe_get_full_grad(p) for _, p in named]
            out["states"].append({n: [safe_get_full_fp32_param(p).cpu(),
                                      *[safe_get_full_optimizer_state(p, k).cpu()
                                        for k in MOMENTS]] for n, p in named})
            out["local_states"].append({n: [safe_get_local_fp32_param(p).cpu(),
                                            *[safe_get_local_optimizer_state(p, k).cpu()
                                              for k in MOMENTS]] for n, p in named})
            if step != EDIT_AFTER_STEP:
                continue
            for index, (_, param) in enumerate(named):
                if index % 2 == 0:
                    safe_set_full_fp32_param(param, _edit(index, safe_get_full_fp32_param(
                        param), "param"))
                    for kind in MOMENTS:
                        safe_set_full_optimizer_state(param, _edit(
                            index, safe_get_full_optimizer_state(param, kind), kind), kind)
                    continue
                # a fragment: the whole edit, cut where this rank's fragment lies
                whole = {kind: _edit(index, safe_get_full_optimizer_state(param, kind), kind)
                         for kind in MOMENTS}
                whole["param"] = _edit(index, safe_get_full_fp32_param(param), "param")
                start = _fragment_start(safe_get_full_fp32_param(param),
                                        safe_get_local_fp32_param(param), rank, world)
                size = safe_get_local_fp32_param(param).numel()
                cut = {kind: value.reshape(-1)[start:start + size] for kind, value in whole.items()}
                safe_set_local_fp32_param(param, cut["param"])
                for kind in MOMENTS:
                    safe_set_local_optimizer_state(param, cut[kind], kind)
        try:
            safe_get_full_optimizer_state(named[0][1], "momentum_buffer")
        except ValueError as error:
            out["bad_key"] = str(error)
        return out
    finally:
        engine.close()


def _edit_grads(named: list[tuple[str, torch.Tensor]], rank: int, world: int) -> None:
    """The reference's gradient edit: half the parameters whole, half by fragment."""
    from deepspeed.utils import (
        safe_get_full_grad,
        safe_get_local_grad,
        safe_set_full_grad,
        safe_set_local_grad,
    )

    for index, (_, param) in enumerate(named):
        edited = _edit(index, safe_get_full_grad(param), "grad")
        if index % 2 == 0:
            safe_set_full_grad(param, edited)
            continue
        local = safe_get_local_grad(param)
        start = _fragment_start(edited, local, rank, world)
        safe_set_local_grad(param, edited.reshape(-1)[start:start + local.numel()])


def _fragment_start(whole: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> int:
    """Where this rank's fragment starts in the flattened parameter: fragments lie in rank
    order, so every rank before this one holds the elements before it (the sizes are
    gathered from the ranks)."""
    import torch.distributed as dist

    sizes = [0] * world
    dist.all_gather_object(sizes, local.numel())
    if sum(sizes) != whole.numel():  # not partitioned: every rank holds the whole parameter
        return 0
    return sum(sizes[:rank])


def _run(rank: int, world: int, cases: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    import trainer.hf

    trainer.hf.install()  # deepspeed.utils is offloadd's in this rank, as in a user's script
    swap_dir = tempfile.mkdtemp(prefix="offloadd-param-state-")
    with shared_daemon(rank, swap_dir) as socket:
        results = [_train(rank, world, name, config, socket, swap_dir)
                   for name, config in cases]
        results.append(_gone_on_nvme(rank, socket, swap_dir))
    return results


def _gone_on_nvme(rank: int, socket: str, swap_dir: str) -> str:
    """Without clipping a step runs during the backward that ends its window, and the NVMe
    tier frees the gradient it consumed: reading it then is a typed error saying so."""
    from deepspeed.utils import safe_get_full_grad

    import trainer
    from trainer.offload.backend import GradientUnavailableError

    config = base_config(zero_optimization={"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": swap_dir}},
        offloadd={"socket": socket, "job": "gone", "arena_size": 16 << 20})
    model = make_model(0)
    engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
    try:
        batch = make_batch(0, 0, rank, engine.train_micro_batch_size_per_gpu())
        engine.backward(engine(*(t.to(engine.device) for t in batch)))
        try:
            safe_get_full_grad(model.head.weight)
        except GradientUnavailableError as error:
            return str(error)
        return "read"
    finally:
        engine.close()


def _reference(config: dict[str, Any]) -> dict[str, Any]:
    """torch AdamW over every rank's micro-batches: grads after each micro-batch, state
    after each step, the same edits after step EDIT_AFTER_STEP."""
    model = make_model(0)
    optimizer = config_adamw(model.parameters(), config)
    named = list(model.named_parameters())
    out: dict[str, Any] = {"grads": [], "states": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(ACCUMULATION):
            for rank in range(WORLD):
                batch = make_batch(step, micro, rank, config["train_micro_batch_size_per_gpu"])
                loss = model(*batch)
                (loss / (ACCUMULATION * WORLD)).backward()
            out["grads"].append({n: p.grad.clone() for n, p in named})
        if step == EDIT_GRADS_AT_STEP and _edits_grads(config):
            for index, (_, param) in enumerate(named):
                assert param.grad is not None
                param.grad.copy_(_edit(index, param.grad, "grad"))
            out["edited_grads"] = {n: p.grad.clone() for n, p in named}
        optimizer.step()
        out["states"].append({n: [p.detach().clone(), *[optimizer.state[p][k].clone()
                                                         for k in MOMENTS]] for n, p in named})
        if step == EDIT_AFTER_STEP:
            with torch.no_grad():
                for index, (_, param) in enumerate(named):
                    param.copy_(_edit(index, param, "param"))
                    for kind in MOMENTS:
                        optimizer.state[param][kind].copy_(
                            _edit(index, optimizer.state[param][kind], kind))
    return out


def _close(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours, reference, rtol=2e-5, atol=1e-7, msg=what)


def test_per_parameter_state_matches_torch_and_its_edits_train_as_torchs() -> None:
    cases = _cases()
    by_rank = run_ranks(_run, WORLD, cases, timeout_s=420)
    for results in by_rank:
        assert "gradient_clipping" in results[-1], results[-1]
    for index, (name, config) in enumerate(cases):
        reference = _reference(config)
        runs = [results[index] for results in by_rank]
        for run in runs:
            assert run["grad_before_backward"] == [None] * len(run["grad_before_backward"])
            assert run["grad_after_step"] == [None] * len(run["grad_after_step"])
            assert "engine.step()" in run["write_in_step"], (name, run["write_in_step"])
            assert "exp_avg" in run["bad_key"]
            if _edits_grads(config):
                for param, value in reference["edited_grads"].items():
                    _close(run["edited_grads"][param], value, f"{name} edited grad {param}")
            else:
                assert "step_in_backward" in run["edited_grads"], (name, run["edited_grads"])
            for micro, expected in enumerate(reference["grads"]):
                for param, value in expected.items():
                    _close(run["grads"][micro][param], value, f"{name} grad {micro} {param}")
            for step, expected in enumerate(reference["states"]):
                for param, values in expected.items():
                    for kind, ours, value in zip(("fp32", *MOMENTS), run["states"][step][param],
                                                 values, strict=True):
                        _close(ours, value, f"{name} step {step} {kind} {param}")
        _check_fragments(name, runs)


def _check_fragments(name: str, runs: list[dict[str, Any]]) -> None:
    """The ranks' fragments side by side are the whole (each rank's is the whole below
    stage 1), bit for bit."""
    for kind, whole_key in (("local_grads", "grads"), ("local_states", "states")):
        for position, wholes in enumerate(runs[0][whole_key]):
            for param, whole in wholes.items():
                values = whole if isinstance(whole, list) else [whole]
                for slot, value in enumerate(values):
                    pieces = [run[kind][position][param] for run in runs]
                    pieces = [piece[slot] if isinstance(piece, list) else piece
                              for piece in pieces]
                    flat = value.reshape(-1)
                    if sum(piece.numel() for piece in pieces) == flat.numel():
                        assert torch.equal(torch.cat(pieces), flat), (name, kind, param)
                    else:
                        assert all(torch.equal(piece, flat) for piece in pieces), (name, param)
