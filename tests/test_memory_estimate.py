"""The memory estimate (``trainer.zero.estimate``; DeepSpeed's ``estimate_zero3_model_
states_mem_needs_all_live`` and kin through the facade) against what runs take.

- Device: on the strict twin with its capacity set to the estimate plus the activations
  (measured: the same model's plain torch forward and backward on the twin), the engine
  initializes and trains, stages 0-3, offload none/cpu, 1 and 2 ranks; at 0.4 of the
  estimate it runs out of memory, so the figure is neither short nor loose past 2.5x
  (1.0-1.2x where ``stage3_max_live_parameters`` holds the model, measured by bisection;
  ~2x where it holds two units, as the working set's parts do not all meet at once).
- Host: the arena the engine's private daemon maps is the estimate's, byte for byte.
- DeepSpeed's names print one row per offload choice with these figures.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from _dist import run_ranks

from trainer.zero.estimate import ModelCounts, estimate

pytestmark = [pytest.mark.slow]

WIDTH, DEPTH = 128, 3
SMALL_NBYTES = 64 << 10
"""Besides the activations, the engine's own small tensors the estimate leaves out: the
loss, the inputs cast to bf16, norms."""
CASES: list[dict[str, Any]] = [
    {"stage": 0},
    {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    {"stage": 2},
    {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    {"stage": 3},
    {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
     "stage3_max_live_parameters": 1000},
]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.tanh(self.up(hidden)))


class Net(torch.nn.Module):
    """Parameters dominate: a micro-batch of one row makes the activations small."""

    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
        self.head = torch.nn.Linear(WIDTH, 4)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(features)
        for block in self.blocks:
            hidden = block(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden).float(), labels)


def _config(zero: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}


def _batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(1, 8, generator=generator).to(device),
            torch.randint(0, 4, (1,), generator=generator).to(device))


def _activation_nbytes() -> int:
    """The twin's peak over a plain torch bf16 forward and backward, less the parameters and
    their gradients: what the estimate leaves out."""
    from trainer.device import twin_memory
    from trainer.device.twin import adopt_module, twin_device

    device = twin_device()
    model = Net().to(torch.bfloat16).to(device)
    adopt_module(model)
    twin_memory.reset_peak_memory_stats()
    features, labels = _batch(0, 0, device)
    model(features.to(torch.bfloat16), labels).backward()
    params = sum(param.numel() * param.element_size() for param in model.parameters())
    return twin_memory.max_memory_allocated() - 2 * params


def _train_within(rank: int, world: int, zeros: list[dict[str, Any]], factor: float,
                  depth: int = DEPTH, copy_gbps: float | None = None) -> list[str]:
    """Rank body: each case on a twin of ``factor`` x the estimate (+ activations);
    "trained" or the out-of-memory error. ``copy_gbps``: the twin's copies are timed."""
    import trainer
    from trainer.device import twin_memory

    if copy_gbps is not None:
        os.environ["OFFLOADD_TWIN_GBPS"] = str(copy_gbps)
    outcomes = []
    slack = _activation_nbytes() + SMALL_NBYTES
    for zero in zeros:
        torch.manual_seed(0)
        model = Net(depth)
        config = _config({**zero})
        figures = estimate(ModelCounts.of(model), config, gpus_per_node=world)
        gc.collect()  # the last case's engine and model
        capacity = twin_memory.memory_allocated() + int(factor * figures.device_nbytes) + slack
        os.environ["OFFLOADD_TWIN_MEMORY"] = str(capacity)
        twin_memory.memory().capacity_nbytes = capacity
        engine = None
        try:
            engine, _, _, _ = trainer.initialize(model=model, config=config,
                                                 model_parameters=model.parameters())
            for step in range(4):
                engine.backward(engine(*_batch(step, rank, engine.device)))
                engine.step()
            outcomes.append("trained")
        except torch.OutOfMemoryError as error:
            outcomes.append(f"out of memory: {error}")
        finally:
            if engine is not None:
                engine.close()
            engine = model = None  # gone before the next case counts its baseline
            twin_memory.memory().capacity_nbytes = None
            del os.environ["OFFLOADD_TWIN_MEMORY"]
    return outcomes


