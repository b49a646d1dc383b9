"""Checkpoints: per-rank partitions, exact restore, and fp32 consolidation.

Layout of ``engine.save_checkpoint(save_dir, tag)``::

    <save_dir>/
      latest                 text: the tag of the newest complete checkpoint
      <tag>/
        meta.json            written by rank 0: format version, world size,
                             ZeRO stage, training dtype, Adam moment format, and
                             per unit its name, numel, padded_numel and part_numel
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
from pathlib import Path
from typing import Any

import torch

from trainer.state.export import (
    HF_CONFIG_DIR,
    LATEST_FILE,
    latest_tag,
    param_layout,
    rank_file,
    read_meta,
    write_hf_configs,
)
from trainer.state.hf_checkpoint import path_inside
from trainer.state.reshard import check_reshardable, load_resharded
from trainer.zero.engine import Engine
from trainer.zero.init import handover_owner, unmaterialise

FULL_RESTORE = {"load_module_strict": True, "load_optimizer_states": True,
                "load_lr_scheduler_states": True, "load_module_only": False}
"""DeepSpeed's ``load_checkpoint`` options and the values that mean "restore everything"."""


def check_full_restore(options: dict[str, bool]) -> None:
    """Accept DeepSpeed's ``load_checkpoint`` options at their full-restore values only."""
    unknown = sorted(set(options) - set(FULL_RESTORE))
    if unknown:
        raise TypeError(f"load_checkpoint() got unexpected keyword arguments {unknown} "
                        f"(DeepSpeed's options here: {sorted(FULL_RESTORE)})")
    partial = {key: value for key, value in options.items() if value != FULL_RESTORE[key]}
    if partial:
        raise ValueError(
            f"load_checkpoint({', '.join(f'{k}={v}' for k, v in partial.items())}) is not "
            "supported: checkpoints restore the model, optimizer and scheduler together. For "
            "weights only, load trainer.state.checkpoint.consolidate_fp32_state_dict(engine)'s "
            "output into a fresh model before initialize()")


FORMAT_VERSION = 1


def _meta(engine: Engine) -> dict[str, Any]:
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


def _unit_states(engine: Engine) -> dict[int, dict[str, torch.Tensor]]:
    states = {}
    for unit in engine.units:
        state = engine.backend.get_state(unit.index)
        states[unit.index] = {"param": engine.backend.host_params(unit.index), **state}
    return states


def _untracked_state(engine: Engine) -> dict[str, torch.Tensor]:
    tracked = {id(slot.param) for unit in engine.units for slot in unit.slots}
    return {name: value.detach().clone()
            for name, value in engine.module.state_dict(keep_vars=True).items()
            if id(value) not in tracked}


def save_checkpoint(engine: Engine, save_dir: str | os.PathLike[str], tag: str | None = None,
                    *, client_state: dict[str, Any] | None = None) -> str:
    """Write this rank's partition and engine state; returns the tag used."""
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    tag_dir = Path(save_dir) / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    if engine.config.zero_optimization.offload_optimizer.device == "nvme":
        engine.backend.flush(tag)
    payload = {"units": _unit_states(engine), "engine": _engine_state(engine),
               "untracked": _untracked_state(engine), "client_state": client_state or {}}
    _atomic_save(payload, rank_file(tag_dir, engine.collectives.rank))
    if engine.collectives.rank == 0:
        write_hf_configs(engine.module, tag_dir / HF_CONFIG_DIR, engine.precision.dtype)
        _atomic_write_text(tag_dir / "meta.json", json.dumps(_meta(engine), indent=2))
    engine.collectives.barrier()
    if engine.collectives.rank == 0:
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
                    tag: str | None = None) -> tuple[str | None, dict[str, Any]]:
    """Restore a checkpoint written by ``save_checkpoint``; returns ``(path, client_state)``.

    Returns ``(None, {})`` when ``tag`` is None and there is no ``latest`` file. A
    checkpoint may come from elsewhere: it is read only inside ``load_dir`` and every count
    in its meta.json is checked before it sizes anything (``CheckpointError`` otherwise).
    """
    what = "the tag passed to load_checkpoint"
    if tag is None:
        tag = latest_tag(Path(load_dir))
        if tag is None:
            return None, {}
        what = f"{load_dir}'s '{LATEST_FILE}' file"
    tag_dir = path_inside(load_dir, tag, what=what)
    saved = _check_meta(engine, tag_dir)
    if saved["world_size"] != engine.collectives.world_size:
        payload = load_resharded(engine, tag_dir, saved)
    else:
        own = rank_file(tag_dir, engine.collectives.rank).name  # other ranks' may be elsewhere
        payload = torch.load(path_inside(tag_dir, own, what=f"{tag_dir}'s {own}"),
                             weights_only=True)
        _restore_units(engine, payload["units"])
    _restore_engine(engine, payload["engine"])
    _restore_untracked(engine, payload["untracked"])
    engine.collectives.barrier()
    return str(tag_dir), payload["client_state"]


def _check_meta(engine: Engine, tag_dir: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, checked against this engine (a world size change is
    resharded, see ``trainer.state.reshard``)."""
    saved = read_meta(tag_dir)
    current = _meta(engine)
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


def _restore_units(engine: Engine, units: dict[int, dict[str, torch.Tensor]]) -> None:
    for unit in engine.units:
        state = units[unit.index]
        engine.backend.set_state(unit.index, state)
        engine.placement.after_step(unit)


def _restore_engine(engine: Engine, state: dict[str, Any]) -> None:
    engine.global_steps = int(state["global_steps"])
    engine.micro_steps = int(state["micro_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.precision.scaler.load_state_dict(state["loss_scaler"])


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
    for name, value in _untracked_state(engine).items():
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
