"""The DeepSpeed surface that Hugging Face transformers and accelerate call, served by offloadd.

transformers' ``Trainer`` and accelerate's ``DeepSpeedPlugin`` reach DeepSpeed
through ``import deepspeed`` at a few places: ``deepspeed.initialize`` (in
``Accelerator.prepare``), ``deepspeed.comm.init_distributed``, ``deepspeed.zero``
(``from_pretrained`` under ZeRO-3), ``deepspeed.utils.logger``,
``deepspeed.checkpoint.utils`` and ``deepspeed.ops.adam.DeepSpeedCPUAdam``.
This module implements exactly those names on top of ``trainer.initialize``;
``trainer.hf`` registers them as the ``deepspeed`` module of the process that
asked for it (never on disk, so an installed DeepSpeed is not shadowed).

What the callers expect that ``trainer.initialize`` does not do itself:

- a torch optimizer (the Trainer's default AdamW when the config has no
  ``optimizer`` section) is turned into the config's ``optimizer`` section and
  per-group hyper-parameters (``optimizer_section``);
- a callable ``lr_scheduler`` (the Trainer's scheduler when the config has no
  ``scheduler`` section) is built over the engine's optimizer and stepped and
  checkpointed by the engine, as DeepSpeed does;
- accelerate's backward protocol: ``set_gradient_accumulation_boundary`` then
  ``backward`` on every micro-batch and ``step`` only at the boundary, with
  ``scale_wrt_gas=False`` when the loss is already divided
  (``DeepSpeedEngine``);
- schedulers need a ``torch.optim.Optimizer`` (``OptimizerView``);
- neither an optimizer object nor an ``optimizer`` section (HF Trainer's ``evaluate`` or
  ``predict`` before any ``train``, Accelerate's ``prepare(model)``) is DeepSpeed's
  inference engine: at ZeRO stage 3 the engine holds the weights partitioned in the
  training dtype and no optimizer state (``trainer.initialize(inference=True)``);
- under ZeRO-3, ``from_pretrained`` builds the model inside ``deepspeed.zero.Init``
  (``trainer.zero.Init``: every parameter on ``meta``) and loads it on rank 0 through
  ``deepspeed.zero.GatheredParameters``, whose writes into parameters not yet
  materialised are left to ``initialize`` (``GatheredParameters``).
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import warnings
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trainer import api
from trainer.config import parse_config
from trainer.dist import distributed
from trainer.state.checkpoint import consolidate_fp32_state_dict
from trainer.zero import gathered
from trainer.zero import init as zero_init
from trainer.zero.engine import Engine, EngineInferenceError, move_model
from trainer.zero.optimizer import ZeroOptimizer
from trainer.zero.precision import DTYPES

logger = logging.getLogger("offloadd.deepspeed")

VALID_LR_SCHEDULES = ["WarmupLR", "WarmupDecayLR"]
"""DeepSpeed's scheduler names that accelerate looks for (``runtime.lr_schedules``)."""

