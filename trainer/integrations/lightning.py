"""Lightning on offloadd: ``Trainer(strategy=trainer.lightning.OffloaddStrategy(config=cfg))``.

The strategy is Lightning's DDP strategy (process group, launcher, reductions)
with the model handed to ``trainer.initialize`` instead of DDP, as Lightning's
DeepSpeed strategy hands it to ``deepspeed.initialize``:

- the engine wraps the LightningModule; ``training_step``/``validation_step``
  run through it (Lightning's forward redirection), so ZeRO-3 gathers units;
- backward and the optimizer step are the engine's (Lightning's
  ``DeepSpeedPrecision`` routes them to ``trainer.model``); the engine
  accumulates (``accumulate_grad_batches``) and clips (``gradient_clip_val``,
  norm only) from the config it builds;
- ``precision="bf16-mixed"`` (or ``"bf16-true"``) trains in bf16 with fp32
  masters; ``"16-mixed"`` in fp16 with loss scaling;
- ``configure_optimizers`` may return a torch Adam/AdamW (and a scheduler,
  which Lightning keeps stepping: its ``lr`` reaches the engine's groups) unless
  the config has an ``optimizer`` section (a ``scheduler`` section is stepped
  and checkpointed by the engine);
- checkpoints are ``engine.save_checkpoint`` directories (one file per rank,
  tag ``checkpoint``) carrying Lightning's loop/callback/scheduler state as
  ``client_state``; ``fit(ckpt_path=...)`` restores them exactly.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

from trainer.api import initialize
from trainer.integrations import ds_facade
from trainer.integrations.versions import UnsupportedVersionError, check_versions
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero.engine import Engine

CHECKPOINT_TAG = "checkpoint"

_PRECISION_KEYS = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
                   "16-true": "fp16"}

check_versions("lightning")

__all__ = ["CHECKPOINT_TAG", "OffloaddStrategy", "UnsupportedVersionError"]


class OffloaddStrategy(DDPStrategy):
    """Lightning strategy training through ``trainer.initialize`` (see module docstring)."""

    strategy_name = "offloadd"

    def __init__(self, config: dict[str, Any] | str | os.PathLike[str], **ddp_kwargs: Any
                 ) -> None:
        super().__init__(**ddp_kwargs)
        if isinstance(config, (str, os.PathLike)):
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("OffloaddStrategy(config=...) takes a DeepSpeed-style config dict "
                             f"or a JSON path, got {type(config).__name__}")
        self.config: dict[str, Any] = copy.deepcopy(config)
        self.engine: Engine | None = None

    # ----------------------------------------------------------- precision

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands every strategy a plugin built from Trainer(precision=...); the
        # engine does the casting, so only the choice is kept (DeepSpeedPrecision routes
        # backward/step to trainer.model, i.e. the engine).
        if plugin is not None and not isinstance(plugin, DeepSpeedPrecision):
            plugin = DeepSpeedPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    # --------------------------------------------------------------- setup

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    def setup_optimizers(self, trainer_: LightningTrainer) -> None:
        """The engine owns the optimizer; it is built in ``setup``."""
        self.optimizers = []
        self.lr_scheduler_configs = []

    def setup(self, trainer_: LightningTrainer) -> None:
        if trainer_.state.fn != TrainerFn.FITTING:
            raise ValueError(f"OffloaddStrategy runs fit() (with validation); for "
                             f"{trainer_.state.fn}() load the saved model into a "
                             "regular strategy")
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer_)
        self.model_to_device()
        self.setup_precision_plugin()
        self._initialize_engine(trainer_)
        self.barrier()

    def _initialize_engine(self, trainer_: LightningTrainer) -> None:
        module = self.lightning_module
        assert isinstance(module, LightningModule)
        settings = self._engine_config(trainer_)
        model_parameters: Any = [p for p in module.parameters() if p.requires_grad]
        client_optimizer = None
        if "optimizer" not in settings:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError("OffloaddStrategy needs exactly one optimizer and at most one "
                                 "scheduler from configure_optimizers")
            client_optimizer = optimizers[0]
            settings["optimizer"], model_parameters = ds_facade.optimizer_section(
                client_optimizer)
            self.lr_scheduler_configs = schedulers
        engine, zero, _, _ = initialize(model=module, model_parameters=model_parameters,
                                                config=settings, dist_init_required=False)
        if client_optimizer is not None:
            ds_facade.link_groups(client_optimizer.param_groups, zero)
        self.engine = engine
        self.model = engine
        self.optimizers = [ds_facade.OptimizerView(zero)]

    def _engine_config(self, trainer_: LightningTrainer) -> dict[str, Any]:
        """The user's config plus what the Lightning Trainer decides."""
        settings = copy.deepcopy(self.config)
        settings.setdefault("train_micro_batch_size_per_gpu", 1)
        accumulate = trainer_.accumulate_grad_batches
        if settings.setdefault("gradient_accumulation_steps", accumulate) != accumulate:
            raise ValueError(f"config gradient_accumulation_steps="
                             f"{settings['gradient_accumulation_steps']} but Trainer("
                             f"accumulate_grad_batches={accumulate}): set one of them only")
        settings.pop("train_batch_size", None)
        if trainer_.gradient_clip_val:
            if trainer_.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
                raise ValueError("OffloaddStrategy clips by norm only: use "
                                 "Trainer(gradient_clip_algorithm='norm')")
            settings["gradient_clipping"] = float(trainer_.gradient_clip_val)
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision in _PRECISION_KEYS:
            settings.setdefault(_PRECISION_KEYS[precision], {})["enabled"] = True
        elif precision != "32-true":
            raise ValueError(f"OffloaddStrategy supports precision 32-true, bf16-mixed, "
                             f"bf16-true, 16-mixed and 16-true, got {precision!r}")
        return settings

    # ---------------------------------------------------------- checkpoints

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's full fp32 ``state_dict`` on rank 0 (``{}`` elsewhere).

        Collective; call it before fit() returns (e.g. in ``on_train_end``): the
        engine and its daemon are closed at teardown.
        """
        if self.engine is None:
            raise ValueError("consolidated_state_dict() needs the engine: call it during "
                             "fit(), e.g. from on_train_end")
        return consolidate_fp32_state_dict(self.engine)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Weights travel in the engine's checkpoint, not in Lightning's dict."""
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("OffloaddStrategy writes engine checkpoints: storage_options "
                            "is not supported")
        assert self.engine is not None
        filepath = self.broadcast(str(filepath))
        client_state = {key: value for key, value in checkpoint.items()
                        if key not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        assert self.engine is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / CHECKPOINT_TAG).is_dir():
            raise ValueError(f"{path} is not an OffloaddStrategy checkpoint (a directory with "
                             f"a {CHECKPOINT_TAG}/ folder written by save_checkpoint)")
        _, client_state = self.engine.load_checkpoint(path, tag=CHECKPOINT_TAG)
        return client_state

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored it in load_checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The engine restored the weights in ``load_checkpoint``."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The engine restored the optimizer in ``load_checkpoint``."""

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.model = self.lightning_module
        super().teardown()
