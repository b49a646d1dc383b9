"""Engine configuration: DeepSpeed key names, parsed into keyword-only dataclasses.

``parse_config(dict | path)`` turns a DeepSpeed-style JSON config into an
``EngineConfig``. Every section is a frozen keyword-only dataclass whose field
docstrings give meaning and unit. Parsing is strict:

- unknown keys raise ``ValueError`` listing each one with a did-you-mean;
- renamed DeepSpeed keys raise ``ValueError`` naming the new key;
- DeepSpeed keys that mean nothing here (``IGNORED_KEYS``) are accepted and
  reported once with a ``UserWarning`` so nobody believes they took effect;
- a section's ``SPELLINGS`` accept DeepSpeed's other names of a value ("bfloat16"
  for "bf16"), its ``REFUSED`` name DeepSpeed values refused here and why.

Our own sections are ``offloadd`` (daemon connection) and ``units`` (how the
model is split into flat-parameter units).

The ``scheduler`` sections live in ``trainer.config_schedulers`` and the parsing machinery
(keys, "auto", coercion) in ``trainer.config_parse``; import their public names from here.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from offloadd.formats import MomentFormat
from trainer.config_parse import (
    AUTO_DEFAULT_KEYS,
    RENAMED_KEYS,
    build_section,
    check_value,
    flatten_typed_section,
    nest_dotted_keys,
    reporting_ignored,
)
from trainer.config_schedulers import (
    SCHEDULER_CONFIGS,
    OneCycleConfig,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupDecayLRConfig,
    WarmupLRConfig,
    WarmupType,
    build_scheduler,
)

__all__ = [
    "AUTO_DEFAULT_KEYS", "DTYPE_SPELLINGS", "RENAMED_KEYS", "SCHEDULER_CONFIGS",
    "STATE_DTYPE_FORMATS", "BatchSizes", "Bf16Config", "DataTypesConfig", "EngineConfig",
    "Fp16Config", "GradAccumDtype", "OffloadDevice", "OffloadDeviceConfig",
    "OffloadOptimizerConfig", "OffloaddConfig", "OneCycleConfig", "OptimizerConfig",
    "OptimizerType", "SchedulerConfig", "StateDtype", "UnitsConfig", "WarmupCosineLRConfig",
    "WarmupDecayLRConfig", "WarmupLRConfig", "WarmupType", "ZeroConfig", "parse_config"]

OffloadDevice = Literal["none", "cpu", "nvme"]
StateDtype = Literal["fp32", "bf16", "8bit"]
OptimizerType = Literal["Adam", "AdamW"]


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """The ``optimizer`` section, flattened: ``type`` plus ``params``."""

    type: OptimizerType = "AdamW"
    """Adam or AdamW; both use decoupled weight decay unless ``adam_w_mode`` is false."""
    lr: float = 1e-3
    """Learning rate (per step) before any scheduler; must be >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates, each in [0, 1)."""
    eps: float = 1e-8
    """Denominator epsilon added to sqrt(v_hat); must be > 0."""
    weight_decay: float = 0.0
    """Weight decay coefficient (dimensionless); must be >= 0."""
    adam_w_mode: bool = True
    """True: decoupled decay (torch AdamW). False: L2 added to the gradient (torch Adam)."""
    bias_correction: bool = True
    """DeepSpeed's Adam flag; only true (the moments' bias is always corrected)."""
    amsgrad: bool = False
    """torch's and DeepSpeed's flag; only false (no AMSGrad variant is built)."""

    def __post_init__(self) -> None:
        check_value(self.bias_correction, "optimizer.params.bias_correction",
                    self.bias_correction, "true only: offloadd's Adam always corrects the "
                    "moments' bias")
        check_value(not self.amsgrad, "optimizer.params.amsgrad", self.amsgrad,
                    "false only: offloadd has no AMSGrad")
        check_value(self.lr >= 0, "optimizer.params.lr", self.lr, ">= 0")
        for beta in self.betas:
            check_value(0 <= beta < 1, "optimizer.params.betas", self.betas, "each in [0, 1)")
        check_value(self.eps > 0, "optimizer.params.eps", self.eps, "> 0")
        check_value(self.weight_decay >= 0, "optimizer.params.weight_decay", self.weight_decay,
                    ">= 0")


@dataclass(kw_only=True, frozen=True)
class Bf16Config:
    """The ``bf16`` section."""

    enabled: bool = False
    """Train in bfloat16 with fp32 master weights."""


@dataclass(kw_only=True, frozen=True)
class Fp16Config:
    """The ``fp16`` section: float16 training with (dynamic) loss scaling."""

    enabled: bool = False
    """Train in float16 with fp32 master weights and loss scaling."""
    loss_scale: float = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power; in [0, 64]."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale doubles; >= 1."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves; >= 1."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step."""
    min_loss_scale: float = 1.0
    """Floor for the dynamic scale; > 0."""

    def __post_init__(self) -> None:
        check_value(self.loss_scale >= 0, "fp16.loss_scale", self.loss_scale, ">= 0 (0 = dynamic)")
        check_value(0 <= self.initial_scale_power <= 64, "fp16.initial_scale_power",
                    self.initial_scale_power, "[0, 64]")
        check_value(self.loss_scale_window >= 1, "fp16.loss_scale_window",
                    self.loss_scale_window, ">= 1")
        check_value(self.hysteresis >= 1, "fp16.hysteresis", self.hysteresis, ">= 1")
        check_value(self.min_loss_scale > 0, "fp16.min_loss_scale", self.min_loss_scale, "> 0")


