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

Checkpoint tensors are matched to model tensors under the names the modules had
where they were built under ``zero.Init`` (``trainer.zero.init.load_paths``), and
the match is kept by object, so a wrapper applied in between (PEFT's
``get_peft_model``, DDP's ``module.``, ``torch.compile``'s ``_orig_mod``) changes
nothing: the checkpoint still reaches the base weights it re-parented.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from trainer.zero import init as zero_init
from trainer.zero.engine import Engine
from trainer.zero.init import WeightSource
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


@dataclass(kw_only=True)
class _ModelTensor:
    """One parameter or persistent buffer of a model, with every name it may be saved under."""

    tensor: torch.Tensor
    label: str
    """Its current state-dict name (what reports say)."""
    built_names: list[tuple[str, str]] = field(default_factory=list)
    """``(name, base_model_prefix)`` where it was built under ``zero.Init``
    (``load_paths``): the names ``from_pretrained`` loaded it under."""
    current_names: list[tuple[str, str]] = field(default_factory=list)
    """``(name, base_model_prefix)`` of every current alias (tied tensors have several)."""
    places: list[tuple[nn.Module, str]] = field(default_factory=list)
    """``(owning module, attribute)`` of every alias."""

    def checkpoint_names(self) -> list[str]:
        """Checkpoint names to look for, where it was built first (a wrapper applied since,
        such as PEFT's, renames the current ones)."""
        return [key for name, prefix in [*self.built_names, *self.current_names]
                for key in _candidates(name, prefix)]


def _prefix_of(module: nn.Module) -> str:
    return str(getattr(module, "base_model_prefix", "") or "")


def _join(path: str, local: str) -> str:
    return f"{path}.{local}" if path else local


def _model_tensors(model: nn.Module) -> list[_ModelTensor]:
    """Every parameter and persistent buffer of ``model`` once (see ``_ModelTensor``)."""
    found: dict[int, _ModelTensor] = {}
    model_prefix = _prefix_of(model)
    for path, module in model.named_modules(remove_duplicate=False):
        built = [(root_path, _prefix_of(root)) for root, root_path in zero_init.load_paths(module)]
        persistent = [(name, buffer) for name, buffer in module._buffers.items()
                      if name not in module._non_persistent_buffers_set]
        for local, tensor in [*module._parameters.items(), *persistent]:
            if tensor is None:
                continue
            entry = found.get(id(tensor))
            if entry is None:
                entry = found[id(tensor)] = _ModelTensor(tensor=tensor, label=_join(path, local))
            _add(entry.current_names, (_join(path, local), model_prefix))
            for root_path, prefix in built:
                _add(entry.built_names, (_join(root_path, local), prefix))
            _add(entry.places, (module, local))
    return list(found.values())


def _add(items: list[Any], item: Any) -> None:
    if item not in items:  # modules compare by identity
        items.append(item)


