"""bench/service_panel.py's ratio and its interval (Row.ratio, Row.spread): pure arithmetic on the load tool's
rates, so the panel's verdict on the 0.97 goal is not an artefact of how its repeats are summed."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from service_panel import Row


def _row(ratios: list[float], swapped_at: int | None, instance_gain: float = 1.0) -> Row:
    """Runs whose profiled/untraced ratio is `ratios[i]`; the first instance `instance_gain` times as fast as the
    second (profiled in the first half, untraced after the swap)."""
    cut = len(ratios) if swapped_at is None else swapped_at
    untraced = [1000.0 * (instance_gain if i >= cut else 1.0) for i in range(len(ratios))]
    profiled = [1000.0 * r * (instance_gain if i < cut else 1.0) for i, r in enumerate(ratios)]
    return Row("svc", "tool", untraced=untraced, profiled=profiled, swapped_at=swapped_at)


def test_the_order_of_a_repeat_cancels() -> None:
    """The run after the other instance's 20% slower (apache2's with 4 s runs): each order weighs alike, and the
    ratio is the true one, where the median of 12 such repeats could fall on either order's side."""
    order = [0.8 if i % 2 == 0 else 1.25 for i in range(12)]
    row = _row([0.95 * o for o in order], swapped_at=6)
    assert row.ratio == pytest.approx(0.95)
    assert row.spread == pytest.approx(0.0, abs=1e-9)  # no scatter left once the order is taken out


def test_an_instance_of_its_own_faster_cancels_across_the_swap() -> None:
    row = _row([0.95] * 8, swapped_at=4, instance_gain=1.1)
    assert row.ratio == pytest.approx(0.95)
    one_half = _row([0.95] * 4, swapped_at=None, instance_gain=1.1)  # no swap: the advantage stays in
    assert one_half.ratio == pytest.approx(0.95 * 1.1)


def test_the_interval_grows_with_the_scatter_and_shrinks_with_the_repeats() -> None:
    noisy = [0.95 * math.exp(0.1 * (1 if i % 4 < 2 else -1)) for i in range(8)]
    quiet = [0.95 * math.exp(0.02 * (1 if i % 4 < 2 else -1)) for i in range(8)]
    more = [0.95 * math.exp(0.1 * (1 if i % 4 < 2 else -1)) for i in range(32)]
    s_noisy, s_quiet, s_more = (_row(r, swapped_at=len(r) // 2).spread for r in (noisy, quiet, more))
    assert s_noisy is not None and s_quiet is not None and s_more is not None
    assert s_quiet < s_noisy and s_more < s_noisy
    assert _row(noisy, swapped_at=4).ratio == pytest.approx(0.95, rel=0.01)


def test_too_few_repeats_have_no_interval_and_none_have_no_ratio() -> None:
    assert _row([0.9, 1.0], swapped_at=1).spread is None
    assert Row("svc", "tool").ratio is None and Row("svc", "tool").spread is None
