"""``ReduceOrder`` (no ranks): reductions leave in reverse unit order whatever order units
become ready in, so every rank issues them identically."""

from __future__ import annotations

import torch
from _dist import make_model

from trainer.config import UnitsConfig
from trainer.zero.partition import build_units
from trainer.zero.reduce_order import ReduceOrder


def units() -> list:
    return build_units(make_model(), UnitsConfig(module_classes=("Block",)), num_parts=2,
                       part_index=0)


def test_ready_units_wait_for_the_units_before_them_in_reverse_order() -> None:
    all_units = units()
    assert len(all_units) == 4
    order = ReduceOrder(all_units)
    order.start()
    grad = torch.zeros(1)
    # Block 1 (unit 2) is ready first, but unit 3 (the last block) goes first.
    assert order.ready(all_units[2], grad) == []
    assert [u.index for u, _ in order.ready(all_units[3], grad)] == [3, 2]
    assert order.ready(all_units[0], grad) == []
    assert [u.index for u, _ in order.ready(all_units[1], grad)] == [1, 0]
    assert order.complete


def test_a_backward_that_raised_leaves_nothing_behind() -> None:
    all_units = units()
    order = ReduceOrder(all_units)
    order.start()
    order.ready(all_units[1], torch.zeros(1))
    order.start()
    assert [u.index for u, _ in order.ready(all_units[3], torch.zeros(1))] == [3]
