"""Exports that ``from_pretrained`` loads as written: ``engine.save_16bit_model(dir)`` and
an offline ZeRO checkpoint converter.

Both write an HF model directory: the weights as safetensors (HF's default;
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` above ``max_shard_size``), or as ``.bin``
(torch.save) when asked, plus the model's ``config.json`` (its ``dtype`` the
exported one, ``architectures`` the model class) and ``generation_config.json``
when the model has one. Safetensors cannot hold one tensor under two names, so
a tied weight is written once, under its first state-dict name (as
``save_pretrained`` does; ``from_pretrained`` ties it again); ``.bin`` files
keep every name.

``save_16bit_model`` gathers the model unit by unit (stage 3 all-gathers each
unit, copies it out on rank 0 and frees it again) and rank 0 writes each shard
as soon as its tensors are complete (``trainer.state.hf_checkpoint.ShardWriter``), so
it holds at most one shard and one unit, in the training dtype (bf16/fp16 when
enabled). Collective: every rank calls it.

The offline converter needs no torch.distributed and never holds more than one
unit of every rank's partitions at a time (rank files are memory-mapped)::

    python -m trainer.export <save_dir> <out> [--tag TAG] [--dtype fp32|bf16|fp16]
        [--format safetensors|bin] [--max-shard-size 5GB] [--config HF_DIR]

reads ``<save_dir>/<tag>/meta.json`` (``layout``: every parameter's names,
offset and shape inside its unit's flat buffer, written by
``save_checkpoint``), the ``rank_NNNNN.pt`` files and the model's configs that
``save_checkpoint`` keeps in ``<tag>/hf/``, concatenates each unit's fp32
master partitions and writes either one state dict file (``out`` ending in
``.bin``/``.pt``/``.pth``) or an HF model directory (any other ``out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import nn

from trainer.state.hf_checkpoint import (
    BIN_WEIGHTS,
    SAFE_WEIGHTS,
    TORCH_SAVE_SUFFIXES,
    CheckpointError,
    ShardWriter,
    parse_size,
    path_inside,
    remove_stale_weights,
    weights_format,
)
from trainer.zero.engine import Engine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD_SIZE = "5GB"
HF_CONFIG_DIR = "hf"
"""Where ``save_checkpoint`` keeps the model's HF configs inside a tag directory."""
HF_CONFIG_FILES = ("config.json", "generation_config.json")


class ExportError(RuntimeError):
    """A checkpoint cannot be exported; the message says what is missing."""


def _names_of(engine: Engine) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def param_layout(engine: Engine) -> list[list[dict[str, Any]]]:
    """Per unit, each parameter's state-dict names, offset, numel and shape (checkpoint meta)."""
    names = _names_of(engine)
    return [[{"names": names.get(id(slot.param), [slot.name]), "offset": slot.offset,
              "numel": slot.numel, "shape": list(slot.shape)} for slot in unit.slots]
            for unit in engine.units]


