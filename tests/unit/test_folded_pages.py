"""agent.model.pages.FoldedPages: sampled mode's page figures, the kernel's folded mapped total and the sampled
page calls, each standing for 1/p calls in MALT's statistics."""

from __future__ import annotations

import itertools
import random

from agent.model.pages import FoldedPages, PageEvent

RATE = 524_288


def call(kind: str, site: int, length: int, failed: bool = False) -> PageEvent:
    return PageEvent(kind, 0, 1, site, 0x10000, length, 0, 0, 0, 0, failed)


def test_the_total_is_the_kernels_and_the_peak_the_highest_folded() -> None:
    pages = FoldedPages(total=1_000_000, rate=RATE)
    assert (pages.total, pages.peak_total, pages.peak_time_ns) == (1_000_000, 1_000_000, None)
    pages.fold(None, 5)  # no page call since the last look: nothing moves
    assert (pages.total, pages.peak_total) == (1_000_000, 1_000_000)
    pages.fold((900_000, 4_000_000), 10)  # rose between two looks, then came down
    assert (pages.total, pages.peak_total, pages.peak_time_ns) == (900_000, 4_000_000, 10)
    pages.fold((2_000_000, 2_000_000), 20)  # below the peak: the peak and its time stay
    assert (pages.total, pages.peak_total, pages.peak_time_ns) == (2_000_000, 4_000_000, 10)


def test_calls_at_or_above_the_rate_count_once_and_failed_calls_not_at_all() -> None:
    pages = FoldedPages(total=0, rate=RATE)
    pages.apply([call("mmap", 7, RATE), call("mmap", 7, 3 * RATE), call("munmap", 8, RATE),
                 call("mmap", 7, RATE, failed=True), call("mremap", 9, RATE), call("brk", 0, 0)])
    assert pages.calls == {(7, "mmap"): [2, RATE, 3 * RATE, 4 * RATE], (8, "munmap"): [1, RATE, RATE, RATE]}
    assert (pages.stats.events, pages.stats.applied, pages.stats.failed) == (6, 5, 1)


def test_a_small_call_stands_for_rate_over_length_calls_unbiased() -> None:
    """1/p = rate / length, its fraction rounded at random: the mean weight is 1/p, the sum stays count * length."""
    length = 3000  # 1/p = 174.76...
    rand = random.Random(1)
    pages = FoldedPages(total=0, rate=RATE, rand=rand.random)
    weights = {pages.weight(length) for _ in range(1000)}
    assert weights == {174, 175}
    n = 20_000
    pages.apply(itertools.repeat(call("mmap", 3, length), n))
    count, lo, hi, total = pages.calls[(3, "mmap")]
    assert (lo, hi, total) == (length, length, count * length)
    assert abs(count / n - RATE / length) < 0.01  # its rounding's spread: 0.43 / sqrt(n) of a call each
    assert pages.weight(0) == pages.weight(RATE) == 1
