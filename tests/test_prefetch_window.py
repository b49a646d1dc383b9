"""PrefetchWindow: the learned prefetch's lookahead shrinks while prefetches are wasted."""

from __future__ import annotations

import pytest

from offloadd.swap.scheduler import PrefetchWindow


def period(window: PrefetchWindow, issued: int, wasted: int) -> float:
    window.issued, window.wasted = issued, wasted
    return window.update()


def test_waste_shrinks_the_window_to_its_floor_and_a_clean_period_grows_it_back() -> None:
    window = PrefetchWindow(0.25, smallest=1 / 64)
    assert window.fraction == 0.25
    assert period(window, 20, 10) == 0.25 / 4
    assert period(window, 20, 10) == 1 / 64
    assert period(window, 20, 10) == 1 / 64  # never below the floor: it can learn again
    assert period(window, 20, 0) == 2 / 64
    for _ in range(8):
        period(window, 20, 0)
    assert window.fraction == 0.25  # never above the largest


def test_a_little_waste_holds_the_window_and_a_short_period_is_not_judged() -> None:
    window = PrefetchWindow(0.25)
    assert period(window, 20, 2) == 0.25  # 10%: at the limit, kept
    window.fraction = 0.125
    assert period(window, 20, 1) == 0.125  # some waste: no growth either
    assert period(window, 5, 5) == 0.125  # fewer than min_issued prefetches: no verdict
    assert (window.issued, window.wasted) == (5, 5)  # carried into the next period
    assert period(window, 10, 9) == 0.125 / 4


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="prefetch window bounds"):
        PrefetchWindow(0.25, smallest=0.5)