def untracked_state(engine: Engine, *, exclude_frozen: bool = False,
                    keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """Buffers and the parameters outside units (frozen ones at stages 0-2) as host copies
    (``keep_vars``: the module's own tensors, wherever they are); without frozen parameters
    with ``exclude_frozen``. Host copies: a checkpoint or export holds no device tensors,
    so it loads where there is no device (an export on a login node)."""
    tracked = {id(slot.param) for unit in engine.units for slot in unit.slots}
    return {name: value if keep_vars else value.detach().to("cpu", copy=True)
            for name, value in engine.module.state_dict(keep_vars=True).items()
            if id(value) not in tracked and not (exclude_frozen and is_frozen(value))}


def frozen_names(engine: Engine) -> list[str]:
    """The state-dict names of the parameters no optimizer of ``engine`` steps: its frozen
    units' (every unit of an engine without an optimizer) and the frozen parameters outside
    units (stages 0-2). meta.json keeps them (``frozen``) for conversions that leave frozen
    parameters out (``exclude_frozen``)."""
    names = _names_of(engine)
    in_units = [name for unit in engine.units if not unit.trainable for slot in unit.slots
                for name in names.get(id(slot.param), [slot.name])]
    return in_units + [name for name, value in untracked_state(engine, keep_vars=True).items()
                       if is_frozen(value)]


def is_frozen(value: torch.Tensor) -> bool:
    """A parameter no optimizer steps (``requires_grad=False``)."""
    return isinstance(value, nn.Parameter) and not value.requires_grad


def write_hf_configs(module: nn.Module, directory: str | os.PathLike[str],
                     dtype: torch.dtype) -> list[Path]:
    """The model's ``config.json`` (and ``generation_config.json``) as ``save_pretrained``
    writes them, ``dtype`` being the weights'; nothing for a model without an HF config."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return []
    directory = Path(directory)
    config = copy.deepcopy(config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(module).__name__]
    config.save_pretrained(directory)
    written = [directory / "config.json"]
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(directory)
        written.append(directory / "generation_config.json")
    return written


def _export_names(names: list[str], fmt: str) -> list[str]:
    """The names a tensor is written under: one for safetensors (see module docstring)."""
    return names[:1] if fmt == "safetensors" else names


def save_16bit_model(engine: Engine, save_dir: str | os.PathLike[str],
                     save_filename: str = SAFE_WEIGHTS, exclude_frozen_parameters: bool = False,
                     *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> bool:
    """Write the model in the training dtype as an HF directory (see module docstring):
    ``save_filename`` ending in ``.bin`` writes torch.save shards instead of safetensors;
    ``exclude_frozen_parameters`` leaves out parameters that do not require grad (a
    LoRA-style export of the trained part), as DeepSpeed's does."""
    fmt = weights_format(save_filename)
    names = _names_of(engine)
    kept = {unit.index: [(slot, _export_names(names.get(id(slot.param), [slot.name]), fmt))
                         for slot in unit.slots
                         if slot.param.requires_grad or not exclude_frozen_parameters]
            for unit in engine.units}
    writer: ShardWriter | None = None
    untracked: dict[str, torch.Tensor] = {}
    if engine.collectives.rank == 0:
        untracked = untracked_state(engine, exclude_frozen=exclude_frozen_parameters)
        element = torch.empty(0, dtype=engine.precision.dtype).element_size()
        sizes = [(name, slot.numel * element) for unit in engine.units
                 for slot, slot_names in kept[unit.index] for name in slot_names]
        sizes += [(name, value.numel() * value.element_size())
                  for name, value in untracked.items()]
        writer = _open_writer(Path(save_dir), sizes, save_filename, max_shard_size)
    full = getattr(engine.placement, "full", None)  # stage 3's gatherer
    for unit in engine.units:
        was_free = full is not None and full.state(unit).value == "free"
        engine.placement.gather(unit)
        if writer is not None:
            for slot, slot_names in kept[unit.index]:
                value = slot.param.detach().clone()
                for name in slot_names:
                    writer.add(name, value)
        if was_free:
            engine.placement.release(unit)
    if writer is not None:
        for name, value in untracked.items():
            writer.add(name, value)
        writer.finish()
        write_hf_configs(engine.module, save_dir, engine.precision.dtype)
    engine.collectives.barrier()
    return True


def _open_writer(target: Path, sizes: list[tuple[str, int]], weights_name: str,
                 max_shard_size: int | str) -> ShardWriter:
    """A writer into ``target``, with the weights an earlier export left there removed."""
    target.mkdir(parents=True, exist_ok=True)
    remove_stale_weights(target)
    return ShardWriter(target, sizes, weights_name=weights_name,
                       max_shard_bytes=parse_size(max_shard_size))


# ---------------------------------------------------------------------------
# offline conversion


LATEST_FILE = "latest"
"""In a save dir: the tag of the newest complete checkpoint."""
META_FILE = "meta.json"
MAX_TAG_NBYTES = 4096
"""Longest ``latest`` file read: a tag is a directory name."""


def rank_file(tag_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s partition of a checkpoint lives."""
    return tag_dir / f"rank_{rank:05d}.pt"


def latest_tag(save_dir: Path) -> str | None:
    """The tag ``save_dir``'s ``latest`` file names; None when there is no such file.

    ``latest`` comes with the checkpoint, so it is read like any of its files: it must be a
    small regular file inside ``save_dir`` (``path_inside`` then checks the tag it names)."""
    latest = save_dir / LATEST_FILE
    if not latest.exists():
        return None
    path_inside(save_dir, LATEST_FILE, what=f"{save_dir}'s '{LATEST_FILE}' file")
    if not latest.is_file():
        raise CheckpointError(f"{latest} is not a regular file; it should hold a tag")
    with latest.open("rb") as file:
        raw = file.read(MAX_TAG_NBYTES + 1)
    if len(raw) > MAX_TAG_NBYTES:
        raise CheckpointError(f"{latest} holds more than {MAX_TAG_NBYTES} bytes, not a tag; "
                              f"pass the tag explicitly")
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{latest} is not UTF-8 text ({error}); it should hold a "
                              f"tag") from error
    if not tag:
        raise CheckpointError(f"{latest} is empty; it should hold a tag")
    return tag


def read_meta(checkpoint_dir: Path) -> dict[str, Any]:
    """A tag directory's meta.json, its counts checked (see ``check_meta``); raises
    ``FileNotFoundError`` when there is none."""
    meta_path = path_inside(checkpoint_dir, META_FILE, what=f"{checkpoint_dir}'s {META_FILE}")
    if not meta_path.is_file():
        raise FileNotFoundError(f"no checkpoint at {checkpoint_dir} (missing {META_FILE})")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{meta_path} is not JSON ({error})") from error
    check_meta(meta, meta_path)
    return meta


def _count(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0


def check_meta(meta: object, meta_path: Path) -> None:
    """Every count meta.json holds, checked before anything is sized by it: a positive int
    ``world_size`` (``rank_files`` checks it against the files on disk) and per unit a
    partitioning ``trainer.zero.partition`` could have made. Raises ``CheckpointError``."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path} is not a JSON object")
    world_size = meta.get("world_size")
    if not (_count(world_size) and world_size > 0):
        raise CheckpointError(f"{meta_path} has world_size={world_size!r}; it must be the "
                              f"number of ranks that saved it (a positive int)")
    units = meta.get("units")
    if not isinstance(units, list) or not all(isinstance(unit, dict) for unit in units):
        raise CheckpointError(f"{meta_path} has no 'units' list")
    for position, unit in enumerate(units):
        numel, padded, part = (unit.get(key) for key in ("numel", "padded_numel", "part_numel"))
        if not (_count(unit.get("index")) and _count(numel) and _count(padded)
                and _count(part) and _partitioned_as(numel, padded, part, world_size)):
            raise CheckpointError(
                f"{meta_path}: units[{position}] has numel={numel!r}, padded_numel="
                f"{padded!r}, part_numel={part!r}; a unit saved by {world_size} ranks pads "
                f"numel to padded_numel, cut into 1 or {world_size} parts of part_numel")


def _partitioned_as(numel: int, padded: int, part: int, world_size: int) -> bool:
    """``numel`` elements padded to ``padded`` and cut into 1 or ``world_size`` equal parts
    (``trainer.zero.partition``): the padding is less than one element per part."""
    num_parts = 1 if part == padded else world_size
    return part * num_parts == padded and 0 <= padded - numel < num_parts


def check_layout(meta: dict[str, Any], meta_path: Path) -> None:
    """meta.json's ``layout``: per unit, every parameter inside the unit's elements."""
    layout = meta["layout"]
    if not isinstance(layout, list) or len(layout) != len(meta["units"]):
        raise CheckpointError(f"{meta_path}: 'layout' must list the parameters of each of "
                              f"its {len(meta['units'])} units")
    for unit, slots in zip(meta["units"], layout, strict=True):
        for slot in slots if isinstance(slots, list) else [None]:
            if not (isinstance(slot, dict) and _count(slot.get("offset"))
                    and _count(slot.get("numel")) and isinstance(slot.get("shape"), list)
                    and all(_count(size) for size in slot["shape"])
                    and math.prod(slot["shape"]) == slot["numel"]
                    and slot["offset"] + slot["numel"] <= unit["numel"]
                    and isinstance(slot.get("names"), list) and slot["names"]
                    and all(isinstance(name, str) for name in slot["names"])):
                raise CheckpointError(
                    f"{meta_path}: a parameter of unit {unit['index']} in 'layout' is "
                    f"{slot!r}; each needs names, and an offset, numel and shape that lie "
                    f"inside the unit's {unit['numel']} elements")


def rank_files(checkpoint_dir: Path, world_size: int,
               error: type[CheckpointError] = CheckpointError) -> list[Path]:
    """The ``world_size`` rank files of a checkpoint, each inside ``checkpoint_dir``.

    Raises ``error`` naming the first missing ones: a world size larger than the files on
    disk costs a look at those files, never ``world_size`` of anything.
    """
    files: list[Path] = []
    missing: list[str] = []
    for rank in range(world_size):
        file = path_inside(checkpoint_dir, rank_file(checkpoint_dir, rank).name,
                           what=f"{checkpoint_dir}'s rank {rank} file")
        if not file.is_file():
            missing.append(file.name)
            if len(missing) == 8:
                break
        files.append(file)
    if missing:
        raise error(f"checkpoint {checkpoint_dir} was saved by {world_size} ranks but "
                    f"{missing} {'and more ' if len(missing) == 8 else ''}are missing (its "
                    f"{META_FILE} has world_size={world_size}); loading at another world size "
                    f"or exporting reads every rank's file: copy the whole tag directory")
    return files


def _resolve_tag(save_dir: Path, tag: str | None) -> Path:
    if tag is None:
        tag = latest_tag(save_dir)
        if tag is None:
            raise ExportError(f"{save_dir} has no 'latest' file; name the checkpoint's tag "
                              f"(--tag, tag=)")
        what = f"{save_dir}'s '{LATEST_FILE}' file"
    else:
        what = "--tag"
    checkpoint_dir = path_inside(save_dir, tag, what=what)
    if not (checkpoint_dir / META_FILE).exists():
        raise ExportError(f"no checkpoint at {checkpoint_dir} (missing meta.json)")
    return checkpoint_dir


def _open_checkpoint(save_dir: str | os.PathLike[str], tag: str | None, *,
                     weights_only: bool = True, whole: bool = True
                     ) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """The tag directory, its meta.json and every rank file, memory-mapped. ``whole``: a
    checkpoint saved without its frozen parameters is refused (it is not a whole model)."""
    checkpoint_dir = _resolve_tag(Path(save_dir), tag)
    meta = read_meta(checkpoint_dir)
    if meta.get("layout") is None:
        raise ExportError(f"{checkpoint_dir}/meta.json has no 'layout' (written before "
                          f"exports were supported); load it in an engine and call "
                          f"save_16bit_model instead")
    check_layout(meta, checkpoint_dir / META_FILE)
    if whole and meta.get("frozen_excluded"):
        raise ExportError(
            f"{checkpoint_dir} was saved with exclude_frozen_parameters=True (HF Trainer "
            f"does for PEFT models): it holds no frozen weights, so it is not a whole model. "
            f"Save the adapters with the PEFT model's save_pretrained (Trainer.save_model), "
            f"or load the checkpoint into an engine over the base model "
            f"(load_module_strict=False) and call save_16bit_model")
    ranks = [torch.load(file, mmap=True, weights_only=weights_only, map_location="cpu")
             for file in rank_files(checkpoint_dir, meta["world_size"])]
    return checkpoint_dir, meta, ranks


def iter_units(save_dir: str | os.PathLike[str], tag: str | None = None,
               dtype: torch.dtype = torch.float32) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(unit_index, {name: tensor})`` one unit at a time, then ``(-1, buffers)``.

    A tied tensor appears once per name, as the same tensor object."""
    _, meta, ranks = _open_checkpoint(save_dir, tag)
    return _iter_units(meta, ranks, dtype, _Selection.of(meta, ranks))


def consolidate_checkpoint(save_dir: str | os.PathLike[str], tag: str | None = None,
                           dtype: torch.dtype = torch.float32, *, weights_only: bool = True,
                           exclude_frozen: bool = False, whole: bool = True
                           ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's whole state dict (tied tensors once per name, as one object) and
    rank 0's ``client_state``, read once (``weights_only=False``: unpickled unrestricted,
    for a client state holding the caller's classes; trusted files only).

    ``exclude_frozen`` leaves out the parameters the saving engine did not train;
    ``whole=False`` accepts a checkpoint saved without its frozen parameters and gives
    what it holds (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` does both)."""
    _, meta, ranks = _open_checkpoint(save_dir, tag, weights_only=weights_only, whole=whole)
    selection = _Selection.of(meta, ranks, exclude_frozen=exclude_frozen)
    return _state_dict(meta, ranks, dtype, selection), ranks[0].get("client_state", {})


@dataclass(frozen=True)
class _Selection:
    """What a conversion reads of a checkpoint: the units it skips (absent from every rank
    file of a checkpoint saved without its frozen parameters) and the names it leaves
    out (frozen parameters, when asked)."""

    absent: frozenset[int] = frozenset()
    left_out: frozenset[str] = frozenset()

    @classmethod
    def of(cls, meta: dict[str, Any], ranks: list[dict[str, Any]], *,
           exclude_frozen: bool = False) -> _Selection:
        absent = frozenset(
            unit["index"] for unit in meta["units"] if meta.get("frozen_excluded")
            and all(_rank_units(rank).get(unit["index"]) is None for rank in ranks))
        if not exclude_frozen:
            return cls(absent)
        frozen = meta.get("frozen")
        if not (isinstance(frozen, list) and all(isinstance(name, str) for name in frozen)):
            raise ExportError(
                f"this checkpoint's {META_FILE} does not list its frozen parameters "
                f"('frozen'; checkpoints saved before offloadd kept that list have none), "
                f"so they cannot be left out: convert it without exclude_frozen_parameters")
        return cls(absent, frozenset(frozen))

    def units(self, meta: dict[str, Any]
              ) -> Iterator[tuple[dict[str, Any], list[tuple[dict[str, Any], list[str]]]]]:
        """Each unit read, with its slots and their names but those left out (slots left
        with none dropped; units left with none, or absent, skipped)."""
        for unit, slots in zip(meta["units"], meta["layout"], strict=True):
            kept = [(slot, [name for name in slot["names"] if name not in self.left_out])
                    for slot in slots]
            kept = [(slot, names) for slot, names in kept if names]
            if kept and unit["index"] not in self.absent:
                yield unit, kept


def _rank_units(rank: dict[str, Any]) -> dict[Any, Any]:
    units = rank.get("units") if isinstance(rank, dict) else None
    return units if isinstance(units, dict) else {}


def _state_dict(meta: dict[str, Any], ranks: list[dict[str, Any]],
                dtype: torch.dtype, selection: _Selection) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for _, tensors in _iter_units(meta, ranks, dtype, selection):
        state.update(tensors)
    return state


def _iter_units(meta: dict[str, Any], ranks: list[dict[str, Any]], dtype: torch.dtype,
                selection: _Selection) -> Iterator[tuple[int, dict[str, Any]]]:
    for unit, kept in selection.units(meta):
        index = unit["index"]
        parts = [_saved_part(rank, unit, rank_index) for rank_index, rank in enumerate(ranks)]
        partitioned = unit["part_numel"] != unit["padded_numel"]
        flat = (torch.cat(parts) if partitioned else parts[0]).to(dtype)
        tensors: dict[str, torch.Tensor] = {}
        for slot, names in kept:
            value = flat.narrow(0, slot["offset"], slot["numel"]).view(slot["shape"]).clone()
            for name in names:
                tensors[name] = value
        yield index, tensors
    yield -1, {name: value.clone() for name, value in ranks[0]["untracked"].items()
               if name not in selection.left_out}


def _saved_part(rank: dict[str, Any], unit: dict[str, Any], rank_index: int) -> torch.Tensor:
    """A rank file's fp32 master (or parameter) partition of ``unit``, of the size meta.json
    gives it (``part_numel``): what the layout is then cut from."""
    state = _rank_units(rank).get(unit["index"])
    part = state.get("master", state.get("param")) if isinstance(state, dict) else None
    if not isinstance(part, torch.Tensor) or part.dim() != 1 \
            or part.numel() != unit["part_numel"]:
        found = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
        raise CheckpointError(
            f"rank {rank_index}'s file has {found} for unit {unit['index']}, not the "
            f"{unit['part_numel']} elements its meta.json gives (part_numel)")
    return part


def export_checkpoint(save_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      tag: str | None = None, dtype: torch.dtype = torch.float32,
                      weights_name: str = SAFE_WEIGHTS,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                      config_dir: str | os.PathLike[str] | None = None,
                      exclude_frozen: bool = False, weights_only: bool = False,
                      directory: bool | None = None) -> Path:
    """Convert a ZeRO checkpoint into one state dict file (``out`` ending in .bin/.pt/.pth)
    or an HF model directory that ``from_pretrained`` loads (see module docstring).

    The configs come from ``config_dir`` when given, else from the checkpoint (models with
    an HF config); a directory without ``config.json`` raises ``ExportError`` after the
    weights are written, naming ``--config``. ``weights_only``: the weight files alone, as
    DeepSpeed's ``zero_to_fp32`` writes them (also of a checkpoint saved without its frozen
    parameters: what it holds); ``exclude_frozen`` leaves out the parameters the saving
    engine did not train. ``directory``: True, a directory even where ``out``'s name ends
    in .bin/.pt/.pth; False, one file whatever its name; None, by the suffix."""
    out = Path(out)
    tag_dir, meta, ranks = _open_checkpoint(save_dir, tag, whole=not weights_only)
    selection = _Selection.of(meta, ranks, exclude_frozen=exclude_frozen)
    if directory is False or (directory is None and out.suffix in TORCH_SAVE_SUFFIXES):
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_state_dict(meta, ranks, dtype, selection), out)
        return out
    fmt = weights_format(weights_name)
    element = torch.empty(0, dtype=dtype).element_size()
    sizes = [(name, slot["numel"] * element) for _, kept in selection.units(meta)
             for slot, names in kept for name in _export_names(names, fmt)]
    sizes += [(name, value.numel() * value.element_size())
              for name, value in ranks[0]["untracked"].items()
              if name not in selection.left_out]
    writer = _open_writer(out, sizes, weights_name, max_shard_size)
    for _, tensors in _iter_units(meta, ranks, dtype, selection):
        written: set[int] = set()
        for name, value in tensors.items():
            if fmt == "bin" or id(value) not in written:
                writer.add(name, value)
                written.add(id(value))
    writer.finish()
    if weights_only:
        return out
    if config_dir is not None:
        _copy_configs(Path(config_dir), out, dtype)
    else:
        _copy_configs(tag_dir / HF_CONFIG_DIR, out, dtype, inside=tag_dir)
    return out


