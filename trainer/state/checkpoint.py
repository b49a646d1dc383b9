"""Checkpoints: per-rank partitions, exact restore, and fp32 consolidation.

Layout of ``engine.save_checkpoint(save_dir, tag)``::

    <save_dir>/
      latest                 text: the tag of the newest complete checkpoint
      zero_to_fp32.py        DeepSpeed's converter script, for these checkpoints
                             (``trainer.state.zero_to_fp32``)
      <tag>/
        meta.json            written by rank 0: format version, world size,
                             ZeRO stage, training dtype, Adam moment format,
                             per unit its name, numel, padded_numel and part_numel,
                             each parameter's names, offset and shape (``layout``)
                             and the names of the frozen ones (``frozen``)
        rank_00000.pt        one torch.save file per rank (see below)
        rank_00001.pt
        ...

Each ``rank_NNNNN.pt`` holds a dict:

- ``units``: ``{unit_index: {"param", "master", "exp_avg", "exp_avg_sq"}}``,
  this rank's partition of every unit: ``param`` in the training dtype,
  ``master`` fp32, the moments as the daemon stores them
  (``offload_optimizer.state_dtype``: fp32, bf16, or the uint8 bytes of
  8-bit block-wise moments, see offloadd.formats), so a resume restores them
  exactly. With offload the tensors are read back through the daemon client;
  for ``nvme`` the daemon is also asked to ``flush(tag)`` so its own swap
  state is durable. Swap files are never copied.
- ``engine``: global/micro steps and samples, optimizer scalars (Adam step
  count, skipped steps, param group hyper-parameters), LR scheduler state,
  loss scaler state.
- ``untracked``: buffers and frozen parameters (replicated; same on every rank).
- ``client_state``: the caller's ``client_state`` dict.

Rank 0 also keeps the model's HF configs (``config.json``,
``generation_config.json``) in ``<tag>/hf/`` for ``python -m trainer.export``.
Rank files are written first, then a barrier, then rank 0 writes
``latest``, so ``latest`` never names a partial checkpoint. Loading needs
the same stage, dtype and units; at the same world size and moment format it
restores bit-exactly, at another one ``trainer.state.reshard`` re-partitions every
unit's parameters, fp32 master and Adam moments (an optimizer step then
differs from the uninterrupted run only by the summation order of the
gradients, and 8-bit moments by their re-quantization in the new blocks).
Moments saved in another format than the run's are converted on load (a
warning says so): fp32 or bf16 into a compact format rounds once, as the
next step would; compact into fp32 is exact.
``consolidate_fp32_state_dict(engine)`` all-gathers the fp32 masters into a
regular ``state_dict`` on rank 0 (other ranks get ``{}``).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from trainer.state.export import (
    HF_CONFIG_DIR,
    LATEST_FILE,
    frozen_names,
    is_frozen,
    latest_tag,
    param_layout,
    rank_file,
    read_meta,
    untracked_state,
    write_hf_configs,
)
from trainer.state.hf_checkpoint import CheckpointError, path_inside
from trainer.state.reshard import (
    UnitRestore,
    check_absent,
    check_reshardable,
    load_resharded,
)
from trainer.state.zero_to_fp32 import write_script
from trainer.zero.engine import Engine
from trainer.zero.init import handover_owner, unmaterialise
from trainer.zero.partition import Unit, ZeroParamStatus


@dataclass(frozen=True)
class LoadOptions:
    """DeepSpeed's ``load_checkpoint`` options, with DeepSpeed's meaning:

    - ``load_optimizer_states=False``: the weights (each unit's parameters and fp32
      masters), the step and sample counters and, with ``load_lr_scheduler_states``, the
      LR scheduler come from the checkpoint; the Adam moments, the Adam step count and the
      loss scaler stay the engine's own (fresh after ``initialize``): a fine-tune of a
      pretraining checkpoint with a new optimizer.
    - ``load_lr_scheduler_states=False``: the engine keeps its own scheduler state.
    - ``load_module_only=True``: the weights only (parameters, fp32 masters, buffers);
      every counter, the optimizer and the scheduler stay the engine's own.
    - ``load_module_strict=False``: a checkpoint saved with
      ``exclude_frozen_parameters=True`` loads, and the frozen parameters keep the values
      the engine has (the base model a PEFT run was built from); with ``True`` such a
      checkpoint is refused, as DeepSpeed's strict module load refuses missing keys.
    """

    load_module_strict: bool = True
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_only: bool = False

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> LoadOptions:
        """The options a caller passed by DeepSpeed's names; others are a TypeError."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"load_checkpoint() got unexpected keyword arguments {unknown} "
                            f"(DeepSpeed's options here: {sorted(known)})")
        for key, value in options.items():
            if not isinstance(value, bool):
                raise TypeError(f"load_checkpoint({key}={value!r}): expected True or False")
        return cls(**options)

    @property
    def optimizer(self) -> bool:
        """The Adam moments, step count and loss scaler come from the checkpoint."""
        return self.load_optimizer_states and not self.load_module_only

    @property
    def scheduler(self) -> bool:
        return self.load_lr_scheduler_states and not self.load_module_only


