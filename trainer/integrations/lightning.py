"""Lightning on offloadd: ``Trainer(strategy=trainer.lightning.OffloaddStrategy(...))``.

``OffloaddStrategy`` takes Lightning's ``DeepSpeedStrategy`` keywords with their meanings
(``stage``, ``offload_optimizer``, ``offload_parameters``, ``offload_params_device``,
``offload_optimizer_device``, ``nvme_path``, ..., or a whole ``config``), and importing
this module registers the same named strategies under ``offloadd`` in Lightning's
registry: ``Trainer(strategy="offloadd_stage_3_offload")`` where a script had
``strategy="deepspeed_stage_3_offload"``.

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
  ``client_state``; ``fit(ckpt_path=...)`` restores them exactly;
- ``test``, ``validate`` and ``predict`` run through an engine too, as the guide
  writes them (``trainer.fit(model); trainer.test(); trainer.predict()``): the
  engine that trained the module stays open after ``fit`` (at stage 3 it holds
  the module's weights, as DeepSpeed's partitions do) and evaluates it, reading a
  ``ckpt_path`` checkpoint first where one is given or chosen ("best"); a module
  no engine holds (``trainer.test(model, ckpt_path=...)`` in a fresh process)
  gets one built for it. A later ``fit``, or a run over another module, destroys
  the kept engine first (its module keeps the weights); the process's exit
  closes it. A process keeps one such idle engine at most: a run of any other
  strategy destroys it first (a sweep that builds a Trainer per trial holds one
  trial's daemon job and arena, not all of them).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators.cpu import _parse_cpu_cores
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities import deepspeed as lightning_deepspeed
from lightning.pytorch.utilities.model_summary import DeepSpeedSummary
from torch import nn

from trainer.api import initialize
from trainer.device import twin, twin_memory
from trainer.integrations import ds_facade
from trainer.integrations.versions import UnsupportedVersionError, check_versions
from trainer.state import checkpoint as engine_checkpoint
from trainer.state.checkpoint import LoadOptions, consolidate_fp32_state_dict
from trainer.zero import init as zero_init
from trainer.zero.engine import Engine

CHECKPOINT_TAG = "checkpoint"
CONFIG_ENV = "PL_DEEPSPEED_CONFIG_PATH"
"""A JSON config path used when ``config`` is not given, as Lightning's DeepSpeed strategy
uses it (``PL_DEEPSPEED_CONFIG_PATH=ds.json python train.py``)."""

_log = logging.getLogger("offloadd.lightning")

_KEPT: list[OffloaddStrategy] = []
"""The strategy whose engine outlived its last run (``teardown``): one at most per process,
destroyed when another strategy runs."""

_PRECISION_KEYS = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
                   "16-true": "fp16"}

check_versions("lightning")

__all__ = ["CHECKPOINT_TAG", "OffloaddStrategy", "UnsupportedVersionError",
           "convert_zero_checkpoint_to_fp32_state_dict"]


_REMOTE_DEVICES = (None, "cpu", "nvme")


class OffloaddStrategy(DDPStrategy):
    """Lightning strategy training through ``trainer.initialize`` (see module docstring).

    The keywords are ``DeepSpeedStrategy``'s, with its defaults and meanings: without
    ``config`` they build the same DeepSpeed config Lightning would (``stage`` 2 unless
    told; ``offload_optimizer`` / ``offload_parameters`` to ``offload_*_device``, ``cpu``
    by default, with ``nvme_path`` for ``nvme``); ``config`` (a dict or JSON path)
    replaces them, as there, and so does a JSON file named by ``PL_DEEPSPEED_CONFIG_PATH``
    when ``config`` is not given. At stage 3 the modules a LightningModule builds in
    ``configure_model`` are built under ``trainer.zero.Init`` (the guide's "Shard Model
    Instantly"; ``model_sharded_context``): their parameters are ``meta`` until the
    engine materialises them unit by unit, so no rank, host or GPU, ever holds the whole
    model. ``remote_device`` is where DeepSpeed's ``zero.Init`` puts parameters while
    they are built; here the engine places partitions where ``offload_param.device``
    says, so it is checked and kept (``self.remote_device``).
    Buffer, bucket and aio sizes are the daemon's own and pass silently
    (``trainer.deepspeed_features.SILENT_KEYS``). ``load_full_weights`` is not supported
    and raises when set.
    """

    strategy_name = "offloadd"

    def __init__(self, accelerator: Any = None, zero_optimization: bool = True,
                 stage: int = 2, remote_device: str | None = None,
                 offload_optimizer: bool = False, offload_parameters: bool = False,
                 offload_params_device: str = "cpu", nvme_path: str = "/local_nvme",
                 params_buffer_count: int = 5, params_buffer_size: int = 100_000_000,
                 max_in_cpu: int = 1_000_000_000, offload_optimizer_device: str = "cpu",
                 optimizer_buffer_count: int = 4, block_size: int = 1_048_576,
                 queue_depth: int = 8, single_submit: bool = False,
                 overlap_events: bool = True, thread_count: int = 1,
                 pin_memory: bool = False, sub_group_size: int = 1_000_000_000_000,
                 contiguous_gradients: bool = True, overlap_comm: bool = True,
                 allgather_partitions: bool = True, reduce_scatter: bool = True,
                 allgather_bucket_size: int = 200_000_000,
                 reduce_bucket_size: int = 200_000_000,
                 zero_allow_untested_optimizer: bool = True,
                 logging_batch_size_per_gpu: str | int = "auto",
                 config: dict[str, Any] | str | os.PathLike[str] | None = None,
                 logging_level: int = logging.WARN, parallel_devices: Any = None,
                 cluster_environment: Any = None, loss_scale: float = 0,
                 initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: int = 1,
                 partition_activations: bool = False, cpu_checkpointing: bool = False,
                 contiguous_memory_optimization: bool = False,
                 synchronize_checkpoint_boundary: bool = False,
                 load_full_weights: bool = False, precision_plugin: Any = None,
                 process_group_backend: str | None = None,
                 timeout: datetime.timedelta | None = datetime.timedelta(seconds=1800),
                 exclude_frozen_parameters: bool = False) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout)
        if remote_device not in _REMOTE_DEVICES:
            raise ValueError(f"OffloaddStrategy(remote_device={remote_device!r}): use one of "
                             f"{list(_REMOTE_DEVICES)}")
        if load_full_weights:
            raise ValueError("OffloaddStrategy(load_full_weights=True) is not supported: "
                             "fit(ckpt_path=...) takes the strategy's own checkpoint "
                             "directories; load a single-file model with "
                             "trainer.load_pretrained before fit")
        self.exclude_frozen_parameters = exclude_frozen_parameters
        """Checkpoints leave frozen parameters out (a LoRA run's base), as DeepSpeed's
        strategy saves them; they load as the module's ``strict_loading`` says (False:
        the frozen values the module has are kept)."""
        self.remote_device = remote_device
        logging.getLogger("offloadd.deepspeed").setLevel(logging_level)
        self.loss_scaling = {"loss_scale": loss_scale, "initial_scale_power": initial_scale_power,
                             "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
                             "min_loss_scale": min_loss_scale}
        """fp16's loss scaling, for ``precision="16-mixed"`` without a config ``fp16``."""
        source = "config"
        if config is None and os.environ.get(CONFIG_ENV):
            config, source = os.environ[CONFIG_ENV], CONFIG_ENV  # as DeepSpeedStrategy reads it
        if config is None:
            config = _default_config(
                zero_optimization=zero_optimization, stage=stage,
                offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
                offload_params_device=offload_params_device,
                offload_optimizer_device=offload_optimizer_device, nvme_path=nvme_path,
                zero_extra={"contiguous_gradients": contiguous_gradients,
                            "overlap_comm": overlap_comm,
                            "allgather_partitions": allgather_partitions,
                            "reduce_scatter": reduce_scatter,
                            "allgather_bucket_size": allgather_bucket_size,
                            "reduce_bucket_size": reduce_bucket_size,
                            "sub_group_size": sub_group_size},
                buffers={"params_buffer_count": params_buffer_count,
                         "params_buffer_size": params_buffer_size, "max_in_cpu": max_in_cpu,
                         "optimizer_buffer_count": optimizer_buffer_count,
                         "pin_memory": pin_memory},
                aio={"block_size": block_size, "queue_depth": queue_depth,
                     "single_submit": single_submit, "overlap_events": overlap_events,
                     "thread_count": thread_count},
                activations={"partition_activations": partition_activations,
                             "cpu_checkpointing": cpu_checkpointing,
                             "contiguous_memory_optimization": contiguous_memory_optimization,
                             "synchronize_checkpoint_boundary": synchronize_checkpoint_boundary},
                zero_allow_untested_optimizer=zero_allow_untested_optimizer,
                logging_batch_size_per_gpu=logging_batch_size_per_gpu)
        elif isinstance(config, (str, os.PathLike)):
            config = _read_config(Path(config), source)
        if not isinstance(config, dict):
            raise ValueError("OffloaddStrategy(config=...) takes a DeepSpeed-style config dict "
                             f"or a JSON path, got {type(config).__name__}")
        self.config: dict[str, Any] = copy.deepcopy(config)
        self.engine: Engine | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``offloadd`` and ``offloadd_stage_*``, as Lightning registers ``deepspeed_stage_*``."""
        named: dict[str, tuple[str, dict[str, Any]]] = {
            "offloadd": ("offloadd with ZeRO stage 2 (DeepSpeedStrategy's default)", {}),
            "offloadd_stage_1": ("offloadd with ZeRO stage 1", {"stage": 1}),
            "offloadd_stage_2": ("offloadd with ZeRO stage 2", {"stage": 2}),
            "offloadd_stage_2_offload": ("offloadd ZeRO stage 2, optimizer in the daemon",
                                         {"stage": 2, "offload_optimizer": True}),
            "offloadd_stage_3": ("offloadd with ZeRO stage 3", {"stage": 3}),
            "offloadd_stage_3_offload": (
                "offloadd ZeRO stage 3, parameters and optimizer in the daemon",
                {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
            "offloadd_stage_3_offload_nvme": (
                "offloadd ZeRO stage 3, parameters and optimizer on NVMe",
                {"stage": 3, "offload_optimizer": True, "offload_parameters": True,
                 "remote_device": "nvme", "offload_params_device": "nvme",
                 "offload_optimizer_device": "nvme"}),
        }
        for name, (description, keywords) in named.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **keywords)

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
    def _stage_3(self) -> bool:
        return int(self.config.get("zero_optimization", {}).get("stage", 0)) == 3

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Stage 3: no device or empty-init context (``model_sharded_context`` keeps the
        parameters ``meta`` and the engine initialises them), as DeepSpeed's strategy."""
        if not self._stage_3:
            with super().tensor_init_context(empty_init=empty_init):
                yield
            return
        if empty_init is False:
            raise NotImplementedError("OffloaddStrategy at ZeRO stage 3 initialises the "
                                      "parameters configure_model builds (zero.Init): "
                                      "empty_init=False cannot be honoured")
        yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """``configure_model`` under ``trainer.zero.Init`` at stage 3 (see the class
        docstring)."""
        with zero_init.Init(config_dict_or_path=self.config, enabled=self._stage_3):
            yield

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
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer_)
        fitting = trainer_.state.fn == TrainerFn.FITTING
        for other in [strategy for strategy in _KEPT if strategy is not self]:
            other._destroy_engine()
        self._release_kept_engine(always=fitting)
        self._module_to_device()
        self.setup_precision_plugin()
        if fitting:
            self._initialize_engine(trainer_)
        elif self.engine is not None:
            self.model = self.engine  # the engine that trained this module evaluates it
        else:
            self._initialize_evaluation_engine(trainer_)
        if self._stage_3:
            _summarize_partitioned(trainer_)
        self.barrier()

    def _module_to_device(self) -> None:
        """``model_to_device``, but at stage 3 the parameters stay where they are: the
        engine copies each unit to the device as it partitions it, so a model larger than
        the GPU is never there whole (Lightning's DDP ``model_to_device`` would move all
        of it first, and fails on the ``meta`` parameters ``configure_model`` built).
        Buffers go, and so do a kept engine's empty parameters, which Lightning's
        ``teardown`` moved to the CPU (``model.device`` reads them)."""
        if not self._stage_3:
            self.model_to_device()
            return
        device = self.root_device
        assert self.lightning_module is not None
        for module in self.lightning_module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    module._buffers[name] = buffer.to(device)
            for param in module.parameters(recurse=False):
                if not param.is_meta and param.numel() == 0:
                    param.data = param.data.to(device)

    def _release_kept_engine(self, *, always: bool) -> None:
        """Destroy the kept engine (its module keeps the trained weights) where this run
        is over another module, or ``always`` (fit: ``configure_optimizers`` must see
        the module whole; at stage 3 the engine holds its parameters empty, so groups
        chosen by shape, as no-decay groups are, would all come out one)."""
        if self.engine is not None and (always or self.engine.module is not self.lightning_module):
            # fit builds the next engine over this very module: a handover
            self._destroy_engine(handover=always and self.engine.module is self.lightning_module)

    def _destroy_engine(self, *, handover: bool = False) -> None:
        if self.engine is not None:
            self.engine.destroy(handover=handover)
            self.engine = None
        if self in _KEPT:
            _KEPT.remove(self)

    def _initialize_engine(self, trainer_: LightningTrainer) -> None:
        module = self.lightning_module
        assert isinstance(module, LightningModule)
        settings = self._engine_config(trainer_)
        model_parameters: Any = [p for p in module.parameters() if p.requires_grad]
        client_optimizer = None
        if "optimizer" not in settings:
            client_optimizer, schedulers = _client_optimizer(module)
            settings["optimizer"], model_parameters = ds_facade.optimizer_section(
                client_optimizer)
            self.lr_scheduler_configs = schedulers
        engine, zero, _, _ = initialize(model=module, model_parameters=model_parameters,
                                                config=settings, dist_init_required=False)
        if client_optimizer is not None:
            ds_facade.link_groups(client_optimizer, zero)
        self.engine = engine
        self.model = engine
        self.optimizers = [ds_facade.OptimizerView(zero, engine.module)]

    def _initialize_evaluation_engine(self, trainer_: LightningTrainer) -> None:
        """An engine over a module no engine holds, for ``test``/``validate``/``predict``:
        the config's placement (stage 3 partitions it, offload puts it in the daemon).
        It never steps, but its parameter groups must be fit's for fit's checkpoints to
        load (each group has units of its own): without an ``optimizer`` section they
        come from ``configure_optimizers``, as in fit (Lightning's DeepSpeed strategy
        skips it outside fit; where it fails there, say on
        ``trainer.estimated_stepping_batches`` without training data, one group is
        used, logged). At stage 3 it is an inference engine (``initialize(inference=
        True)``): fit's units, holding the weights in the training dtype and no optimizer
        state (no fp32 master, no moments); below stage 3 the module keeps its weights
        whole and the engine holds that optimizer's state, as fit's does."""
        module = self.lightning_module
        assert isinstance(module, LightningModule)
        settings = self._engine_config(trainer_)
        settings.pop("scheduler", None)
        model_parameters: Any = None
        if "optimizer" not in settings:
            try:
                client_optimizer, _ = _client_optimizer(module)
            except Exception as error:  # the module's own code, run outside fit
                _log.warning("OffloaddStrategy: configure_optimizers() failed outside fit "
                             "(%s: %s); evaluating with one parameter group, so a "
                             "checkpoint of a fit with several will not load",
                             type(error).__name__, error)
            else:
                settings["optimizer"], model_parameters = ds_facade.optimizer_section(
                    client_optimizer)
        engine, _, _, _ = initialize(model=module, model_parameters=model_parameters,
                                     config=settings, dist_init_required=False,
                                     inference=self._stage_3)
        self.engine = engine
        self.model = engine

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
            section = _PRECISION_KEYS[precision]
            if section == "fp16" and "fp16" not in settings:
                settings["fp16"] = dict(self.loss_scaling)
            settings.setdefault(section, {})["enabled"] = True
        elif precision != "32-true":
            raise ValueError(f"OffloaddStrategy supports precision 32-true, bf16-mixed, "
                             f"bf16-true, 16-mixed and 16-true, got {precision!r}")
        return settings

    # ---------------------------------------------------------- checkpoints

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's full fp32 ``state_dict`` on rank 0 (``{}`` elsewhere).

        Collective; during or after ``fit`` (the engine stays open until a run over
        another module, or the process's exit).
        """
        if self.engine is None:
            raise ValueError("consolidated_state_dict() needs the engine: call it during "
                             "or after fit()")
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
        self.engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=client_state,
                                    exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Everything for ``fit``; the weights alone for ``test``/``validate``/``predict``
        (as Lightning's DeepSpeed strategy loads).

        ``weights_only`` is Lightning's. Lightning 2.6 passes None to a strategy that
        restores after setup (this one, DeepSpeed's), whatever the caller gave; None
        unpickles the rank files unrestricted, as DeepSpeed's strategy does, so
        hyper-parameters holding the module's own classes (an ``argparse.Namespace``, a
        config dataclass) load; ``True`` refuses them. Load only checkpoints you trust."""
        assert self.engine is not None and self.lightning_module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / CHECKPOINT_TAG).is_dir():
            raise ValueError(f"{path} is not an OffloaddStrategy checkpoint (a directory with "
                             f"a {CHECKPOINT_TAG}/ folder written by save_checkpoint)")
        module = self.lightning_module
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = engine_checkpoint.load_checkpoint(
            self.engine, path, CHECKPOINT_TAG,
            LoadOptions(load_optimizer_states=fitting, load_lr_scheduler_states=fitting,
                        load_module_strict=module.strict_loading),
            weights_only=bool(weights_only))
        return client_state

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored it in load_checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The engine restored the weights in ``load_checkpoint``."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The engine restored the optimizer in ``load_checkpoint``."""

    def teardown(self) -> None:
        """The engine stays open (``test``/``predict`` after ``fit`` evaluate through it;
        see the module docstring); ``self.model`` is the LightningModule again.

        Lightning's teardown moves the module to the CPU. A kept engine owns where its
        module's parameters live, so the module stays: on a GPU that move made host copies
        of parameters the engine keeps on the device, which the next ``test`` mixed with
        device inputs, at stage 3 and at stage 2)."""
        if self.engine is None:
            # Setup failed before the engine materialised what configure_model built under
            # zero.Init: moving it would raise over the setup's error (a config typo
            # surfaced as "Cannot copy out of meta tensor").
            module = self.lightning_module
            with (_stays_put(module) if module is not None and any(
                    param.is_meta for param in module.parameters()) else contextlib.nullcontext()):
                super().teardown()
            return
        module = self.lightning_module
        assert module is not None
        self.model = module
        if self not in _KEPT:
            _KEPT.append(self)
        with _stays_put(module):
            super().teardown()

    def setup_distributed(self) -> None:
        """DDP's, but without the compute device for the strict twin (``TwinAccelerator``):
        torch's process group knows no backend for its device type, and the engine's
        collectives there are gloo's."""
        if self.root_device.type != twin.TWIN_TYPE:
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = "gloo"
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, "gloo", timeout=self._timeout)