def _copy_configs(source: Path, out: Path, dtype: torch.dtype, *,
                  inside: Path | None = None) -> None:
    """The HF configs from ``source`` into ``out``; ``inside``: a checkpoint's directory
    that every config file read must lie in (``path_inside``)."""
    if inside is not None:
        for name in HF_CONFIG_FILES:
            path_inside(inside, str((source / name).relative_to(inside)),
                        what=f"the checkpoint's {HF_CONFIG_DIR}/{name}")
    if not (source / "config.json").exists():
        raise ExportError(
            f"the weights are in {out}, but {source} has no config.json, which "
            f"from_pretrained needs (the checkpoint's model has no HF config); pass "
            f"--config DIR (config_dir=) naming a directory with the model's config.json")
    for name in HF_CONFIG_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, out / name)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.export",
        description="Convert a ZeRO checkpoint (engine.save_checkpoint) into an HF model "
                    "directory (or one state dict file), one unit at a time, without "
                    "torch.distributed.")
    parser.add_argument("save_dir", help="the directory given to save_checkpoint")
    parser.add_argument("out", help="a directory for from_pretrained, or a .bin/.pt/.pth file")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: 'latest')")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--format", choices=["safetensors", "bin"], default="safetensors",
                        help="weight files of the directory (default: safetensors)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="split the weights into shards of at most this size (e.g. 5GB)")
    parser.add_argument("--config", default=None,
                        help="directory holding the model's config.json (default: the one "
                             "save_checkpoint kept in the checkpoint)")
    args = parser.parse_args(argv)
    try:
        written = export_checkpoint(
            args.save_dir, args.out, tag=args.tag, dtype=DTYPES[args.dtype],
            weights_name=SAFE_WEIGHTS if args.format == "safetensors" else BIN_WEIGHTS,
            max_shard_size=args.max_shard_size, config_dir=args.config)
    except (ExportError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(written)
    return 0