FORMAT_VERSION = 1


def _meta(engine: Engine, *, frozen_excluded: bool) -> dict[str, Any]:
    return {
        "layout": param_layout(engine),  # for the offline exporter (trainer.export)
        "format_version": FORMAT_VERSION,
        "world_size": engine.collectives.world_size,
        "stage": engine.config.zero_optimization.stage,
        "dtype": engine.precision.dtype_name,
        "moment_format": engine.config.zero_optimization.offload_optimizer.moment_format,
        "units": [{"index": u.index, "name": u.name, "numel": u.numel,
                   "padded_numel": u.padded_numel, "part_numel": u.part_numel}
                  for u in engine.units],
        "frozen_excluded": frozen_excluded,
        "frozen": frozen_names(engine),  # for conversions without them (zero_to_fp32)
    }


def _engine_state(engine: Engine) -> dict[str, Any]:
    return {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "optimizer": engine.optimizer.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "loss_scaler": engine.precision.scaler.state_dict(),
    }


def _unit_states(engine: Engine, *, exclude_frozen: bool
                 ) -> dict[int, dict[str, torch.Tensor]]:
    states = {}
    for unit in engine.units:
        if exclude_frozen and not unit.trainable:
            continue
        # Host copies, as untracked_state's: an optimizer kept on the device (no offload)
        # would put device tensors in the file, which then needs a device to load.
        state = {kind: value.cpu() for kind, value in engine.backend.get_state(unit.index).items()}
        states[unit.index] = {"param": engine.backend.host_params(unit.index), **state}
    return states