@contextlib.contextmanager
def _stays_put(module: nn.Module) -> Iterator[None]:
    """``module.cpu()`` does nothing inside (Lightning's ``Strategy.teardown`` calls it)."""
    module.cpu = lambda: module  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu


def _summarize_partitioned(trainer_: LightningTrainer) -> None:
    """The model summary callbacks (on by default) count ZeRO-3's partitioned parameters
    as ``DeepSpeedStrategy`` has them do (``DeepSpeedSummary``: whole sizes from
    ``ds_numel``, a "Params per Device" column): Lightning picks that summary by the
    strategy's class, and its default one counts ``numel()``, 0 between gathers."""
    for callback in trainer_.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummary):
            callback._summary = functools.partial(  # type: ignore[method-assign]
                _partitioned_summary, max_depth=callback._max_depth)


def _partitioned_summary(_trainer: Any, module: LightningModule, *,
                         max_depth: int) -> DeepSpeedSummary:
    return DeepSpeedSummary(module, max_depth=max_depth)


class TwinAccelerator(Accelerator):
    """Lightning's accelerator for offloadd's strict device twin (``trainer.device.twin``,
    ``OFFLOADD_TWIN_DEVICE=strict``): ``Trainer(accelerator=TwinAccelerator(),
    strategy=OffloaddStrategy(...))`` runs a Lightning script on a CPU host with its
    batches, module and engine on a device that refuses what CUDA refuses (host tensors
    mixed in, a capacity when ``OFFLOADD_TWIN_MEMORY`` caps it), so a test catches what a
    GPU run would meet. One twin device per process."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != twin.TWIN_TYPE:
            raise ValueError(f"TwinAccelerator runs on the twin's device, got {device}")

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {"twin_allocated_bytes": twin_memory.memory_allocated(),
                "twin_peak_bytes": twin_memory.max_memory_allocated()}

    def teardown(self) -> None:
        """Nothing to release: the twin's memory is the host's."""

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return _parse_cpu_cores(devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [twin.twin_device()] * _parse_cpu_cores(devices)

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return twin.twin_device_mode() == "strict"

    @staticmethod
    def name() -> str:
        return "offloadd_twin"


def convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir: str | os.PathLike[str], output_file: str | os.PathLike[str],
        tag: str | None = None) -> dict[str, Any]:
    """Lightning's ``lightning.pytorch.utilities.deepspeed`` function of that name, for an
    ``OffloaddStrategy`` checkpoint: one file holding the whole fp32 ``state_dict`` and
    Lightning's other keys (epoch, loops, callbacks, hyper-parameters), which
    ``LightningModule.load_from_checkpoint`` and regular strategies load. As there, the
    optimizer and LR scheduler states are left out, so ``fit(ckpt_path=...)`` cannot
    resume from it. Reads one unit at a time, without torch.distributed; returns what it
    wrote. As Lightning's, it unpickles the checkpoint unrestricted (hyper-parameters may
    hold the module's own classes): convert only checkpoints you trust."""
    from trainer.state.export import consolidate_checkpoint

    state, client_state = consolidate_checkpoint(checkpoint_dir, tag or CHECKPOINT_TAG,
                                                 weights_only=False)
    checkpoint = {key: value for key, value in client_state.items()
                  if key not in ("optimizer_states", "lr_schedulers")}
    checkpoint["state_dict"] = state
    torch.save(checkpoint, output_file)
    return checkpoint