@pytest.mark.usefixtures("strict_device_twin")
def test_the_device_estimate_is_enough_and_not_two_and_a_half_times_too_much() -> None:
    enough = run_ranks(_train_within, 1, CASES, 1.0)[0]
    assert enough == ["trained"] * len(CASES), list(zip(CASES, enough, strict=True))
    short = run_ranks(_train_within, 1, CASES, 0.4)[0]
    for zero, outcome in zip(CASES, short, strict=True):
        assert outcome.startswith("out of memory"), (zero, outcome)


@pytest.mark.usefixtures("strict_device_twin")
def test_the_device_estimate_is_enough_for_each_of_two_ranks() -> None:
    zeros = [CASES[1], CASES[3], CASES[5], CASES[6]]
    for outcomes in run_ranks(_train_within, 2, zeros, 1.0):
        assert outcomes == ["trained"] * len(zeros), list(zip(zeros, outcomes, strict=True))


@pytest.mark.usefixtures("strict_device_twin")
def test_the_estimate_holds_where_the_gradient_copies_are_slow() -> None:
    """A backward that outruns its gradients' D2H copies (a slow link, small micro-batches)
    keeps at most two units' gradient sums on the device waiting for theirs (it held
    every unit's the link had not taken yet: four of twelve at 50 MB/s here)."""
    zeros = [CASES[3]]  # stage 2: every unit's gradient crosses to the daemon's arena
    outcomes = run_ranks(_train_within, 1, zeros, 1.0, 12, 0.05)[0]
    assert outcomes == ["trained"], outcomes


def _arena(rank: int, world: int) -> tuple[int, int]:
    import trainer

    torch.manual_seed(0)
    model = Net()
    config = _config({"stage": 3, "offload_optimizer": {"device": "cpu"},
                      "offload_param": {"device": "cpu"}})
    figures = estimate(ModelCounts.of(model), config, gpus_per_node=world)
    engine, _, _, _ = trainer.initialize(model=model, config=config,
                                         model_parameters=model.parameters())
    try:
        return figures.arena_nbytes, engine.backend.client.arena.nbytes
    finally:
        engine.close()


def test_the_arena_estimate_is_the_arena_the_daemon_maps() -> None:
    for estimated, mapped in run_ranks(_arena, 2):
        assert estimated == mapped


_ROW = re.compile(r"^\s+([\d.]+)GB \|\s+([\d.]+)GB \| (.*)$")


def test_deepspeeds_estimators_print_offloadds_figures() -> None:
    code = """
import trainer.hf
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
import test_memory_estimate as t
estimate_zero3_model_states_mem_needs_all_live(t.Net(), num_gpus_per_node=2, num_nodes=1)
estimate_zero2_model_states_mem_needs_all_cold(total_params=10**9, num_gpus_per_node=8)
"""
    tests_dir = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True, cwd=tests_dir,
                          env={**os.environ, "PYTHONPATH": tests_dir})
    rows = [match.groups() for line in done.stdout.splitlines()
            if (match := _ROW.match(line))]
    assert len(rows) == 8, done.stdout
    counts = ModelCounts.of(Net())
    options = [(True, True, True), (True, True, False), (True, False, True),
               (True, False, False), (False, False, True), (False, False, False)]
    for (cpu, gpu, text), (optimizer, param, zero_init) in zip(rows, options, strict=False):
        zero: dict[str, Any] = {"stage": 3}
        if optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        if param:
            zero["offload_param"] = {"device": "cpu"}
        figures = estimate(counts, {**_config(zero), "gradient_accumulation_steps": 2},
                           gpus_per_node=2, zero_init=zero_init)
        assert float(cpu) == round(figures.host_nbytes / 2**30, 2), text
        assert float(gpu) == round(figures.device_nbytes / 2**30, 2), text
        assert f"zero_init={int(zero_init)}" in text
    # ZeRO-2 over 8 GPUs, the optimizer on the CPU: the host holds 18 B per parameter of
    # the node's ranks (fp32 master, gradient and moments, bf16 copy), with the arena's slack
    assert rows[6][2] == "offload_optimizer=cpu "
    assert float(rows[6][0]) >= 18e9 * 1.25 / 2**30