def save_checkpoint(engine: Engine, save_dir: str | os.PathLike[str], tag: str | None = None,
                    *, client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> str:
    """Write this rank's partition and engine state; returns the tag used.

    ``save_latest=False`` leaves the ``latest`` file as it was; ``exclude_frozen_parameters``
    leaves frozen parameters out (a LoRA run's checkpoint holds the adapters and their
    optimizer state, not the base model: HF Trainer asks for it for PEFT models), and
    meta.json says so (``frozen_excluded``): such a checkpoint loads with
    ``load_module_strict=False`` into an engine that has the frozen weights already."""
    # Any tag names a directory by its text, as DeepSpeed's: its getting-started guide saves
    # under ``ckpt_id = loss.item()``. Inside ``save_dir`` only (no "..", not absolute).
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    tag_dir = path_inside(save_dir, tag, what="the tag passed to save_checkpoint")
    tag_dir.mkdir(parents=True, exist_ok=True)
    if engine.config.zero_optimization.offload_optimizer.device == "nvme":
        engine.backend.flush(tag)
    exclude = exclude_frozen_parameters
    payload = {"units": _unit_states(engine, exclude_frozen=exclude),
               "engine": _engine_state(engine),
               "untracked": untracked_state(engine, exclude_frozen=exclude),
               "client_state": client_state or {}}
    _atomic_save(payload, rank_file(tag_dir, engine.collectives.rank))
    if engine.collectives.rank == 0:
        write_hf_configs(engine.module, tag_dir / HF_CONFIG_DIR, engine.precision.dtype)
        _atomic_write_text(tag_dir / "meta.json",
                           json.dumps(_meta(engine, frozen_excluded=exclude), indent=2))
        write_script(save_dir)
    engine.collectives.barrier()
    if save_latest and engine.collectives.rank == 0:
        _atomic_write_text(Path(save_dir) / LATEST_FILE, tag)
    engine.collectives.barrier()
    return tag


def _atomic_save(payload: dict[str, Any], path: Path) -> None:
    partial = path.with_suffix(".partial")
    torch.save(payload, partial)
    os.replace(partial, path)


def _atomic_write_text(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def load_checkpoint(engine: Engine, load_dir: str | os.PathLike[str],
                    tag: str | None = None, options: LoadOptions | None = None, *,
                    weights_only: bool = True) -> tuple[str | None, dict[str, Any]]:
    """Restore a checkpoint written by ``save_checkpoint``; returns ``(path, client_state)``.
    ``options`` (DeepSpeed's, ``LoadOptions``) select what is restored: everything by default.
    ``weights_only=False`` unpickles the rank files unrestricted (a ``client_state`` holding
    the caller's own classes; Lightning passes its ``weights_only`` here): trusted files only.

    Returns ``(None, {})`` when ``tag`` is None and there is no ``latest`` file. A
    checkpoint may come from elsewhere: it is read only inside ``load_dir`` and every count
    in its meta.json is checked before it sizes anything (``CheckpointError`` otherwise).
    """
    what = "the tag passed to load_checkpoint"
    tag = str(tag) if tag is not None else None  # as save_checkpoint names it
    if tag is None:
        tag = latest_tag(Path(load_dir))
        if tag is None:
            return None, {}
        what = f"{load_dir}'s '{LATEST_FILE}' file"
    options = options or LoadOptions()
    tag_dir = path_inside(load_dir, tag, what=what)
    saved = _check_meta(engine, tag_dir)
    if saved.get("frozen_excluded") and options.load_module_strict:
        frozen = sum(unit.numel for unit in engine.units if not unit.trainable) + sum(
            value.numel() for value in untracked_state(engine, keep_vars=True).values()
            if is_frozen(value))
        raise CheckpointError(
            f"checkpoint {tag_dir} was saved with exclude_frozen_parameters=True: it holds "
            f"none of this model's {frozen} frozen parameter elements. Load it with "
            f"load_module_strict=False to keep the frozen values this engine has (the "
            f"base model the run was built from; in Lightning, set the LightningModule's "
            f"strict_loading = False)")
    restore = _unit_restorer(engine, options)
    if saved["world_size"] != engine.collectives.world_size:
        payload = load_resharded(engine, tag_dir, saved, restore, weights_only=weights_only)
    else:
        own = rank_file(tag_dir, engine.collectives.rank).name  # other ranks' may be elsewhere
        payload = torch.load(path_inside(tag_dir, own, what=f"{tag_dir}'s {own}"),
                             weights_only=weights_only)
        for unit in engine.units:
            state = payload["units"].get(unit.index)
            if state is None:
                check_absent(unit, saved, f"{tag_dir}'s {own}", CheckpointError)
                continue
            restore(unit, state)
    if not options.load_module_only:
        _restore_engine(engine, payload["engine"], options)
    _restore_untracked(engine, payload["untracked"])
    engine.collectives.barrier()
    return str(tag_dir), payload["client_state"]


def _check_meta(engine: Engine, tag_dir: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, checked against this engine (a world size change is
    resharded, see ``trainer.state.reshard``)."""
    saved = read_meta(tag_dir)
    current = _meta(engine, frozen_excluded=False)
    for key in ("format_version", "stage", "dtype"):
        if saved.get(key) != current[key]:
            raise ValueError(
                f"checkpoint {tag_dir} has {key}={saved.get(key)!r} but this engine has "
                f"{current[key]!r}; load it with the same stage, dtype and model"
            )
    if saved["world_size"] != current["world_size"]:
        check_reshardable(engine, saved, tag_dir)
    elif saved["units"] != current["units"]:
        raise ValueError(
            f"checkpoint {tag_dir} has units={saved['units']!r} but this engine has "
            f"{current['units']!r}; load it with the same model and 'units' config")
    saved_format = saved.get("moment_format", "float32")  # written since compact moments
    if saved_format != current["moment_format"]:
        warnings.warn(f"checkpoint {tag_dir} holds {saved_format} Adam moments; this run keeps "
                      f"{current['moment_format']} (zero_optimization.offload_optimizer."
                      "state_dtype): they are converted on load", UserWarning, stacklevel=3)
    return saved


def _unit_restorer(engine: Engine, options: LoadOptions) -> UnitRestore:
    """Writes one unit's saved state into the engine; without ``options.optimizer`` only
    its parameters and fp32 master, the moments staying the engine's own."""

    def restore(unit: Unit, state: dict[str, torch.Tensor]) -> None:
        if unit.trainable and "master" not in state:  # saved frozen: an inference engine's
            if options.optimizer:
                raise CheckpointError(
                    f"the checkpoint holds no optimizer state for unit {unit.index} "
                    f"({unit.name}): it was saved by an engine without an optimizer, or with "
                    f"the unit frozen. Load its weights with load_optimizer_states=False")
            state = {"param": state["param"], "master": state["param"].float()}
        if unit.trainable and not options.optimizer:
            state = {**engine.backend.get_state(unit.index),
                     **{kind: state[kind] for kind in ("param", "master") if kind in state}}
        engine.backend.set_state(unit.index, state)
        engine.placement.after_step(unit)

    return restore


def _restore_engine(engine: Engine, state: dict[str, Any], options: LoadOptions) -> None:
    engine.global_steps = int(state["global_steps"])
    engine.micro_steps = int(state["micro_steps"])
    engine.global_samples = int(state["global_samples"])
    if options.optimizer:
        engine.optimizer.load_state_dict(state["optimizer"])
        engine.precision.scaler.load_state_dict(state["loss_scaler"])
    if options.scheduler and engine.lr_scheduler is not None \
            and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])


def _restore_untracked(engine: Engine, state: dict[str, torch.Tensor]) -> None:
    named = engine.module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in state.items():
            named[name].copy_(value)


def consolidate_fp32_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """The full model as an fp32 ``state_dict`` on rank 0 (``{}`` on other ranks).

    Collective: every rank must call it.
    """
    names_of: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    result: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        full = _gather_master(engine, unit)
        for slot in unit.slots:
            value = full.narrow(0, slot.offset, slot.numel).view(slot.shape).clone()
            for name in names_of.get(id(slot.param), [slot.name]):
                result[name] = value
    for name, value in untracked_state(engine).items():
        result[name] = value.float() if value.is_floating_point() else value
    return result if engine.collectives.rank == 0 else {}


def restore_module(engine: Engine, *, handover: bool = False) -> None:
    """Put the trained weights back into a stage-3 module's parameters, whole, on the host,
    in each parameter's dtype (from the fp32 masters), and unlink them from the engine: what
    DeepSpeed's ``engine.destroy()`` leaves, a module a new engine can take (HF Trainer's
    next ``train()``, Accelerate's ``free_memory``). Stages 0-2 keep whole parameters in
    the module all along. Collective: every rank calls it, and gets every weight; with
    ``handover`` only rank 0 does, and the other ranks' parameters become ``meta`` for the
    next engine to fill from rank 0 (``Engine.destroy``)."""
    if engine.config.zero_optimization.stage != 3:
        return
    owner = handover_owner() if handover and engine.collectives.rank != 0 else None
    for unit in engine.units:
        full = _gather_master(engine, unit)
        for slot in unit.slots:
            param = slot.param
            for link in ("_zero_engine", "_zero_unit"):
                if hasattr(param, link):
                    delattr(param, link)
            if owner is None or not unmaterialise(param, slot.shape, owner):
                param.data = full.narrow(0, slot.offset, slot.numel).view(slot.shape).to(
                    param.dtype, copy=True)
        unit.set_status(ZeroParamStatus.AVAILABLE)
        unit.described = False  # the module's own now: no gather or release will follow


def _gather_master(engine: Engine, unit: Any) -> torch.Tensor:
    """The unit's full fp32 master on the host, all-gathered on the compute device (the
    data-parallel group is NCCL's on GPUs: device tensors only)."""
    device = engine.collectives.device
    if unit.trainable:
        master = engine.backend.get_state(unit.index)["master"].to(device)
    else:  # frozen (stage 3): the parameter partition is all there is
        param = torch.empty(unit.part_numel, dtype=engine.precision.dtype, device=device)
        engine.backend.read_params(unit.index, param)
        master = param.float()
    if unit.part_numel == unit.padded_numel:
        return master.cpu()
    full = torch.empty(unit.padded_numel, dtype=torch.float32, device=device)
    engine.collectives.all_gather(full, master)
    return full.cpu()
