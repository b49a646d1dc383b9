"""Pretrained Hugging Face weights into a ZeRO model, one tensor at a time.

``load_pretrained(model_or_engine, path)`` reads a checkpoint as
``save_pretrained`` writes it (``trainer.state.hf_checkpoint``) and never holds the
whole model:

- **before ``initialize``, model built under ``zero.Init``** (parameters on
  ``meta``): the checkpoint is matched against the model's names and shapes
  now and remembered; ``initialize`` then materialises each unit as usual and
  rank 0 fills it from the checkpoint, tensor by tensor, instead of running the
  model's init (parameters the checkpoint lacks keep their init). Peak rank
  memory: one unit plus one tensor.
- **after ``initialize``** (the engine, or the model it wraps): every rank
  reads only the element range of its own partition of each unit (safetensors
  slices), writes it into the fp32 master and the training-dtype partition
  (``StateBackend.set_state``: in the rank or in the daemon) and refreshes the
  unit. Adam moments and step counts are left as they are.
- **a model that is neither**: its tensors are overwritten in place.

``AutoModelForCausalLM.from_pretrained(path)`` inside ``trainer.zero.Init``
also works: transformers only takes its ZeRO-3 loading path when DeepSpeed is
configured, so here it builds the model on ``meta`` and its loaded tensors are
dropped by ``zero.Init`` as they are made (its peak is one tensor). Under the
HF Trainer or accelerate with a ZeRO-3 config (``import trainer.hf``) it takes
that path, inside ``deepspeed.zero.Init`` (``trainer.zero.Init``): rank 0 reads
the checkpoint and copies it into the ``meta`` parameters through the facade's
``GatheredParameters``, which does nothing (``trainer.integrations.ds_facade``). Either way
it leaves every parameter it loaded flagged ``_is_hf_initialized`` and the
model's ``name_or_path`` pointing at the checkpoint; ``initialize`` sees the
flags and streams the same files as ``load_pretrained`` would (a hub id is
looked up in the local HF cache only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainer.dist.agreement import agree
from trainer.state.hf_checkpoint import (
    BIN_INDEX,
    BIN_WEIGHTS,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    CheckpointReader,
)
from trainer.zero.engine import Engine
from trainer.zero.partition import Unit


class PretrainedError(ValueError):
    """A checkpoint does not fit the model; the message names the tensors and the fix."""


@dataclass(kw_only=True)
class LoadReport:
    """What ``load_pretrained`` matched (state-dict names of the model / the checkpoint)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Model tensors the checkpoint lacks (they keep their init / current values)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors the model has no place for (ignored, as HF does)."""


def _model_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Every parameter and persistent buffer once, with all its state-dict names (tied
    weights have several)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    persistent = set(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            names.setdefault(id(buffer), []).append(name)
            tensors[id(buffer)] = buffer
    return [(names[key], tensors[key]) for key in names]


class PretrainedSource:
    """A checkpoint matched to a model: which file tensor fills which model tensor.

    ``shapes`` overrides tensor shapes by ``id`` (stage 3 parameters are empty between
    gathers)."""

    def __init__(self, path: str | os.PathLike[str], model: nn.Module, *,
                 strict: bool, shapes: dict[int, torch.Size] | None = None) -> None:
        self.path = Path(path)
        self.reader = CheckpointReader(path)
        self.report = LoadReport()
        self._key_of: dict[str, str] = {}
        """Model state-dict name (every alias of a tied tensor) -> checkpoint name."""
        mismatched = self._match(model, shapes or {})
        if mismatched:
            raise PretrainedError(f"{self.path} does not fit the model (shapes differ): "
                                  f"{mismatched[:8]}; build the model from the checkpoint's "
                                  f"config.json")
        if strict and self.report.missing:
            raise PretrainedError(
                f"{self.path} lacks {len(self.report.missing)} tensor(s) of the model: "
                f"{self.report.missing[:8]}; pass strict=False to keep their init")

    def _match(self, model: nn.Module, shapes: dict[int, torch.Size]) -> list[str]:
        """Fill the name map and the report; the shape mismatches."""
        available = set(self.reader.names())
        prefix = getattr(model, "base_model_prefix", "") or ""
        mismatched: list[str] = []
        for names, tensor in _model_tensors(model):
            key = next((key for name in names for key in _candidates(name, prefix)
                        if key in available), None)
            shape = tuple(shapes.get(id(tensor), tensor.shape))
            if key is None:
                self.report.missing.append(names[0])
            elif tuple(self.reader.shape(key)) != shape:
                mismatched.append(f"{names[0]}: model {shape}, "
                                  f"checkpoint {tuple(self.reader.shape(key))}")
            else:
                self._key_of.update(dict.fromkeys(names, key))
                self.report.loaded.append(names[0])
        self.report.unexpected = sorted(available - set(self._key_of.values()))
        return mismatched

    def key_of(self, name: str) -> str | None:
        """The checkpoint name holding the model tensor ``name`` (None: the checkpoint lacks
        it). Names, not tensor objects: ``initialize`` replaces buffers when it moves them."""
        return self._key_of.get(name)

    def read_into(self, name: str, tensor: torch.Tensor) -> bool:
        """Overwrite ``tensor`` (the model's ``name``) with its checkpoint value; False when
        the checkpoint has none."""
        key = self.key_of(name)
        if key is None:
            return False
        with torch.no_grad():
            tensor.copy_(self.reader.read(key).view(tensor.shape))
        return True


def _candidates(name: str, prefix: str) -> list[str]:
    """Checkpoint names a model name may be saved under (with/without the base model)."""
    if not prefix:
        return [name]
    stripped = name.removeprefix(prefix + ".")
    return [name, stripped] if stripped != name else [name, f"{prefix}.{name}"]


# ---------------------------------------------------------------------------
# the public call


def load_pretrained(model_or_engine: nn.Module, path: str | os.PathLike[str], *,
                    strict: bool = True) -> LoadReport:
    """Load an HF checkpoint directory (or weight file) into a model or an engine.

    Works before ``initialize`` on a model built under ``trainer.zero.Init`` (the
    weights are streamed in as ``initialize`` materialises each unit), after it on the
    engine or its model (each rank reads its own partitions), and on a plain model.
    ``strict`` raises when the checkpoint lacks a model tensor; shapes must always
    match. Collective after ``initialize``: every rank calls it.
    """
    engine = model_or_engine if isinstance(model_or_engine, Engine) else _engine_of(
        model_or_engine)
    if engine is not None:
        # Stage 3 parameters are empty between gathers: their shapes are the units' slots'.
        shapes = {id(slot.param): slot.shape for unit in engine.units for slot in unit.slots}
        source = PretrainedSource(path, engine.module, strict=strict, shapes=shapes)
        load_into_engine(engine, source)
        return source.report
    model = model_or_engine
    source = PretrainedSource(path, model, strict=strict)
    if any(param.is_meta for param in model.parameters()):
        _check_built_under_init(model)
        model._zero_pretrained = source  # type: ignore[assignment]
        return source.report
    for names, tensor in _model_tensors(model):
        source.read_into(names[0], tensor)
    return source.report


def _engine_of(model: nn.Module) -> Engine | None:
    for param in model.parameters():
        ref = getattr(param, "_zero_engine", None)
        if ref is not None and ref() is not None:
            engine: Engine = ref()
            return engine
    return None


def _check_built_under_init(model: nn.Module) -> None:
    stray = [name for name, param in model.named_parameters()
             if param.is_meta and getattr(param, "_zero_init", None) is None]
    if stray:
        raise PretrainedError(
            f"parameters {stray[:4]} are on 'meta' but were not built under "
            f"trainer.zero.Init; build the model inside `with trainer.zero.Init(...)` (or on "
            f"CPU) before load_pretrained")


# ---------------------------------------------------------------------------
# before initialize: the engine's materialisation fills units (rank 0)


def pending_source(model: nn.Module) -> PretrainedSource | None:
    """The checkpoint ``initialize`` must fill a meta-built model from, if any:
    ``load_pretrained``'s, or the one ``from_pretrained`` loaded under ``zero.Init``."""
    source: PretrainedSource | None = getattr(model, "_zero_pretrained", None)
    if source is not None:
        return source
    loaded = [name for name, param in model.named_parameters()
              if param.is_meta and getattr(param, "_is_hf_initialized", False)]
    if not loaded:
        return None
    path = _resolve_hf_checkpoint(model)
    source = PretrainedSource(path, model, strict=False)
    absent = [name for name in loaded if name in source.report.missing]
    if absent:
        raise PretrainedError(
            f"from_pretrained under zero.Init loaded {absent[:4]}, which {path} does not hold "
            f"under these names (a checkpoint transformers converts on load); build the "
            f"model from its config under zero.Init and call trainer.load_pretrained(model, "
            f"converted_checkpoint_dir)")
    model._zero_pretrained = source  # type: ignore[assignment]
    return source


def forget_pending(model: nn.Module) -> None:
    """``initialize`` has filled every unit: drop the pending checkpoint (and its open
    ``.bin`` memory maps) so a later ``initialize`` does not read it again."""
    model.__dict__.pop("_zero_pretrained", None)


def _resolve_hf_checkpoint(model: nn.Module) -> Path:
    name_or_path = str(getattr(model, "name_or_path", "") or "")
    if name_or_path and Path(name_or_path).is_dir():
        return Path(name_or_path)
    if name_or_path:
        from huggingface_hub import try_to_load_from_cache

        for filename in (SAFE_INDEX, SAFE_WEIGHTS, BIN_INDEX, BIN_WEIGHTS):
            cached = try_to_load_from_cache(name_or_path, filename)
            if isinstance(cached, str):
                return Path(cached).parent
    raise PretrainedError(
        f"the model was loaded by from_pretrained under trainer.zero.Init, whose weights "
        f"are read again at initialize, but its checkpoint {name_or_path!r} is neither a "
        f"local directory nor in the local HF cache; download it (huggingface-cli download) "
        f"and load from that directory, or call trainer.load_pretrained(model, path)")


# ---------------------------------------------------------------------------
# after initialize: each rank writes its partitions


def load_into_engine(engine: Engine, source: PretrainedSource) -> None:
    """Write the checkpoint into every unit's partitions and the replicated tensors."""
    tracked: set[int] = set()
    for unit in engine.units:
        tracked.update(id(slot.param) for slot in unit.slots)
        with agree(engine.collectives, f"loading pretrained weights into unit {unit.name}"):
            _load_unit(engine, unit, source)
        engine.placement.after_step(unit)
    for names, tensor in _model_tensors(engine.module):
        if id(tensor) not in tracked:
            source.read_into(names[0], tensor)  # replicated: every rank reads the same


def _load_unit(engine: Engine, unit: Unit, source: PretrainedSource) -> None:
    state = engine.backend.get_state(unit.index)
    if unit.trainable:
        part = state["master"]
    else:
        param = torch.empty(unit.part_numel, dtype=engine.precision.dtype)
        engine.backend.read_params(unit.index, param)
        part = param.float()
    begin = unit.part_index * unit.part_numel
    end = begin + unit.part_numel
    for slot in unit.slots:
        key = source.key_of(slot.name)
        low, high = max(begin, slot.offset), min(end, slot.offset + slot.numel)
        if key is None or low >= high:
            continue
        values = source.reader.read_flat(key, low - slot.offset, high - slot.offset)
        part[low - begin: high - begin].copy_(values)
    if unit.trainable:
        engine.backend.set_state(unit.index, state)
    else:
        engine.backend.set_state(unit.index, {"param": part.to(engine.precision.dtype)})


__all__ = ["LoadReport", "PretrainedError", "PretrainedSource", "load_pretrained"]
