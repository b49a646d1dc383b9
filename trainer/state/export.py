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
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.state.hf_checkpoint import (
    BIN_WEIGHTS,
    SAFE_WEIGHTS,
    ShardWriter,
    parse_size,
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


def _untracked(engine: Engine) -> dict[str, torch.Tensor]:
    tracked = {id(slot.param) for unit in engine.units for slot in unit.slots}
    return {name: value.detach().clone()
            for name, value in engine.module.state_dict(keep_vars=True).items()
            if id(value) not in tracked}


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
        untracked = _untracked(engine)
        if exclude_frozen_parameters:
            frozen = {name for name, param in engine.module.named_parameters(
                remove_duplicate=False) if not param.requires_grad}
            untracked = {name: value for name, value in untracked.items() if name not in frozen}
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


def _resolve_tag(save_dir: Path, tag: str | None) -> Path:
    if tag is None:
        latest = save_dir / "latest"
        if not latest.exists():
            raise ExportError(f"{save_dir} has no 'latest' file; pass --tag")
        tag = latest.read_text(encoding="utf-8").strip()
    tag_dir = save_dir / tag
    if not (tag_dir / "meta.json").exists():
        raise ExportError(f"no checkpoint at {tag_dir} (missing meta.json)")
    return tag_dir


def _open_checkpoint(save_dir: str | os.PathLike[str],
                     tag: str | None) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """The tag directory, its meta.json and every rank file, memory-mapped."""
    tag_dir = _resolve_tag(Path(save_dir), tag)
    meta = json.loads((tag_dir / "meta.json").read_text(encoding="utf-8"))
    if meta.get("layout") is None:
        raise ExportError(f"{tag_dir}/meta.json has no 'layout' (written before exports were "
                          f"supported); load it in an engine and call save_16bit_model instead")
    ranks = [torch.load(tag_dir / f"rank_{rank:05d}.pt", mmap=True, weights_only=True,
                        map_location="cpu") for rank in range(meta["world_size"])]
    return tag_dir, meta, ranks


def iter_units(save_dir: str | os.PathLike[str], tag: str | None = None,
               dtype: torch.dtype = torch.float32) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(unit_index, {name: tensor})`` one unit at a time, then ``(-1, buffers)``.

    A tied tensor appears once per name, as the same tensor object."""
    _, meta, ranks = _open_checkpoint(save_dir, tag)
    return _iter_units(meta, ranks, dtype)


def _iter_units(meta: dict[str, Any], ranks: list[dict[str, Any]],
                dtype: torch.dtype) -> Iterator[tuple[int, dict[str, Any]]]:
    for unit, slots in zip(meta["units"], meta["layout"], strict=True):
        index = unit["index"]
        parts = [rank["units"][index] for rank in ranks]
        partitioned = unit["part_numel"] != unit["padded_numel"]
        kind = "master" if "master" in parts[0] else "param"
        flat = (torch.cat([part[kind] for part in parts]) if partitioned
                else parts[0][kind]).to(dtype)
        tensors: dict[str, torch.Tensor] = {}
        for slot in slots:
            value = flat.narrow(0, slot["offset"], slot["numel"]).view(slot["shape"]).clone()
            for name in slot["names"]:
                tensors[name] = value
        yield index, tensors
    yield -1, {name: value.clone() for name, value in ranks[0]["untracked"].items()}


def export_checkpoint(save_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      tag: str | None = None, dtype: torch.dtype = torch.float32,
                      weights_name: str = SAFE_WEIGHTS,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                      config_dir: str | os.PathLike[str] | None = None) -> Path:
    """Convert a ZeRO checkpoint into one state dict file (``out`` ending in .bin/.pt/.pth)
    or an HF model directory that ``from_pretrained`` loads (see module docstring).

    The configs come from ``config_dir`` when given, else from the checkpoint (models with
    an HF config); a directory without ``config.json`` raises ``ExportError`` after the
    weights are written, naming ``--config``."""
    out = Path(out)
    tag_dir, meta, ranks = _open_checkpoint(save_dir, tag)
    if out.suffix in (".bin", ".pt", ".pth"):
        state: dict[str, torch.Tensor] = {}
        for _, tensors in _iter_units(meta, ranks, dtype):
            state.update(tensors)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out)
        return out
    fmt = weights_format(weights_name)
    element = torch.empty(0, dtype=dtype).element_size()
    sizes = [(name, slot["numel"] * element) for slots in meta["layout"] for slot in slots
             for name in _export_names(slot["names"], fmt)]
    sizes += [(name, value.numel() * value.element_size())
              for name, value in ranks[0]["untracked"].items()]
    writer = _open_writer(out, sizes, weights_name, max_shard_size)
    for _, tensors in _iter_units(meta, ranks, dtype):
        written: set[int] = set()
        for name, value in tensors.items():
            if fmt == "bin" or id(value) not in written:
                writer.add(name, value)
                written.add(id(value))
    writer.finish()
    _copy_configs(Path(config_dir) if config_dir is not None else tag_dir / HF_CONFIG_DIR,
                  out, dtype)
    return out


def _copy_configs(source: Path, out: Path, dtype: torch.dtype) -> None:
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