_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """DeepSpeed's CPU Adam, as scripts build it before ``deepspeed.initialize`` (DeepSpeed-Chat's
    ``DeepSpeedCPUAdam(grouped_params, lr=..., betas=...)``) and as accelerate builds it from a
    torch Adam/AdamW when the optimizer is offloaded.

    Only a description: ``initialize`` turns it into the config's ``optimizer`` section and
    param groups (``optimizer_section``), and the step runs in offloadd (the daemon's CPU
    Adam). It is a ``torch.optim.Optimizer`` with complete groups, as DeepSpeed's is, so an
    LR scheduler can be built over it first (torch's, ``transformers.get_scheduler``) and
    passed as ``lr_scheduler=``: the groups are then the engine's (``link_groups``).
    """

    ADAMW_KEYWORD = "adamw_mode"

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, **options: Any) -> None:
        name = type(self).__name__
        adamw_mode = bool(options.pop(self.ADAMW_KEYWORD, True))
        if amsgrad:
            raise ValueError(f"{name}(amsgrad=True) is not supported by offloadd: use "
                             "amsgrad=False")
        if not bias_correction:
            raise ValueError(f"{name}(bias_correction=False) is not supported by offloadd: its "
                             "Adam always corrects the moments' bias")
        _bare_optimizer(self, {"lr": lr, "betas": tuple(betas), "eps": eps,
                               "weight_decay": weight_decay})
        self.adamw_mode = adamw_mode
        groups = model_params if isinstance(model_params, list) else list(model_params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._param_groups: list[dict[str, Any]] = groups
        """As given: accelerate passes the torch optimizer's own list (see ``link_groups``)."""
        self.client: Any = _optimizer_owning(groups)
        """The torch optimizer whose ``param_groups`` list this is (the one the user's LR
        scheduler holds), or None."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        raise RuntimeError(f"{type(self).__name__} only describes the optimizer: step the engine "
                           "deepspeed.initialize returned (engine.step())")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in offloadd and are overwritten each window."""


class FusedAdam(DeepSpeedCPUAdam):
    """DeepSpeed's GPU Adam (``deepspeed.ops.adam.FusedAdam``), which DeepSpeed-Chat builds when
    the optimizer is not offloaded: offloadd steps every optimizer on the host, so it is the
    same description as ``DeepSpeedCPUAdam`` (its decoupled-decay switch is ``adam_w_mode``)."""

    ADAMW_KEYWORD = "adam_w_mode"


def _bare_optimizer(optimizer: torch.optim.Optimizer, defaults: dict[str, Any]) -> None:
    """What torch's LR schedulers and optimizer hooks read from an optimizer, set without
    ``torch.optim.Optimizer.__init__`` (whose param groups would be new dicts)."""
    optimizer.defaults = defaults
    optimizer.state = defaultdict(dict)
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizer._optimizer_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_state_dict_post_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()


def _optimizer_owning(groups: list[dict[str, Any]]) -> torch.optim.Optimizer | None:
    """The torch optimizer whose ``param_groups`` is ``groups``: accelerate hands
    ``DeepSpeedCPUAdam`` only that list (``map_pytorch_optim_to_deepspeed``), while the
    user's scheduler holds the optimizer, which ``link_groups`` must mark as stepped. One
    look at the list's referrers, once per ``prepare``."""
    for owner in gc.get_referrers(groups):
        if isinstance(owner, torch.optim.Optimizer) and owner.param_groups is groups:
            return owner
    return None


def optimizer_section(optimizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The config ``optimizer`` section and param groups equivalent to a torch optimizer."""
    if isinstance(optimizer, DeepSpeedCPUAdam):
        decoupled = optimizer.adamw_mode
    elif isinstance(optimizer, torch.optim.AdamW):
        decoupled = True
    elif type(optimizer) is torch.optim.Adam:
        decoupled = bool(optimizer.defaults.get("decoupled_weight_decay", False))
    else:
        raise ValueError(
            f"offloadd runs Adam/AdamW only, got the optimizer {type(optimizer).__name__}: use "
            "torch.optim.AdamW (the Trainer's default, optim='adamw_torch') or put an "
            "'optimizer' section in the DeepSpeed config")
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise ValueError("amsgrad=True is not supported by offloadd: use amsgrad=False")
    defaults = {key: optimizer.defaults[key] for key in _HYPER_KEYS}
    section = {"type": "AdamW" if decoupled else "Adam",
               "params": {**defaults, "betas": list(defaults["betas"]),
                          "adam_w_mode": decoupled}}
    groups = [{"params": list(group["params"]),
               **{key: group[key] for key in _HYPER_KEYS if key in group}}
              for group in optimizer.param_groups]
    return section, groups


class OptimizerView(torch.optim.Optimizer):
    """The engine's optimizer as a ``torch.optim.Optimizer``, for torch/HF LR schedulers.

    ``param_groups`` is the engine optimizer's own list, so a scheduler's ``lr``
    reaches the next step. ``step``/``zero_grad`` do nothing: the engine steps at
    the accumulation boundary inside ``backward``/``step``.
    """

    def __init__(self, zero: ZeroOptimizer, module: nn.Module) -> None:  # no params here
        self.zero = zero
        self.parameter_offload = ParameterOffload(module)
        _bare_optimizer(self, {key: value for key, value in zero.param_groups[0].items()
                               if key != "params"})
        self.overflow = False
        """The last boundary's step was skipped (fp16 overflow); accelerate reads it."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.zero.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """The engine applies the step; see the class docstring."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in offloadd and are overwritten each window."""

    def state_dict(self) -> dict[str, Any]:
        return self.zero.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.zero.load_state_dict(state_dict)


class ParameterOffload:
    """``engine.optimizer.parameter_offload`` (DeepSpeed's ``DeepSpeedZeRoOffload``), as TRL's
    ``unwrap_model_for_generation`` uses it around a generation with every parameter
    gathered: it removes the ``forward_hooks`` and ``backward_hooks`` listed here, then
    registers the module's hooks again (``_register_deepspeed_module``).

    offloadd's unit hooks are not in these lists and stay installed: inside
    ``GatheredParameters`` over every parameter each unit is held gathered, so they gather
    and release nothing (``tests/test_trl_generation.py`` counts it), and a generation with
    the model's own hooks left in place is what the engine's evaluation passes already run.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.forward_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:
        """Nothing was removed (the class docstring), so nothing is registered again."""

    _register_hooks_recursively = _register_deepspeed_module  # DeepSpeed before 0.16.4


class AccumulationMismatchError(ValueError):
    """accelerate's accumulation boundary and the engine's disagree; names the fix."""


class DeepSpeedEngine(nn.Module):
    """``trainer.Engine`` with the DeepSpeedEngine methods accelerate and the Trainer call."""

    def __init__(self, engine: Engine, config: dict[str, Any], optimizer: OptimizerView) -> None:
        super().__init__()
        self.engine = engine
        self.config = config
        """The DeepSpeed config dict (the Trainer reads ``config["zero_optimization"]``)."""
        self.optimizer = optimizer
        self.lr_scheduler = engine.lr_scheduler
        self.training_dataloader: Any = None
        """The loader ``initialize(training_data=)`` built (DeepSpeed's attribute), or None."""
        self._boundary: bool | None = None
        self._applied = False

    def __getattr__(self, name: str) -> Any:
        """After this class's own names: the engine's other DeepSpeed-named accessors
        (``global_samples``, ``skipped_steps``, ``loss_scale``), then, as DeepSpeed's engine
        does, the wrapped model's (DeepSpeed-Chat calls
        ``engine.gradient_checkpointing_enable()``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "engine":
                raise
        for owner in (self.engine, self.engine.module):
            try:
                return getattr(owner, name)
            except AttributeError:
                continue
        raise AttributeError(f"offloadd's DeepSpeedEngine has no attribute {name!r}")

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None) -> None:
        self.engine.compile(backend=backend, compile_kwargs=compile_kwargs, schedule=schedule)

    @property
    def is_compiled(self) -> bool:
        return self.engine.is_compiled

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """accelerate's protocol: the next ``backward`` ends a window iff ``is_boundary``."""
        if is_boundary != self.engine.is_gradient_accumulation_boundary():
            raise AccumulationMismatchError(
                f"accelerate ends an accumulation window after {self.engine.micro_steps + 1} "
                f"micro-batches but gradient_accumulation_steps="
                f"{self.engine.gradient_accumulation_steps()}: make the number of batches per "
                "epoch a multiple of gradient_accumulation_steps (dataloader_drop_last=True "
                "or a dataset size to match)")
        self._boundary = is_boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True,
                 **_kwargs: Any) -> torch.Tensor:
        """Backward of one micro-batch; ``scale_wrt_gas=False``: the loss is already
        divided by the accumulation steps (the Trainer's token-count normalisation)."""
        if not scale_wrt_gas:
            loss = loss * self.engine.gradient_accumulation_steps()
        self.engine.backward(loss)
        if self._boundary is False:
            self.engine.step()  # accelerate calls step() only at the boundary: count this one
        return loss

    def step(self) -> None:
        skipped = self.engine.skipped_steps
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        self.optimizer.overflow = self.engine.skipped_steps != skipped
        self._applied = boundary and not self.optimizer.overflow
        self._boundary = None

    def was_step_applied(self) -> bool:
        """DeepSpeed's: whether the last ``step()`` updated the parameters (False inside an
        accumulation window and on an fp16 overflow's skipped step)."""
        return self._applied

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def empty_partition_cache(self) -> None:
        self.engine.empty_partition_cache()

    def get_global_grad_norm(self) -> float | None:
        return self.engine.get_global_grad_norm()

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_mom(self) -> list[tuple[float, float]]:
        """Each group's Adam ``betas`` (DeepSpeed's momentum of an Adam optimizer)."""
        return [tuple(group["betas"]) for group in self.optimizer.param_groups]

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def zero_offload_optimizer(self) -> bool:
        return self.engine.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.engine.config.zero_optimization.offload_param.device != "none"

    def zero_cpu_offload(self) -> bool:
        return self.engine.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def steps_per_print(self) -> int:
        """The config's value (DeepSpeed's default 10); offloadd logs no per-step lines."""
        return int(self.config.get("steps_per_print", 10))

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.get("wall_clock_breakdown", False))

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: every rank (offloadd has no model parallelism)."""
        return self.engine.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        return self.engine.local_rank

    @property
    def global_rank(self) -> int:
        return self.engine.global_rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def bfloat16_enabled(self) -> bool:
        return self.engine.bfloat16_enabled()

    def fp16_enabled(self) -> bool:
        return self.engine.fp16_enabled()

    def zero_optimization_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps()

    def train_batch_size(self) -> int:
        return self.engine.train_batch_size()

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.train_micro_batch_size_per_gpu()

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """HF Trainer passes ``exclude_frozen_parameters=True`` for PEFT models (it looks
        for the argument in this signature)."""
        return self.engine.save_checkpoint(save_dir, tag, client_state, save_latest,
                                           exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False
                        ) -> tuple[str | None, dict[str, Any]]:
        """HF Trainer resumes a PEFT model with ``load_module_strict=False``."""
        return self.engine.load_checkpoint(load_dir, tag, load_module_strict,
                                           load_optimizer_states, load_lr_scheduler_states,
                                           load_module_only)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Always: weights are gathered unit by unit, so saving never needs the whole
        model on a device at once."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor]:
        """The full model in the training dtype on rank 0 (``{}`` elsewhere); collective."""
        state = consolidate_fp32_state_dict(self.engine)
        dtype = self.engine.precision.dtype
        if exclude_frozen_parameters:
            frozen = {name for name, param in self.module.named_parameters()
                      if not param.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        return {name: value.to(dtype) if value.is_floating_point() else value
                for name, value in state.items()}

    def save_16bit_model(self, save_dir: str | os.PathLike[str],
                         save_filename: str = "pytorch_model.bin") -> bool:
        return self.engine.save_16bit_model(save_dir, save_filename)

    def close(self) -> None:
        self.engine.close()

    def destroy(self) -> None:
        """DeepSpeed's ``destroy`` (what Accelerate's ``free_memory`` calls): ``Engine.destroy``."""
        self.engine.destroy()


class ModuleEngine(DeepSpeedEngine):
    """``deepspeed.initialize`` of a model with neither an optimizer object nor an
    ``optimizer`` section below ZeRO stage 3 (TRL's reference model, which its
    ``prepare_deepspeed`` builds at stage 0 unless the policy runs ZeRO-3; Accelerate's
    ``prepare(model)`` for an evaluation): as DeepSpeed does, the module on the rank's device
    in the training dtype, and no optimizer. Below stage 3 every rank keeps whole weights,
    so nothing is partitioned or offloaded and no daemon or optimizer state is made (a
    training engine with a default AdamW held 16 bytes a parameter for a model that never
    steps). ``backward`` and ``step`` are refused."""

    def __init__(self, model: nn.Module, config: dict[str, Any],
                 dist_init_required: bool | None) -> None:
        nn.Module.__init__(self)
        parsed = parse_config(config)
        if any(param.is_meta for param in model.parameters()):
            raise ValueError("the model's parameters are on meta (built under zero.Init), "
                             "which only ZeRO stage 3 materialises: use stage 3, or build the "
                             "model outside zero.Init")
        compute = api.start_compute(parsed, dist_init_required)
        self.dtype = DTYPES[parsed.dtype_name]
        move_model(model, compute.device, self.dtype, sharded=False)
        self.wrapped = model
        self.config = config
        self.stage = parsed.zero_optimization.stage
        self.compute_device = compute.device
        self.optimizer: Any = None
        self.lr_scheduler = None
        self.training_dataloader = None

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name == "wrapped":
                raise
            if name == "engine":  # what DeepSpeedEngine's training methods reach for
                raise AttributeError("this engine wraps the module only (it was given no "
                                     "optimizer): pass one to initialize to train") from None
        return getattr(self.wrapped, name)  # the model's, as DeepSpeed's engine forwards them

    @property
    def module(self) -> nn.Module:
        return self.wrapped

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True,
                 **_kwargs: Any) -> torch.Tensor:
        raise EngineInferenceError(
            "backward(): this engine has no optimizer (neither an optimizer object nor an "
            "'optimizer' config section was given, as for a reference model); pass one to "
            "initialize to train")

    def step(self) -> None:
        raise EngineInferenceError("step(): this engine has no optimizer; pass one to "
                                   "initialize to train")

    @property
    def device(self) -> torch.device:
        return self.compute_device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    def zero_optimization_stage(self) -> int:
        return self.stage

    def bfloat16_enabled(self) -> bool:
        return self.dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.dtype == torch.float16

    def close(self) -> None:
        """Nothing is held beyond the module."""

    def destroy(self) -> None:
        """Nothing is held beyond the module."""


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Any = None, config_params: Any = None, **unused: Any
               ) -> tuple[DeepSpeedEngine, OptimizerView | None, Any, Any]:
    """``deepspeed.initialize`` as accelerate calls it; returns DeepSpeed's 4-tuple."""
    if model is None:
        raise ValueError("initialize() needs model=")
    if mpu is not None:
        raise ValueError("model parallelism (mpu=) is not supported by offloadd: drop it")
    source = config if config is not None else config_params
    if isinstance(source, (str, os.PathLike)):
        source = _read_json(source)
    settings = copy.deepcopy(source) if source is not None else None
    if settings is None and args is not None:
        settings = _read_json(args.deepspeed_config)
    if settings is None:
        raise ValueError("initialize() needs config= or config_params= (a DeepSpeed config)")
    settings.pop("zero_allow_untested_optimizer", None)
    settings.pop("zero_force_ds_cpu_optimizer", None)
    if optimizer is not None:
        if "optimizer" in settings:
            raise ValueError("got both an optimizer object and an 'optimizer' config "
                             "section: remove one of them")
        settings["optimizer"], model_parameters = optimizer_section(optimizer)
    _check_client_scheduler(lr_scheduler, optimizer, settings)
    stage = settings.get("zero_optimization", {}).get("stage", 0)
    if "optimizer" not in settings and stage < 3:
        engine_only = ModuleEngine(model, settings, dist_init_required)
        return engine_only, None, None, None
    inference = "optimizer" not in settings
    engine, zero, loader, _built = api.initialize(
        model=model, model_parameters=model_parameters, config=settings,
        training_data=training_data, collate_fn=collate_fn,
        dist_init_required=dist_init_required, inference=inference)
    if optimizer is not None:
        client = optimizer.client if isinstance(optimizer, DeepSpeedCPUAdam) else optimizer
        link_groups(client if client is not None else optimizer, zero)
    view = OptimizerView(zero, engine.module)
    mark_stepped_by(zero, view)  # HF builds its scheduler over the view (lr_scheduler=)
    if lr_scheduler is not None:  # the object itself, or the callable's over the view
        engine.lr_scheduler = (lr_scheduler if hasattr(lr_scheduler, "step")
                               else lr_scheduler(view))
    wrapped = DeepSpeedEngine(engine, settings, view)
    wrapped.training_dataloader = loader
    return wrapped, view, loader, wrapped.lr_scheduler


