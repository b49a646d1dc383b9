"""``zero.GatheredParameters``: full parameters outside forward on every rank, found through
the engine that manages them (each parameter keeps a weak reference to it), with
``modifier_rank``'s edits written back into the partitions and the fp32 master.
``fwd_module`` declares the parameters used in that module's forward, as DeepSpeed's does
(``trainer.zero.external.register_external_parameter``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from trainer.zero.engine import Engine
from trainer.zero.external import register_external_parameter
from trainer.zero.init import ZeroInitError, unmaterialised
from trainer.zero.partition import Unit


class GatheredParameters:
    """Full parameters outside forward on every rank; ``modifier_rank``'s edits are kept.

    Collective: every rank must enter it with the same parameters. Parameters
    not managed by an engine are left alone.
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor],
                 modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        if fwd_module is not None and enabled:  # DeepSpeed's meaning: used in its forward
            for param in params:
                if isinstance(param, nn.Parameter):
                    register_external_parameter(fwd_module, param)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._targets: list[tuple[Engine, Unit]] = []
        seen: set[tuple[int, int]] = set()
        for param in params:
            if enabled and unmaterialised(param):
                raise ZeroInitError(
                    "GatheredParameters on parameters built under zero.Init before "
                    "trainer.initialize: they have no values yet and edits would be lost; load "
                    "weights with trainer.load_pretrained(model, checkpoint_dir) before "
                    "initialize, or gather and edit them after initialize")
            ref = getattr(param, "_zero_engine", None)
            engine = ref() if ref is not None else None
            if engine is None:
                continue
            unit: Unit = param._zero_unit  # type: ignore[attr-defined]
            if (id(engine), unit.index) not in seen:
                seen.add((id(engine), unit.index))
                self._targets.append((engine, unit))
        self._targets.sort(key=lambda target: target[1].index)  # one order on every rank
        self._before: list[torch.Tensor] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for engine, unit in self._targets:
            engine.placement.pin(unit)  # the engine's hooks leave it gathered until __exit__
            if self.modifier_rank is not None:
                self._before.append(unit.flatten_params(engine.precision.dtype))
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None:
            for (engine, unit), before in zip(self._targets, self._before, strict=True):
                _write_back(engine, unit, before, self.modifier_rank)  # while still pinned
            self._before = []
        for engine, unit in self._targets:
            engine.placement.unpin(unit)


def _write_back(engine: Engine, unit: Unit, before: torch.Tensor, modifier_rank: int) -> None:
    """Broadcast the modifier's values; changed elements replace the fp32 master exactly."""
    after = unit.flatten_params(engine.precision.dtype)
    engine.collectives.broadcast(after, modifier_rank)
    # The optimizer state is host memory (get_state): compare on the host, where the mask
    # indexes it (a device mask cannot index a host tensor).
    after_part = unit.part_slice(after).cpu()
    changed = after_part != unit.part_slice(before).cpu()
    if bool(changed.any()) and not unit.trainable:  # frozen: the partition is all there is
        engine.backend.set_state(unit.index, {"param": after_part.clone()})
    elif bool(changed.any()):
        state = engine.backend.get_state(unit.index)
        master = state["master"]
        master[changed] = after_part[changed].float().to(master.device)
        state["param"] = master.to(engine.precision.dtype)
        engine.backend.set_state(unit.index, state)
    engine.placement.after_step(unit)
