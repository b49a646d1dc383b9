"""Resume a checkpoint at another world size (DeepSpeed's universal checkpoints, on load).

A unit's state is one flat buffer per kind (``param``, ``master``, ``exp_avg``,
``exp_avg_sq``) of ``numel`` real elements, padded to a multiple of the number
of partitions and cut into equal contiguous partitions, one per rank
(``trainer.zero.partition``). Moments stored compactly (bf16, 8-bit block-wise:
offloadd.formats) are decoded to fp32 per saved partition first, since 8-bit
blocks do not survive a new cut; the backend encodes them again (bf16 exactly,
8-bit re-quantized in the new blocks). Padding is zero and never trained, so the flat state
does not depend on the world size: concatenating the saved partitions and
dropping the old padding gives it back, and re-padding and slicing gives this
rank's partition at the new world size. The rank files are memory-mapped, so a
rank holds one unit's flat state at a time.

What is not partitioned (Adam step count, skipped steps, param-group
hyper-parameters, LR scheduler, loss scaler, global steps and samples, buffers
and replicated frozen parameters) is the same in every rank file; rank 0's is
used. The micro-step counter is re-derived from the global step, as the
accumulation window may differ at the new world size (a checkpoint is taken at
an accumulation boundary; partial gradients are never saved).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from offloadd import moment_codec
from trainer.offload.backend import MOMENT_KINDS
from trainer.state.export import rank_files
from trainer.state.hf_checkpoint import CheckpointError
from trainer.zero.engine import Engine
from trainer.zero.partition import Unit


class ReshardError(CheckpointError):
    """A checkpoint cannot be resharded into this engine; the message says why."""


def check_reshardable(engine: Engine, saved: dict[str, Any], tag_dir: Path) -> None:
    """Same model (units by name and size), stage and dtype; only the world size differs.
    ``saved`` is a meta.json whose counts ``trainer.state.export.check_meta`` checked."""
    current = [(u.index, u.name, u.numel) for u in engine.units]
    stored = [(u["index"], u.get("name"), u["numel"]) for u in saved["units"]]
    if stored != current:
        raise ReshardError(
            f"checkpoint {tag_dir} (world size {saved['world_size']}) was saved from other "
            f"units than this engine's: first difference "
            f"{next(((a, b) for a, b in zip(stored, current) if a != b), None)}; resume it with "
            f"the same model and the same 'units' config")
    rank_files(tag_dir, saved["world_size"], ReshardError)


UnitRestore = Callable[[Unit, dict[str, torch.Tensor]], None]
"""Writes one unit's state (this rank's partition of each kind) into the engine."""


def check_absent(unit: Unit, saved: dict[str, Any], where: str,
                 error: type[Exception]) -> None:
    """A unit ``where`` holds no state for is allowed only where the checkpoint left its
    frozen parameters out (``frozen_excluded``; the caller checked the strict option) and
    the unit is frozen here; anything else raises ``error``. By presence, not by this
    engine's flags: an engine without an optimizer has every unit frozen, and must still
    read the units the checkpoint holds (a LoRA run's adapters)."""
    if not (saved.get("frozen_excluded") and not unit.trainable):
        raise error(f"{where} has no state for unit {unit.index} ({unit.name})")


def load_resharded(engine: Engine, tag_dir: Path, saved: dict[str, Any],
                   restore: UnitRestore, *, weights_only: bool = True) -> dict[str, Any]:
    """Restore every unit's partition from a checkpoint of another world size through
    ``restore``; returns rank 0's payload for the rest of the state (``engine``,
    ``untracked``, ``client_state``). A unit the rank files lack is skipped where
    ``check_absent`` allows it."""
    ranks = [torch.load(file, mmap=True, weights_only=weights_only, map_location="cpu")
             for file in rank_files(tag_dir, saved["world_size"], ReshardError)]
    for unit, saved_unit in zip(engine.units, saved["units"], strict=True):
        parts = [payload["units"].get(unit.index) for payload in ranks]
        if all(part is None for part in parts):
            check_absent(unit, saved, f"{tag_dir}'s rank files", ReshardError)
            continue
        if any(part is None for part in parts):
            raise ReshardError(f"a rank file of {tag_dir} has no state for unit "
                               f"{unit.index} ({unit.name})")
        state = {kind: _repartition(unit, [_flat(part[kind], kind, saved_unit)
                                           for part in parts], saved_unit)
                 for kind in parts[0]}
        restore(unit, state)
    rest = ranks[0]
    rest["engine"] = {**rest["engine"],
                      "micro_steps": int(rest["engine"]["global_steps"])
                      * engine.gradient_accumulation_steps()}
    return rest


def _flat(part: torch.Tensor, kind: str, saved_unit: dict[str, Any]) -> torch.Tensor:
    """A saved partition as elements: compact moments decoded to fp32. Its size is checked
    against meta.json's ``part_numel`` first, so no count from meta.json sizes a decode."""
    moment = isinstance(part, torch.Tensor) and kind in MOMENT_KINDS \
        and part.dtype != torch.float32
    if not isinstance(part, torch.Tensor) or (
            moment_codec.moment_numel(part) if moment else part.numel()
    ) != saved_unit["part_numel"]:
        raise ReshardError(f"a rank file's {kind} of unit {saved_unit['index']} holds "
                           f"{getattr(part, 'shape', part)!r}, not the "
                           f"{saved_unit['part_numel']} elements its meta.json gives "
                           f"(part_numel)")
    if moment:
        return moment_codec.decode(part, signed=kind == "exp_avg",
                                   numel=saved_unit["part_numel"])
    return part


def _repartition(unit: Unit, saved_parts: list[torch.Tensor],
                 saved_unit: dict[str, Any]) -> torch.Tensor:
    """This rank's partition of the flat state whose saved partitions are ``saved_parts``."""
    if saved_unit["part_numel"] == saved_unit["padded_numel"]:
        flat = saved_parts[0]  # not partitioned (stage 0 or one rank): every file has it all
    else:
        flat = torch.cat(saved_parts)
    padded = torch.zeros(unit.padded_numel, dtype=flat.dtype)
    padded[:unit.numel].copy_(flat[:unit.numel])
    return unit.part_slice(padded).clone()