def link_groups(client: Any, zero: ZeroOptimizer) -> None:
    """Make the client's torch optimizer follow the engine's: shared groups, and stepped.

    A torch LR scheduler built on the client's optimizer before ``prepare`` (an
    Accelerate loop's, Lightning's ``configure_optimizers``) keeps writing ``lr`` into
    that optimizer's groups; DeepSpeed steps that very optimizer, offloadd steps its
    own, so both share the group dicts, and the engine's steps mark it stepped
    (``mark_stepped_by``).
    """
    client_groups = client.param_groups
    for index, group in enumerate(client_groups):
        if "initial_lr" in group:
            zero.param_groups[index]["initial_lr"] = group["initial_lr"]
        client_groups[index] = zero.param_groups[index]
    mark_stepped_by(zero, client)


def mark_stepped_by(zero: ZeroOptimizer, optimizer: Any) -> None:
    """The engine's applied steps mark ``optimizer`` as stepped the way torch's LR scheduler
    checks it (``_opt_called``, set by the ``step`` wrapper ``LRScheduler`` installs): its
    own ``step`` never runs (the engine steps), and the scheduler's first ``step()`` would
    warn that it ran before ``optimizer.step()``. Both optimizers a scheduler may be built
    on need it: the client's (``link_groups``) and the ``OptimizerView`` (HF Trainer's
    ``lr_scheduler=`` callable, with a config optimizer and no scheduler section)."""
    optimizer_ref = weakref.ref(optimizer)

    def mark_stepped() -> None:
        stepped = optimizer_ref()
        if stepped is not None:
            stepped._opt_called = True

    zero.after_step.append(mark_stepped)


