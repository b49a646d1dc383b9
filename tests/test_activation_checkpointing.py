"""DeepSpeed's activation checkpointing API (``deepspeed.checkpointing``,
``trainer.zero.checkpointing``) on offloadd, against plain torch and the device's memory.

2 gloo ranks on the strict twin train a model whose blocks run through the facade's
``deepspeed.checkpointing.checkpoint`` under ZeRO-3, the config's
``activation_checkpointing`` section asking for CPU checkpointing as
Lightning's DeepSpeed guide does (``partition_activations`` + ``cpu_checkpointing``; the
section was ignored with a warning before). They must end where single-process torch
AdamW (blocks called plainly) ends. At one step each rank measures the device memory its
forward leaves for the backward: with CPU checkpointing the blocks' kept inputs are on
the host, so the device holds exactly their bytes less than at the next step, which
``configure(checkpoint_in_cpu=False)`` runs with the inputs on the device. (The recompute
reads inputs that autograd hands back as new tensor objects: the strict twin failed
there with ``HostDeviceMixError`` where CUDA runs, until it learned to know device
memory by its storage.)
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from _dist import Block, adamw_steps, base_config, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device_twin")]

WORLD = 2
STEPS = 4
BATCH = 16
WIDTH = 24
DEPTH = 3
MEASURED_STEPS = (1, 2)
"""Steps whose forward is measured: the first with CPU checkpointing, the second without."""


class Net(torch.nn.Module):
    def __init__(self, checkpoint: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(7, WIDTH)
        self.blocks = torch.nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDTH, 5)
        self.checkpoint = checkpoint

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(features)
        for block in self.blocks:
            hidden = self.checkpoint(block, hidden) if self.checkpoint else block(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden), labels)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(BATCH, 7, generator=generator),
            torch.randint(0, 5, (BATCH,), generator=generator))


def _run(rank: int, world: int) -> dict[str, Any]:
    import trainer.hf

    trainer.hf.install()  # `deepspeed` is offloadd's facade in this rank, as in a user's script
    return _train(rank)


def _train(rank: int) -> dict[str, Any]:
    import deepspeed

    import trainer
    from trainer.device import twin_memory
    from trainer.zero.param_state import full_fp32_param

    model = Net(deepspeed.checkpointing.checkpoint)
    config = base_config(zero_optimization={"stage": 3}, train_micro_batch_size_per_gpu=BATCH,
                         activation_checkpointing={"partition_activations": True,
                                                   "cpu_checkpointing": True},
                         units={"module_classes": ["Block"]})
    engine, *_ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                    config=config)
    configured = deepspeed.checkpointing.is_configured()
    held = []
    for step in range(STEPS):
        if step == MEASURED_STEPS[1]:
            deepspeed.checkpointing.configure(None, checkpoint_in_cpu=False)
        batch = [t.to(engine.device) for t in _batch(step, rank)]
        gc.collect()  # nothing of the last step is left to be freed during this one
        before = twin_memory.memory_allocated()
        loss = engine(*batch)
        if step in MEASURED_STEPS:
            held.append(twin_memory.memory_allocated() - before)
        engine.backward(loss)
        engine.step()
        del loss, batch
    state = {name: full_fp32_param(param).cpu() for name, param in model.named_parameters()}
    engine.close()
    return {"state": state, "held": held, "configured": configured}


def _reference() -> dict[str, torch.Tensor]:
    model = Net(None)
    adamw_steps(model, STEPS, lambda step, _micro, rank: model(*_batch(step, rank)),
                world_size=WORLD)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_cpu_checkpointing_keeps_block_inputs_off_the_device_and_trains_as_torch() -> None:
    results = run_ranks(_run, WORLD)
    reference = _reference()
    kept_inputs = DEPTH * BATCH * WIDTH * torch.float32.itemsize
    for rank, result in enumerate(results):
        assert result["configured"]  # by the config section, at initialize
        for name, expected in reference.items():
            torch.testing.assert_close(result["state"][name], expected, rtol=2e-5, atol=2e-6,
                                       msg=f"rank {rank} {name}")
        on_host, on_device = result["held"]
        assert on_device - on_host == kept_inputs, result["held"]


def test_configure_reads_deepspeeds_arguments_and_refuses_model_parallelism(
        tmp_path: Any) -> None:
    from trainer.deepspeed_features import UnsupportedFeatureError
    from trainer.zero import checkpointing

    class Mpu:
        def __init__(self, size: int) -> None:
            self.size = size

        def get_model_parallel_world_size(self) -> int:
            return self.size

    path = tmp_path / "ds.json"
    path.write_text('{"activation_checkpointing": {"cpu_checkpointing": true, '
                    '"synchronize_checkpoint_boundary": true}}')
    try:
        checkpointing.configure(Mpu(1), deepspeed_config=str(path), num_checkpoints=4)
        current = checkpointing.settings()
        assert current.cpu_checkpointing and current.synchronize_checkpoint_boundary
        assert current.number_checkpoints == 4
        checkpointing.configure(None, deepspeed_config={}, checkpoint_in_cpu=False)
        assert not checkpointing.settings().cpu_checkpointing
        with pytest.raises(UnsupportedFeatureError, match="model-parallel size of 2"):
            checkpointing.configure(Mpu(2))
        with pytest.raises(ValueError, match=r"number_checkpoints=0 is invalid"):
            checkpointing.configure(num_checkpoints=0)
        with pytest.raises(ValueError, match=r"did you mean activation_checkpointing\.cpu_"):
            checkpointing.configure(deepspeed_config={
                "activation_checkpointing": {"cpu_checkpoint": True}})
    finally:
        checkpointing._settings = None  # unconfigured again, as this process began