GradAccumDtype = Literal["fp32", "bf16"]
"""``data_types.grad_accum_dtype`` (DeepSpeed's names; its "fp16" is refused here)."""

DTYPE_SPELLINGS: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
"""DeepSpeed's other names of a dtype (its ``DtypeEnum``), by the short name they mean."""


@dataclass(kw_only=True, frozen=True)
class DataTypesConfig:
    """The ``data_types`` section: the dtype gradients are accumulated in."""

    SPELLINGS: ClassVar[dict[str, dict[str, str]]] = {"grad_accum_dtype": DTYPE_SPELLINGS}
    """Per field, the other spellings DeepSpeed accepts for a value and the value they mean."""
    REFUSED: ClassVar[dict[str, dict[str, str]]] = {"grad_accum_dtype": {
        "fp16": "the daemon's Adam kernel takes no fp16 gradient, so fp16 training "
                "accumulates in fp32: remove the key or set it to 'fp32' ('bf16' needs "
                "bf16.enabled)"}}
    """Per field, DeepSpeed values refused here and why (what to set instead)."""
    grad_accum_dtype: GradAccumDtype = "fp32"
    """Dtype micro-batch gradients are summed in until the optimizer step (2 or 4 B per
    element of each rank's gradient partition): "fp32", exact sums; "bf16" (needs
    bf16.enabled), each sum rounded to bf16 wherever it runs, as DeepSpeed's bf16
    accumulation, and 2 B less per parameter in the arena (``grad_dtype_name``). Unset:
    fp32 (DeepSpeed's unset means the model's dtype)."""


@dataclass(kw_only=True, frozen=True)
class OffloadDeviceConfig:
    """``zero_optimization.offload_optimizer`` / ``offload_param``."""

    device: OffloadDevice = "none"
    """none: state stays in the rank; cpu: daemon DRAM arena; nvme: arena + NVMe swap."""
    nvme_path: str | None = None
    """Swap directory for device nvme; unset means ``<tmpdir>/offloadd-swap-<job>``."""


STATE_DTYPE_FORMATS: dict[str, MomentFormat] = {
    "fp32": "float32", "bf16": "bfloat16", "8bit": "blockwise8"}
"""``offload_optimizer.state_dtype`` -> the daemon's moment format (offloadd.formats)."""


