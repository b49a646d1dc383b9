"""Stage-3 gather traces: the same units in the same order on every rank, or a clear error.

Stage 3 all-gathers a unit's parameters around its use, and collectives pair
by issue order. Rank-dependent control flow (an MoE expert no token was routed
to, LayerDrop) makes ranks use different units: one unit's all-gather pairs
with another's (wrong weights when the sizes match) or waits forever.

``GatherTrace`` records, per phase kind (a training forward, an eval forward,
a backward), the units used in order:

- the first time a phase kind runs, every gather is first announced to the
  peers (an all-gather of the unit index on the gather group) and the phase
  end too, so a divergence raises ``TraceDivergenceError`` on every rank at
  the first differing gather instead of pairing wrong collectives;
- later phases of that kind are compared locally with the recorded one, for
  free: the rank that diverged raises at its first differing unit, before it
  issues a collective its peers would not.
"""

from __future__ import annotations

import torch

from trainer.dist.collectives import Collectives
from trainer.zero.partition import Unit

PHASE_END = -1
"""Announced in place of a unit index when a recorded phase ends."""

FIX = ("Under ZeRO stage 3 every rank must run the same units in the same order "
       "(rank-dependent control flow such as MoE experts that got no tokens or LayerDrop "
       "skips units on some ranks). Run every unit on every rank (call idle experts on an "
       "empty batch; draw LayerDrop decisions from a generator seeded identically on all "
       "ranks), put the conditional modules inside one unit (units.module_classes, or mark "
       "the enclosing block a leaf before initialize: deepspeed.utils.set_z3_leaf_modules("
       "model, [MoeBlockClass])), or use stage 2, which does not gather parameters.")


class TraceDivergenceError(RuntimeError):
    """Ranks (or steps) used stage-3 units in different orders; the message says the fix."""


PhaseKey = tuple[str, bool]


class GatherTrace:
    """Records units' use order per phase kind and checks it across ranks and steps."""

    def __init__(self, collectives: Collectives, units: list[Unit]) -> None:
        self.collectives = collectives
        self._names = {unit.index: unit.name for unit in units}
        self._reference: dict[PhaseKey, list[int]] = {}
        self._phase: PhaseKey | None = None
        self._current: list[int] = []
        self._expected: list[int] | None = None
        self.num_announced = 0
        """Gathers announced to the peers (first phase of each kind only)."""

    @property
    def announcing(self) -> bool:
        """The current phase kind has no recorded trace yet: gathers are announced."""
        return self._phase is not None and self._expected is None

    def begin(self, kind: str, *, training: bool) -> None:
        """A phase starts (``kind`` forward or backward); one left unfinished (it raised)
        is dropped unchecked."""
        self._phase = (kind, training)
        self._current = []
        self._expected = self._reference.get(self._phase)

    def end(self) -> None:
        """The current phase ends: it must have used every unit its record used."""
        if self._phase is None:
            return
        phase, current, expected = self._phase, self._current, self._expected
        self._phase = None
        if expected is None:
            if self.collectives.world_size > 1:
                self._announce(PHASE_END, phase)
            self._reference[phase] = current
        elif len(current) != len(expected):
            raise self._diverged(phase, expected[len(current)], PHASE_END)

    def visit(self, unit: Unit) -> None:
        """This rank is about to use ``unit`` (its forward, or its backward)."""
        if self._phase is None:
            return
        position = len(self._current)
        expected = self._expected
        if expected is not None and (position >= len(expected)
                                     or expected[position] != unit.index):
            want = expected[position] if position < len(expected) else PHASE_END
            raise self._diverged(self._phase, want, unit.index)
        self._current.append(unit.index)

    def before_gather(self, unit: Unit) -> None:
        """An all-gather of ``unit`` is about to be issued (``FullParams`` calls this)."""
        if self.announcing and self.collectives.world_size > 1:
            assert self._phase is not None
            self._announce(unit.index, self._phase)

    def _announce(self, value: int, phase: PhaseKey) -> None:
        device = self.collectives.device  # the gather group's: NCCL takes device tensors
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        every = torch.empty(self.collectives.world_size, dtype=torch.int64, device=device)
        self.collectives.all_gather(every, mine)
        self.num_announced += 1
        if bool((every != value).any()):
            described = ", ".join(f"rank {rank}: {self._describe(int(index))}"
                                  for rank, index in enumerate(every.tolist()))
            raise TraceDivergenceError(
                f"stage-3 gathers diverged across ranks in the first {self._label(phase)} "
                f"({described}). {FIX}")

    def _diverged(self, phase: PhaseKey, expected: int, got: int) -> TraceDivergenceError:
        return TraceDivergenceError(
            f"rank {self.collectives.rank} left its recorded stage-3 trace in a "
            f"{self._label(phase)}: expected {self._describe(expected)}, got "
            f"{self._describe(got)}; its peers still follow the recorded trace. {FIX}")

    def _describe(self, index: int) -> str:
        if index == PHASE_END:
            return "the end of the pass"
        return f"unit {index} ({self._names.get(index, '?')})"

    @staticmethod
    def _label(phase: PhaseKey) -> str:
        kind, training = phase
        return f"{kind} pass ({'train' if training else 'eval'} mode)"