def _check_client_scheduler(lr_scheduler: Any, optimizer: Any, settings: dict[str, Any]) -> None:
    """Refuse, before anything is built, an ``lr_scheduler=`` the engine cannot step.

    DeepSpeed takes a callable (built here over the engine's optimizer) or a scheduler
    object; an object must have been built over the ``optimizer=`` object, whose groups
    become the engine's (``link_groups``), or its ``lr`` writes would never reach a step."""
    if lr_scheduler is None:
        return
    if "scheduler" in settings:
        raise ValueError("got both an lr_scheduler and a 'scheduler' config section: "
                         "remove one of them")
    if hasattr(lr_scheduler, "step"):
        bound = getattr(lr_scheduler, "optimizer", None)
        linked = (optimizer, getattr(optimizer, "client", None))
        if bound is None or not any(bound is candidate for candidate in linked):
            raise ValueError("the lr_scheduler object was not built over the optimizer passed as "
                             "optimizer=, so its learning rates would never reach offloadd's "
                             "steps: build it over that optimizer, pass a callable taking the "
                             "optimizer, or use a 'scheduler' config section")
    elif not callable(lr_scheduler):
        raise ValueError("pass lr_scheduler as a scheduler built over the optimizer= object, a "
                         "callable taking the optimizer, or use a 'scheduler' config section")


