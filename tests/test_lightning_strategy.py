"""Lightning's DeepSpeed guide with offloadd: ``OffloaddStrategy`` takes
``DeepSpeedStrategy``'s keywords with their meanings, and ``import trainer.lightning``
registers ``offloadd_stage_*`` names as Lightning registers ``deepspeed_stage_*``.

2 torchrun ranks (``tests/scripts/lightning_guide_run.py``): the guide's ZeRO-3 NVMe
keywords (``stage=3, offload_optimizer=True, offload_parameters=True,
remote_device="nvme", ..., nvme_path=...``) and ``strategy="offloadd_stage_3_offload"``
with the model built in ``configure_model`` (the guide's "Shard Model Instantly": its
parameters are ``meta`` there, ``zero.Init``) both train with the losses of
``strategy="ddp"``, without warnings (none about the buffer/aio sizes the keywords write,
none from torch's LR scheduler). All three start from the weights the engine gave the
``configure_model`` run. The model summary, on as the guide leaves it, counts the
partitioned parameters as DDP's counts the whole ones (it counted 0 before).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _torchrun import torchrun

pytest.importorskip("lightning", reason="the lightning extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "lightning_guide_run.py"


def run(out: Path, strategy: str, *args: str) -> dict[str, Any]:
    """offloadd's runs on the strict device twin (Lightning's ``TwinAccelerator``)."""
    torchrun(SCRIPT, ["--out", str(out), "--strategy", strategy, *args], out,
             env={"OFFLOADD_TWIN_DEVICE": "strict"} if strategy != "ddp" else None)
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def test_deepspeed_keywords_and_registered_names_match_ddp(tmp_path: Path) -> None:
    sharded = run(tmp_path / "sharded", "offloadd_stage_3_offload", "--configure-model")
    assert sharded["strategy"] == "OffloaddStrategy" and sharded["device"] == "twin:0"
    assert sharded["built_meta"] is True  # configure_model ran under zero.Init
    assert sharded["warnings"] == []
    initial = ["--init-from", str(tmp_path / "sharded" / "initial.pt")]
    reference = run(tmp_path / "ddp", "ddp", *initial)
    assert reference["strategy"] == "DDPStrategy" and reference["device"] == "cpu"
    assert sharded["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    # the model summary counts the partitioned parameters whole, as DDP's does
    assert sharded["summary"] == reference["summary"] and reference["summary"]["total"] > 0
    ours = run(tmp_path / "keywords", "keywords", *initial)
    assert ours["strategy"] == "OffloaddStrategy" and ours["device"] == "twin:0"
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["warnings"] == []
    assert ours["summary"] == reference["summary"]
    # nvme_path reached the daemon: it swapped into a dir of its own there
    swap = tmp_path / "keywords" / "swap"
    assert [d for d in ours["scratch_dirs"] if Path(d).parent == swap], ours


def test_registered_names_mean_what_deepspeeds_do() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from trainer.lightning import OffloaddStrategy

    expected = {"offloadd": (2, None, None), "offloadd_stage_1": (1, None, None),
                "offloadd_stage_2": (2, None, None),
                "offloadd_stage_2_offload": (2, "cpu", None),
                "offloadd_stage_3": (3, None, None),
                "offloadd_stage_3_offload": (3, "cpu", "cpu"),
                "offloadd_stage_3_offload_nvme": (3, "nvme", "nvme")}
    for name, (stage, optimizer_device, param_device) in expected.items():
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, OffloaddStrategy), name
        zero = strategy.config["zero_optimization"]
        assert zero["stage"] == stage, name
        assert zero.get("offload_optimizer", {}).get("device") == optimizer_device, name
        assert zero.get("offload_param", {}).get("device") == param_device, name
    with pytest.raises(ValueError, match="remote_device"):
        OffloaddStrategy(remote_device="gpu")
    assert OffloaddStrategy(exclude_frozen_parameters=True).exclude_frozen_parameters


def test_a_config_file_from_the_environment_or_a_path(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``PL_DEEPSPEED_CONFIG_PATH`` stands in for ``config=`` as with DeepSpeedStrategy; a
    path that cannot be read, or is not JSON, is refused naming where it came from."""
    from trainer.lightning import OffloaddStrategy

    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
              "bf16": {"enabled": True}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    assert OffloaddStrategy().config == config
    assert OffloaddStrategy(stage=1).config == config  # keywords are ignored, as there
    assert OffloaddStrategy(config={"zero_optimization": {"stage": 1}}).config == {
        "zero_optimization": {"stage": 1}}
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"PL_DEEPSPEED_CONFIG_PATH names .*missing.json"):
        OffloaddStrategy()
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH")
    (tmp_path / "bad.json").write_text("{stage: 3")
    with pytest.raises(ValueError, match=r"config names .*bad.json, which is not JSON"):
        OffloaddStrategy(config=str(tmp_path / "bad.json"))
    assert OffloaddStrategy().config["zero_optimization"]["stage"] == 2


def _fit_without_a_daemon(rank: int, world: int) -> tuple[str, str]:
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from trainer.lightning import OffloaddStrategy

    class Module(pl.LightningModule):
        def configure_model(self) -> None:  # under zero.Init: on meta until the engine
            self.net = nn.Linear(4, 4)

        def training_step(self, batch: Any, index: int) -> Any:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters())

    offload = {"device": "cpu"}
    strategy = OffloaddStrategy(config={
        "train_micro_batch_size_per_gpu": 1, "offloadd": {"socket": "/nonexistent/sock"},
        "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload}})
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = torch.utils.data.TensorDataset(torch.randn(4, 4))
    try:
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=1))
    except Exception as error:  # what the user sees is the point
        return type(error).__name__, str(error)
    return "", "fit passed"


def test_a_setup_that_fails_surfaces_its_own_error() -> None:
    """A config naming a daemon that is not there, with the model built in
    ``configure_model`` (on meta): Lightning's teardown moved the module to the CPU and
    raised "Cannot copy out of meta tensor" over the setup's error."""
    from _dist import run_ranks

    kind, message = run_ranks(_fit_without_a_daemon, 1)[0]
    assert kind == "RuntimeError", message
    assert "config key offloadd.socket" in message