@dataclass(kw_only=True, frozen=True)
class OffloadOptimizerConfig(OffloadDeviceConfig):
    """``zero_optimization.offload_optimizer``: placement, and how the Adam moments are
    stored (the one key DeepSpeed lacks; it means nothing without offload)."""

    state_dtype: StateDtype = "fp32"
    """Storage of exp_avg and exp_avg_sq in the daemon's arena and on NVMe (the fp32
    master stays fp32): "fp32" (4 B each, exactly torch's AdamW), "bf16" (2 B, stochastic
    rounding), "8bit" (~1.016 B: 8-bit codes with one fp32 absmax per 256 elements, as
    bitsandbytes' 8-bit Adam). Moment bytes per parameter: 8 / 4 / 2.03."""
    ratio: float | Literal["auto"] = 1.0
    """Fraction of the trainable elements whose optimizer state is offloaded, in [0, 1]
    (DeepSpeed's ZeRO-Offload++ Twin-Flow); the rest, the first units of the forward, keep
    state and Adam on the compute device (``trainer.offload.split``). "auto": as many first
    units as the device memory the first accumulation window left free holds. Unused with
    device none (DeepSpeed reads it only with an offload device)."""
    speculative_step: bool = True
    """With gradient clipping or fp16 overflow checks, start each unit's daemon step as soon
    as its gradient is reduced, before the global norm is known, and undo it exactly on the
    steps where clipping fires (``trainer.zero.optimizer``); false: every step waits for the
    norm. The result is bit-identical either way; only the step time differs."""
    super_offload: bool | None = None
    """DeepSpeed's SuperOffload switch, whose speculate-then-validate step this is: when
    set, it decides ``speculative_step``."""

    def __post_init__(self) -> None:
        check_value(self.ratio == "auto" or (not isinstance(self.ratio, bool)
                                             and 0.0 <= self.ratio <= 1.0),
                    "zero_optimization.offload_optimizer.ratio", self.ratio,
                    'a number in [0, 1] or "auto"')
        if self.super_offload is not None:
            object.__setattr__(self, "speculative_step", self.super_offload)

    @property
    def moment_format(self) -> MomentFormat:
        """The daemon's name of ``state_dtype`` (offloadd.formats)."""
        return STATE_DTYPE_FORMATS[self.state_dtype]


