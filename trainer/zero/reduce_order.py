"""One gradient-reduction order on every rank.

gloo (and NCCL) pair collectives by issue order, so every rank must launch its
units' reductions in the same order. Backward does not give one: a unit whose
parameter got no gradient on this rank (an unused parameter, a branch not
taken) never completes its count and is only finished at the end of backward,
while on a rank that used it the unit completes mid-backward. Launching in
completion order would sum one unit's partition with another's on the peer
(silently wrong when the sizes match, a hang when they do not).

``ReduceOrder`` releases reductions in the registered unit order reversed (the
order backward usually completes units in, so overlap is kept for ordinary
models): a unit that is ready early waits for the units before it; a unit that
never becomes ready holds the rest until ``finish_backward`` declares every
unit ready, with zeros where no gradient arrived, as DeepSpeed does.
"""

from __future__ import annotations

import torch

from trainer.zero.partition import Unit


class ReduceOrder:
    """Holds ready gradients and hands them out in reverse unit order."""

    def __init__(self, units: list[Unit]) -> None:
        self._order = list(reversed(units))
        self._next = 0
        self._held: dict[int, torch.Tensor] = {}

    def start(self) -> None:
        """A backward pass begins; what a backward that raised half-way held is dropped."""
        self._held.clear()
        self._next = 0

    def ready(self, unit: Unit, flat_grad: torch.Tensor) -> list[tuple[Unit, torch.Tensor]]:
        """Note that ``unit``'s gradient is final; the units now due for reduction, in order."""
        self._held[unit.index] = flat_grad
        due: list[tuple[Unit, torch.Tensor]] = []
        while self._next < len(self._order) and self._order[self._next].index in self._held:
            next_unit = self._order[self._next]
            due.append((next_unit, self._held.pop(next_unit.index)))
            self._next += 1
        return due

    @property
    def complete(self) -> bool:
        """Every unit of this backward has been handed out."""
        return self._next == len(self._order) and not self._held
