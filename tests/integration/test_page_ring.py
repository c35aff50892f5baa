"""Sampled mode's page events go through a small ring (agent.kernel.abi.SAMPLED_PAGE_RING_BYTES), which
the kernel holds for every target: a burst of page syscalls after a quiet spell, ten times what the ring holds,
must still reach the page map whole. The ring a quarter full wakes the profile's loop (probes/heap.bpf.c page_exit,
HS_EV_PAGES), which otherwise looks at a quiet target only once a second; the daemon reads the ring's data
through one mapping, so records that wrap are read in two pieces."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agent.kernel.abi import SAMPLED_PAGE_RING_BYTES
from tests.support.harness import Completed

pytestmark = pytest.mark.integration

PAIRS = 30_000
RECORD = 88 + 8  # struct hs_page_event (80 bytes, rounded to 8) and its ring header, at most


def test_page_burst_after_quiet_spell_loses_nothing(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    assert 2 * PAIRS > 10 * SAMPLED_PAGE_RING_BYTES // RECORD  # the burst is ten rings' worth and more
    program = build("page_burst.c")
    done = run_heapscope(program, args=(str(PAIRS),), options=("--mode=sampled",))
    assert done.returncode == 0, done.stderr
    kernel = done.summary["pages"]["kernel"]
    assert kernel["lost"] == 0 and kernel["calls_full"] == 0, (kernel, done.stderr)
    assert kernel["events"] >= 2 * PAIRS, kernel
    assert "pages: NOT COUNTED" not in done.stderr


TRIM_CYCLES = 500


def test_sampled_mode_folds_brk_and_keeps_the_mapped_peak(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    """glibc moves its break at every growth and trim of the heap's top (apache2's workers: tens of thousands of
    times a second). Sampled mode folds those calls in the kernel (probes/bpf/pages.h brk_folded) instead of sending
    each: the mapped total at the end and its peak (one cycle grows four times higher, between two ticks) are
    exact mode's, which sends every call; the default mode's run is the twin."""
    program = build("heap_trim.c")
    runs = {}
    for mode in ("sampled", "exact"):
        done = run_heapscope(program, args=(str(TRIM_CYCLES),), options=(f"--mode={mode}",))
        assert done.returncode == 0, done.stderr
        runs[mode] = done.summary["pages"]
    sampled, exact = runs["sampled"], runs["exact"]
    # The program's brk calls (strace counts 120 a cycle): every one folded in sampled mode, each an event in exact
    # mode, whose events are those and the loader's few mappings.
    assert sampled["kernel"]["brk_folded"] >= TRIM_CYCLES * 100, sampled
    assert 0 <= exact["kernel"]["events"] - sampled["kernel"]["brk_folded"] < 100, runs
    assert sampled["kernel"]["events"] < 100, sampled  # the sampler's own few mappings, no brk
    assert exact["kernel"]["brk_folded"] == 0, exact
    assert sampled["kernel"]["lost"] == exact["kernel"]["lost"] == 0
    # What moves the mappings' reading again: the loader's code mappings (libc's text, the sampler's), not the heap's.
    for mode, r in runs.items():
        assert 1 <= r["kernel"]["code_maps"] < 20, (mode, r["kernel"])
    # The sampler's library and thread are mapped in sampled mode only: compare what the heap's top added at the
    # peak. Its own few allocations at the heap's base may move the top by a page.
    rise = {m: r["peak_mapped"] - r["mapped"] for m, r in runs.items()}
    assert rise["exact"] >= 4 * 80 * 100_000, runs
    assert abs(rise["sampled"] - rise["exact"]) <= 2 * 4096, runs