@dataclass(kw_only=True, frozen=True)
class ZeroConfig:
    """The ``zero_optimization`` section."""

    stage: int = 0
    """0: replicate everything; 1: + partition optimizer state; 2: + grads; 3: + params."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Where the fp32 master, Adam moments and reduced grads live, where Adam runs, and
    the moments' storage dtype."""
    offload_param: OffloadDeviceConfig = field(default_factory=OffloadDeviceConfig)
    """Where each rank's stage-3 parameter partition lives between uses."""
    overlap_comm: bool = True
    """Launch gradient reductions asynchronously during backward (else one at a time)."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Parameter elements fetched ahead of use from the daemon during stage 3; >= 0."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Upper bound (elements) on prefetched-but-unused parameters; >= 0."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """A unit whose next use (its backward) comes within this many gathered elements stays
    gathered after its forward instead of being freed and gathered again; >= 0."""
    step_in_backward: bool = True
    """Without gradient clipping and fp16 overflow checks, start each unit's optimizer step
    during the backward that ends a window, as soon as its gradient is reduced (the step
    needs nothing global). False: steps wait for ``engine.step()``, so gradients can be
    replaced in between (DeepSpeed's ``safe_set_full_grad``); the result is the same."""

    def __post_init__(self) -> None:
        check_value(self.stage in (0, 1, 2, 3), "zero_optimization.stage", self.stage,
                    "0, 1, 2 or 3")
        check_value(self.stage3_prefetch_bucket_size >= 0,
                    "zero_optimization.stage3_prefetch_bucket_size",
                    self.stage3_prefetch_bucket_size, ">= 0")
        check_value(self.stage3_max_live_parameters >= 0,
                    "zero_optimization.stage3_max_live_parameters",
                    self.stage3_max_live_parameters, ">= 0")
        check_value(self.stage3_max_reuse_distance >= 0,
                    "zero_optimization.stage3_max_reuse_distance",
                    self.stage3_max_reuse_distance, ">= 0")
        param_device = self.offload_param.device
        check_value(param_device == "none" or self.stage == 3,
                    "zero_optimization.offload_param.device", param_device,
                    "'none' unless zero_optimization.stage is 3")
        state_dtype = self.offload_optimizer.state_dtype
        check_value(state_dtype == "fp32" or self.offload_optimizer.device != "none",
                    "zero_optimization.offload_optimizer.state_dtype", state_dtype,
                    "'fp32' unless offload_optimizer.device is cpu or nvme (compact moments "
                    "live in the daemon; the in-rank optimizer keeps torch's fp32 state)")

    @property
    def offloaded(self) -> bool:
        """True when any state goes through the daemon."""
        return self.offload_optimizer.device != "none"

    def check_trains(self) -> None:
        """What an engine that trains needs of this section: offloaded parameters only with
        the optimizer offloaded too (the daemon's optimizer step writes them). An engine
        without an optimizer (``initialize(inference=True)``) needs no such thing."""
        param_device = self.offload_param.device
        check_value(param_device == "none" or self.offload_optimizer.device != "none",
                    "zero_optimization.offload_param.device", param_device,
                    "'none' unless offload_optimizer.device is cpu or nvme too "
                    "(the daemon's optimizer step writes the offloaded parameters)")

    def for_inference(self) -> ZeroConfig:
        """This section for an engine without an optimizer: offloaded parameters go through
        the daemon (as the optimizer's state would) even where ``offload_optimizer`` is
        unset, as ZeRO-Inference configs leave it (HF's non-Trainer example)."""
        if self.offload_param.device == "none" or self.offload_optimizer.device != "none":
            return self
        return dataclasses.replace(self, offload_optimizer=dataclasses.replace(
            self.offload_optimizer, device=self.offload_param.device,
            nvme_path=self.offload_param.nvme_path or self.offload_optimizer.nvme_path))


@dataclass(kw_only=True, frozen=True)
class OffloaddConfig:
    """The ``offloadd`` section: how ranks reach the per-node daemon."""

    socket: str | None = None
    """Daemon unix socket; unset + offload requested: local rank 0 starts a private daemon."""
    daemon_uid: int | str | None = None
    """Uid (or user name) the daemon at ``socket`` runs as; unset: $OFFLOADD_DAEMON_UID, else
    the ``offloadd`` user, else root. A listener of another uid gets nothing (squatting)."""
    job: str | None = None
    """Job name scoping shards in the daemon; unset: derived from the rendezvous address."""
    arena_size: int | None = None
    """Bytes of pinned DRAM arena for this job; unset: sized from the model."""
    workdir: str | None = None
    """Directory for the private daemon's socket and files; unset: a fresh temp dir."""
    connect_timeout_s: float = 120.0
    """Seconds to wait for the daemon socket to accept connections; > 0."""
    private_exit_grace_s: float = 15.0
    """Seconds the private daemon waits, once no rank of its job is attached and the job
    was not closed (its ranks were killed), before it exits and deletes its scratch dirs;
    > 0. A run whose ranks all finish stops it at once, whichever rank ends last."""
    device_copies: Literal["rank", "daemon"] = "rank"
    """Who copies between the arena and the GPU: "rank" (the rank's own CUDA streams) or
    "daemon" (the daemon's streams into the rank's IPC-exported staging slots; falls back
    to "rank" with one logged reason when IPC is not possible, see
    trainer.offload.daemon_copies)."""
    staging_slots: int = 4
    """Staging slots for device_copies "daemon" (each as large as the largest unit
    partition); >= 2."""
    staging_readahead_slots: int | None = None
    """Of the staging slots, how many the rank lends the daemon to stage parameters ahead
    of use from the rank's learned access trace; 0..staging_slots-1, unset: half."""

    def __post_init__(self) -> None:
        check_value(self.arena_size is None or self.arena_size > 0, "offloadd.arena_size",
                    self.arena_size, "> 0 bytes")
        check_value(self.connect_timeout_s > 0, "offloadd.connect_timeout_s",
                    self.connect_timeout_s, "> 0")
        check_value(self.private_exit_grace_s > 0, "offloadd.private_exit_grace_s",
                    self.private_exit_grace_s, "> 0 seconds")
        check_value(self.staging_slots >= 2, "offloadd.staging_slots", self.staging_slots, ">= 2")
        check_value(self.staging_readahead_slots is None
                    or 0 <= self.staging_readahead_slots < self.staging_slots,
                    "offloadd.staging_readahead_slots", self.staging_readahead_slots,
                    "0..staging_slots-1 (the rank keeps a slot of its own)")

    @property
    def readahead_slots(self) -> int:
        """``staging_readahead_slots``, or half the staging slots when unset."""
        if self.staging_readahead_slots is None:
            return self.staging_slots // 2
        return self.staging_readahead_slots


@dataclass(kw_only=True, frozen=True)
class UnitsConfig:
    """The ``units`` section: how the model is split into flat-parameter units."""

    module_classes: tuple[str, ...] = ()
    """Class names (e.g. "GPT2Block") whose instances each become one unit."""
    min_num_params: int | None = None
    """Without module_classes: a subtree with this many unwrapped params becomes a unit;
    unset: the model's repeated blocks (HF ``_no_split_modules``, else classes repeated in
    a ModuleList/Sequential), else size-based at 1M params."""

    def __post_init__(self) -> None:
        check_value(self.min_num_params is None or self.min_num_params >= 1, "units.min_num_params",
                    self.min_num_params, ">= 1 (or unset for the model's repeated blocks)")


@dataclass(kw_only=True, frozen=True)
class ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section: how ``deepspeed.checkpointing.checkpoint``
    (``trainer.zero.checkpointing``) keeps the inputs of the blocks it recomputes.
    Blocks checkpointed with ``torch.utils.checkpoint`` directly are not affected."""

    cpu_checkpointing: bool = False
    """Keep the checkpointed inputs in host memory (pinned on CUDA) until the backward
    recomputes the block, instead of on the device."""
    partition_activations: bool = False
    """DeepSpeed splits the kept inputs over the model-parallel ranks; without model
    parallelism (offloadd has none) each rank keeps its whole inputs, as DeepSpeed's
    ranks do at a model-parallel size of 1."""
    contiguous_memory_optimization: bool = False
    """DeepSpeed's preallocated buffer for partitioned inputs; inputs are ordinary
    tensors here."""
    number_checkpoints: int | None = None
    """The size of that buffer, in checkpoints."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device before and after each checkpointed forward (timing aid)."""
    profile: bool = False
    """DeepSpeed's per-checkpoint timers: not kept here (a warning says so)."""

    def __post_init__(self) -> None:
        check_value(self.number_checkpoints is None or self.number_checkpoints >= 1,
                    "activation_checkpointing.number_checkpoints", self.number_checkpoints,
                    ">= 1 (or unset)")


@dataclass(kw_only=True, frozen=True)
class BatchSizes:
    """Resolved batch sizes (samples), consistent with the world size."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """The whole config, DeepSpeed key names at the top level."""

    train_batch_size: int | None = None
    """Samples per optimizer step over all ranks (= micro * accumulation * world)."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step on one rank."""
    gradient_clipping: float = 0.0
    """Clip the global gradient L2 norm to this value; 0 disables."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Adam/AdamW hyper-parameters."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule; None keeps optimizer.params.lr."""
    bf16: Bf16Config = field(default_factory=Bf16Config)
    """bfloat16 training."""
    fp16: Fp16Config = field(default_factory=Fp16Config)
    """float16 training with loss scaling."""
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and offload placement."""
    offloadd: OffloaddConfig = field(default_factory=OffloaddConfig)
    """Daemon connection."""
    units: UnitsConfig = field(default_factory=UnitsConfig)
    """Unit (flat parameter) construction."""
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    """``deepspeed.checkpointing.checkpoint``'s settings (``trainer.zero.checkpointing``)."""
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    """The dtype gradients are accumulated in."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device: auto = cuda:LOCAL_RANK with NCCL when CUDA is available, else cpu."""

    def __post_init__(self) -> None:
        check_value(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping,
                    ">= 0 (0 disables)")
        check_value(not (self.bf16.enabled and self.fp16.enabled), "bf16.enabled", True,
                    "false when fp16.enabled is true (pick one training dtype)")
        check_value(self.data_types.grad_accum_dtype != "bf16" or self.bf16.enabled,
                    "data_types.grad_accum_dtype", "bf16",
                    "'fp32' unless bf16.enabled is true (bf16 accumulation sums the gradients of "
                    "bf16 training: set bf16.enabled, or remove the key)")
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                    "gradient_accumulation_steps"):
            value = getattr(self, key)
            check_value(value is None or value >= 1, key, value, ">= 1")

    @property
    def dtype_name(self) -> Literal["float32", "bfloat16", "float16"]:
        """Training dtype as a daemon dtype tag."""
        if self.bf16.enabled:
            return "bfloat16"
        return "float16" if self.fp16.enabled else "float32"

    def grad_dtype_name(self, gradient_accumulation_steps: int
                        ) -> Literal["float32", "bfloat16"]:
        """Dtype tag of the reduced gradient partition, kept and summed in it until the
        optimizer step (the daemon's ``u{N}.grad``, the device sums, stages 0-1's local sum
        and all-reduce): bf16 when ``data_types.grad_accum_dtype`` asks, or where it is a
        bf16 reduce-scatter taken once per step (stages 2-3 without accumulation: fp32
        would hold no more). Else fp32 (the daemon's Adam takes no fp16 gradient)."""
        if self.data_types.grad_accum_dtype == "bf16":
            return "bfloat16"
        if (self.bf16.enabled and gradient_accumulation_steps == 1
                and self.zero_optimization.stage >= 2):
            return "bfloat16"
        return "float32"

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """Derive the missing batch keys like DeepSpeed and check consistency."""
        total, micro, accum = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                               self.gradient_accumulation_steps)
        if total is None and micro is None:
            raise ValueError("config needs train_batch_size or train_micro_batch_size_per_gpu "
                             "(a number; 'auto' in both is left for the HF Trainer to fill)")
        if total is None:
            assert micro is not None
            accum = accum or 1
            total = micro * accum * world_size
        elif micro is None:
            accum = accum or 1
            micro = _divide(total, accum * world_size, "train_batch_size",
                            f"gradient_accumulation_steps ({accum}) * world size ({world_size})")
        elif accum is None:
            accum = _divide(total, micro * world_size, "train_batch_size",
                            f"train_micro_batch_size_per_gpu ({micro}) * world size "
                            f"({world_size})")
        if total != micro * accum * world_size:
            raise ValueError(
                f"train_batch_size ({total}) must equal train_micro_batch_size_per_gpu ({micro})"
                f" * gradient_accumulation_steps ({accum}) * world size ({world_size})"
            )
        return BatchSizes(train_batch_size=total, micro_batch_size=micro,
                          gradient_accumulation_steps=accum)


def _divide(total: int, by: int, key: str, what: str) -> int:
    if total % by:
        raise ValueError(f"{key} ({total}) is not divisible by {what}")
    return total // by


# ---------------------------------------------------------------------------
# parsing


def parse_config(source: dict[str, Any] | str | Path | EngineConfig) -> EngineConfig:
    """Parse a DeepSpeed-style config (dict or JSON file path) into an ``EngineConfig``."""
    if isinstance(source, EngineConfig):
        return source
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as handle:
            source = json.load(handle)
    if not isinstance(source, dict):
        raise ValueError(f"config must be a dict or a JSON file path, got {type(source).__name__}")
    flat = nest_dotted_keys(source)
    with reporting_ignored():
        if isinstance(flat.get("optimizer"), dict):
            flat["optimizer"] = flatten_typed_section(flat["optimizer"], "optimizer")
        if isinstance(flat.get("scheduler"), dict):
            flat["scheduler"] = build_scheduler(flat["scheduler"])
        parsed = build_section(EngineConfig, flat, "")
    return typing.cast(EngineConfig, parsed)
