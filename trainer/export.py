"""Exports: ``engine.save_16bit_model(dir)`` and an offline ZeRO checkpoint converter.

``save_16bit_model`` gathers the model unit by unit (stage 3 all-gathers each
unit, copies it out on rank 0 and frees it again) and rank 0 writes one
``torch.save`` file whose keys are ``model.state_dict()``'s, values in the
training dtype (bf16/fp16 when enabled). Collective: every rank calls it.

The offline converter needs no torch.distributed and never holds more than one
unit of every rank's partitions at a time (rank files are memory-mapped)::

    python -m trainer.export <save_dir> <out> [--tag TAG] [--dtype fp32|bf16|fp16]

reads ``<save_dir>/<tag>/meta.json`` (``layout``: every parameter's names,
offset and shape inside its unit's flat buffer, written by
``save_checkpoint``) and the ``rank_NNNNN.pt`` files, concatenates each unit's
fp32 master partitions and writes either one state dict file (``out`` ending
in ``.bin``/``.pt``/``.pth``) or, otherwise, a directory with one shard per
unit plus ``pytorch_model.bin.index.json`` (HF's sharded-checkpoint index:
``{"metadata": {"total_size"}, "weight_map": {name: shard}}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.engine import Engine

INDEX_FILE = "pytorch_model.bin.index.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def save_16bit_model(engine: Engine, save_dir: str | os.PathLike[str],
                     save_filename: str = "pytorch_model.bin") -> bool:
    """Write the model's parameters (training dtype) and buffers; rank 0 writes the file."""
    rank0 = engine.collectives.rank == 0
    names = _names_of(engine)
    full = getattr(engine.placement, "full", None)  # stage 3's gatherer
    state: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        was_free = full is not None and full.state(unit).value == "free"
        engine.placement.gather(unit)
        if rank0:
            for slot in unit.slots:
                value = slot.param.detach().clone()
                for name in names.get(id(slot.param), [slot.name]):
                    state[name] = value
        if was_free:
            engine.placement.release(unit)
    if rank0:
        state.update(_untracked(engine))
        ordered = {name: state[name] for name in engine.module.state_dict() if name in state}
        target = Path(save_dir)
        target.mkdir(parents=True, exist_ok=True)
        partial = target / (save_filename + ".partial")
        torch.save(ordered, partial)
        os.replace(partial, target / save_filename)
    engine.collectives.barrier()
    return True


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


def iter_units(save_dir: str | os.PathLike[str], tag: str | None = None,
               dtype: torch.dtype = torch.float32) -> Any:
    """Yield ``(unit_index, {name: tensor})`` one unit at a time, then ``(-1, buffers)``."""
    tag_dir = _resolve_tag(Path(save_dir), tag)
    meta = json.loads((tag_dir / "meta.json").read_text(encoding="utf-8"))
    layout = meta.get("layout")
    if layout is None:
        raise ExportError(f"{tag_dir}/meta.json has no 'layout' (written before exports were "
                          f"supported); load it in an engine and call save_16bit_model instead")
    ranks = [torch.load(tag_dir / f"rank_{rank:05d}.pt", mmap=True, weights_only=True,
                        map_location="cpu") for rank in range(meta["world_size"])]
    for unit, slots in zip(meta["units"], layout, strict=True):
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
                      tag: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a ZeRO checkpoint into a plain state dict file or a sharded directory."""
    out = Path(out)
    if out.suffix in (".bin", ".pt", ".pth"):
        state: dict[str, torch.Tensor] = {}
        for _, tensors in iter_units(save_dir, tag, dtype):
            state.update(tensors)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    shards: list[tuple[str, dict[str, torch.Tensor]]] = []
    weight_map: dict[str, str] = {}
    total = 0
    for position, (_, tensors) in enumerate(iter_units(save_dir, tag, dtype)):
        if not tensors:
            continue
        filename = f"pytorch_model-{position:05d}.bin"
        torch.save(tensors, out / filename)
        shards.append((filename, tensors))
        seen: set[int] = set()
        for name, value in tensors.items():
            weight_map[name] = filename
            if id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.export",
        description="Convert a ZeRO checkpoint (engine.save_checkpoint) into a plain "
                    "state dict, one unit at a time, without torch.distributed.")
    parser.add_argument("save_dir", help="the directory given to save_checkpoint")
    parser.add_argument("out", help="a .bin/.pt/.pth file, or a directory for per-unit shards")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: 'latest')")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    try:
        written = export_checkpoint(args.save_dir, args.out, tag=args.tag,
                                    dtype=DTYPES[args.dtype])
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