def _read_json(path: Any) -> dict[str, Any]:
    import json

    with open(path, encoding="utf-8") as handle:
        loaded: dict[str, Any] = json.load(handle)
    return loaded


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int | None = None, verbose: bool = True,
                     timeout: Any = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """``deepspeed.comm.init_distributed``: torchrun's group (``trainer.init_distributed``)."""
    distributed.init_distributed(dist_backend, init_method=init_method, timeout=timeout,
                                 rank=rank, world_size=world_size)


class GatheredParameters(gathered.GatheredParameters):
    """``deepspeed.zero.GatheredParameters`` as transformers calls it while it builds a model
    under ZeRO-3 (``from_pretrained``, ``from_config``, inside ``deepspeed.zero.Init``,
    which is ``trainer.zero.Init`` here).

    Parameters that ``zero.Init`` has not materialised yet have no storage to gather or
    write, and need none: what transformers writes into them on rank 0 is done again, for
    real, by ``initialize``, which streams the checkpoint the model was loaded from into
    the parameters transformers flagged as loaded (``trainer.state.pretrained.pending_source``)
    and runs the model's init on the rest. So they are passed over (and torch's warning
    that a copy into ``meta`` does nothing is silenced). Every other parameter is gathered
    as ``trainer.zero.GatheredParameters`` does. Code that needs their values (an edit
    such as ``resize_token_embeddings``) gets ``ZeroInitError`` naming the way round.
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor],
                 modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._pending = enabled and any(zero_init.unmaterialised(param) for param in params)
        if enabled and modifier_rank is not None and any(
                param.is_meta and not zero_init.unmaterialised(param) for param in params):
            # A new meta tensor (resize_token_embeddings' embedding): no checkpoint or init
            # would give it the values written here.
            raise zero_init.ZeroInitError(f"GatheredParameters(modifier_rank={modifier_rank}) "
                                          f"on a 'meta' parameter that zero.Init did not "
                                          f"build: {_EDIT_BEFORE_INITIALIZE}")
        super().__init__([param for param in params if not zero_init.unmaterialised(param)],
                         modifier_rank, fwd_module, enabled)
        self._quiet = warnings.catch_warnings() if self._pending else None

    def __enter__(self) -> GatheredParameters:
        if self._quiet is not None:
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message=_META_COPY_WARNING)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._quiet is not None:
                self._quiet.__exit__(None, None, None)
        error = exc[1] if len(exc) > 1 else None
        if self._pending and isinstance(error, (RuntimeError, NotImplementedError)) and (
                "meta" in str(error)):
            raise zero_init.ZeroInitError(
                f"{type(error).__name__}: {error} -- the values of parameters built under "
                f"ZeRO-3 were read: {_EDIT_BEFORE_INITIALIZE}") from error


_EDIT_BEFORE_INITIALIZE = (
    "from_pretrained/from_config under ZeRO-3 leave every parameter on 'meta' until the "
    "Trainer (or accelerate's prepare) initializes offloadd, so the model cannot be read or "
    "edited before that (resize_token_embeddings, for one). Build and edit the model before "
    "TrainingArguments(deepspeed=...) / the DeepSpeedPlugin exists (it is then built whole "
    "on every rank), or edit it once, save_pretrained it and train from that")

_META_COPY_WARNING = ".*copying from a non-meta parameter in the checkpoint to a meta parameter"
"""torch's ``_load_from_state_dict`` warning for each unmaterialised parameter transformers
loads into on rank 0 (see ``GatheredParameters``)."""


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], *_args: Any,
                                           **_kwargs: Any) -> Callable[..., Any]:
    """``partition_parameters``' constructor wrapper (transformers patches it around
    ``zero.Init``); ``trainer.zero.Init`` wraps no tensor constructor (it moves each new
    parameter to ``meta``), so it is the identity."""
    return fn


def clone_tensors_for_torch_save(item: Any, device: torch.device | None = None) -> Any:
    """``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: detached copies."""
    if torch.is_tensor(item):
        return item.detach().clone() if device is None else item.detach().to(device)
    if isinstance(item, dict):
        return type(item)({key: clone_tensors_for_torch_save(value, device)
                           for key, value in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(value, device) for value in item)
    return item