def _read_config(path: Path, source: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"OffloaddStrategy: {source} names {path}, which cannot be read "
                         f"({error.strerror}): pass an existing DeepSpeed JSON config") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"OffloaddStrategy: {source} names {path}, which is not JSON "
                         f"({error})") from None


def _client_optimizer(module: LightningModule) -> tuple[torch.optim.Optimizer, list[Any]]:
    """``configure_optimizers``' one optimizer and its schedulers (at most one)."""
    optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
    if len(optimizers) != 1 or len(schedulers) > 1:
        raise ValueError("OffloaddStrategy needs exactly one optimizer and at most one "
                         "scheduler from configure_optimizers")
    return optimizers[0], schedulers


def _default_config(*, zero_optimization: bool, stage: int, offload_optimizer: bool,
                    offload_parameters: bool, offload_params_device: str,
                    offload_optimizer_device: str, nvme_path: str, zero_extra: dict[str, Any],
                    buffers: dict[str, Any], aio: dict[str, Any], activations: dict[str, Any],
                    zero_allow_untested_optimizer: bool,
                    logging_batch_size_per_gpu: str | int) -> dict[str, Any]:
    """The config ``DeepSpeedStrategy`` builds from its keywords (``_create_default_config``)."""
    config: dict[str, Any] = {"activation_checkpointing": activations, "aio": aio}
    if zero_optimization:
        zero: dict[str, Any] = {"stage": stage, **zero_extra}
        if offload_optimizer:
            zero["offload_optimizer"] = {
                "device": offload_optimizer_device, "nvme_path": nvme_path,
                "buffer_count": buffers["optimizer_buffer_count"],
                "pin_memory": buffers["pin_memory"]}
        if offload_parameters:
            zero["offload_param"] = {
                "device": offload_params_device, "nvme_path": nvme_path,
                "buffer_count": buffers["params_buffer_count"],
                "buffer_size": buffers["params_buffer_size"],
                "max_in_cpu": buffers["max_in_cpu"], "pin_memory": buffers["pin_memory"]}
        config = {"zero_allow_untested_optimizer": zero_allow_untested_optimizer,
                  "zero_optimization": zero, **config}
    if logging_batch_size_per_gpu != "auto":
        config["train_micro_batch_size_per_gpu"] = logging_batch_size_per_gpu
    return config


OffloaddStrategy.register_strategies(StrategyRegistry)
# Lightning's guide converts with its own function of that name, which needs DeepSpeed
# and its checkpoint layout (without them: "Requirement 'deepspeed' not met ... pip install
# deepspeed"): from here on that name is this module's, for this strategy's checkpoints.
lightning_deepspeed.convert_zero_checkpoint_to_fp32_state_dict = (
    convert_zero_checkpoint_to_fp32_state_dict)