class PretrainedSource:
    """A checkpoint matched to a model: which file tensor fills which model tensor.

    The match is made once, by name (where each module was built under ``zero.Init``,
    else its current name), and kept by object: parameters by identity, buffers by their
    owning module and attribute (``initialize`` replaces buffers when it moves them). A
    wrapper applied after the match renames nothing here. ``tensors`` limits the match
    to those (default: the whole model); ``shapes`` overrides tensor shapes by ``id``
    (stage 3 parameters are empty between gathers)."""

    def __init__(self, path: str | os.PathLike[str], model: nn.Module, *,
                 strict: bool, shapes: dict[int, torch.Size] | None = None,
                 tensors: list[_ModelTensor] | None = None) -> None:
        self.path = Path(path)
        self.reader = CheckpointReader(path)
        self.report = LoadReport()
        self._param_key: dict[int, tuple[torch.Tensor, str]] = {}
        """id(parameter) -> (the parameter, kept alive so the id stays its, checkpoint name)."""
        self._buffer_key: dict[tuple[int, str], tuple[nn.Module, str]] = {}
        """(id(module), attribute) -> (the module, checkpoint name)."""
        mismatched = self._match(tensors if tensors is not None else _model_tensors(model),
                                 shapes or {})
        if mismatched:
            raise PretrainedError(f"{self.path} does not fit the model (shapes differ): "
                                  f"{mismatched[:8]}; build the model from the checkpoint's "
                                  f"config.json")
        if strict and self.report.missing:
            raise PretrainedError(
                f"{self.path} lacks {len(self.report.missing)} tensor(s) of the model: "
                f"{self.report.missing[:8]}; pass strict=False to keep their init")

    def _match(self, tensors: list[_ModelTensor], shapes: dict[int, torch.Size]) -> list[str]:
        """Fill the maps and the report; the shape mismatches."""
        available = set(self.reader.names())
        used: set[str] = set()
        mismatched: list[str] = []
        for entry in tensors:
            key = next((key for key in entry.checkpoint_names() if key in available), None)
            shape = tuple(shapes.get(id(entry.tensor), entry.tensor.shape))
            if key is None:
                self.report.missing.append(entry.label)
            elif tuple(self.reader.shape(key)) != shape:
                mismatched.append(f"{entry.label}: model {shape}, "
                                  f"checkpoint {tuple(self.reader.shape(key))}")
            else:
                if isinstance(entry.tensor, nn.Parameter):
                    self._param_key[id(entry.tensor)] = (entry.tensor, key)
                else:
                    for module, local in entry.places:
                        self._buffer_key[(id(module), local)] = (module, key)
                used.add(key)
                self.report.loaded.append(entry.label)
        self.report.unexpected = sorted(available - used)
        return mismatched

    def key_of_param(self, param: torch.Tensor) -> str | None:
        """The checkpoint name holding ``param`` (None: the checkpoint lacks it)."""
        found = self._param_key.get(id(param))
        return found[1] if found is not None else None

    def fill_param(self, param: torch.Tensor) -> bool:
        """Overwrite ``param`` with its checkpoint value; False when the checkpoint has none."""
        key = self.key_of_param(param)
        if key is None:
            return False
        self._read(key, param)
        return True

    def fill_buffers(self, model: nn.Module) -> None:
        """Overwrite every buffer of ``model`` the checkpoint holds."""
        for module in model.modules():
            for local, buffer in module._buffers.items():
                found = self._buffer_key.get((id(module), local))
                if buffer is not None and found is not None:
                    self._read(found[1], buffer)

    def _read(self, key: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.copy_(self.reader.read(key).view(tensor.shape))


class PendingWeights:
    """Several checkpoints filling one model (a model holding two ``from_pretrained``
    models): each tensor from the one it was loaded from."""

    def __init__(self, sources: list[PretrainedSource]) -> None:
        self.sources = sources

    def fill_param(self, param: torch.Tensor) -> bool:
        return any(source.fill_param(param) for source in self.sources)

    def fill_buffers(self, model: nn.Module) -> None:
        for source in self.sources:
            source.fill_buffers(model)


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
    for param in model.parameters():
        source.fill_param(param)
    source.fill_buffers(model)
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


def pending_source(model: nn.Module) -> WeightSource | None:
    """The checkpoint(s) ``initialize`` must fill a meta-built model from, if any:
    ``load_pretrained``'s, or the one ``from_pretrained`` loaded under ``zero.Init``.

    Found on any module of ``model``, so a wrapper applied since (PEFT's ``get_peft_model``,
    DDP, ``torch.compile``) keeps it; ``from_pretrained``'s tensors are matched under the
    names they were loaded as (``zero.init.load_paths``), not their current ones."""
    stored = [module.__dict__["_zero_pretrained"] for module in model.modules()
              if "_zero_pretrained" in module.__dict__]
    if stored:
        return stored[0] if len(stored) == 1 else PendingWeights(stored)
    by_root: dict[int, tuple[nn.Module, list[_ModelTensor]]] = {}
    stray: list[str] = []
    for entry in _model_tensors(model):
        roots = [root for module, _ in entry.places for root, _ in zero_init.load_paths(module)]
        if roots:
            by_root.setdefault(id(roots[0]), (roots[0], []))[1].append(entry)
        elif _loaded_meta(entry):
            stray.append(entry.label)
    if not any(_loaded_meta(entry) for _, entries in by_root.values() for entry in entries):
        return None
    if stray:
        raise PretrainedError(
            f"parameters {stray[:4]} are on 'meta', flagged as loaded by from_pretrained, but "
            f"were not built under zero.Init, so their checkpoint names are unknown; load "
            f"the model with TrainingArguments(deepspeed=...) / the DeepSpeedPlugin in place, "
            f"or build it on CPU")
    sources = [_from_pretrained_source(root, entries) for root, entries in by_root.values()
               if any(_loaded_meta(entry) for entry in entries)]
    return sources[0] if len(sources) == 1 else PendingWeights(sources)


def _loaded_meta(entry: _ModelTensor) -> bool:
    """A parameter ``from_pretrained`` loaded under ZeRO-3 (``_is_hf_initialized``) into
    ``meta``: only rank 0's copy went anywhere, and nowhere; ``initialize`` reads it again."""
    return (isinstance(entry.tensor, nn.Parameter) and entry.tensor.is_meta
            and bool(getattr(entry.tensor, "_is_hf_initialized", False)))


def _from_pretrained_source(root: nn.Module, entries: list[_ModelTensor]) -> PretrainedSource:
    path = _resolve_hf_checkpoint(root)
    source = PretrainedSource(path, root, strict=False, tensors=entries)
    absent = [entry.built_names[0][0] if entry.built_names else entry.label
              for entry in entries
              if _loaded_meta(entry) and source.key_of_param(entry.tensor) is None]
    if absent:
        raise PretrainedError(
            f"from_pretrained under zero.Init loaded {absent[:4]}, which {path} does not hold "
            f"under these names (transformers renamed or converted them while loading this "
            f"checkpoint); build the model from its config under zero.Init and call "
            f"trainer.load_pretrained(model, converted_checkpoint_dir)")
    return source


def forget_pending(model: nn.Module) -> None:
    """``initialize`` has filled every unit: drop the pending checkpoint (and its open
    ``.bin`` memory maps) so a later ``initialize`` does not read it again."""
    for module in model.modules():
        module.__dict__.pop("_zero_pretrained", None)


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
    for param in engine.module.parameters():  # replicated: every rank reads the same
        if id(param) not in tracked:
            source.fill_param(param)
    source.fill_buffers(engine.module)


def _load_unit(engine: Engine, unit: Unit, source: PretrainedSource) -> None:
    state = engine.backend.get_state(unit.index)
    # A frozen unit (stage 3) has no master: its parameter partition is all there is.
    part = (state["master"] if unit.trainable
            else engine.backend.host_params(unit.index).float())
    begin = unit.part_index * unit.part_numel
    end = begin + unit.part_numel
    for slot in unit.slots:
        key = source.key_of_param(slot.param)
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
