"""Sampled mode's page events go through a small ring (agent.kernel.abi.SAMPLED_PAGE_RING_BYTES), which
the kernel holds for every target: a burst of page syscalls after a quiet spell, ten times what the ring holds,
must still reach user space whole. The ring a quarter full wakes the profile's loop (probes/bpf/pages.h page_exit,
HS_EV_PAGES), which otherwise looks at a quiet target only once a second; the daemon reads the ring's data
through one mapping, so records that wrap are read in two pieces. Sampled mode sends the calls it samples (by
length, as allocations): mappings at the sample rate are all sent; small ones are folded into the mapped total.
Sampled mode traces the page calls only with --page-calls=yes; by default it reads the mapped total at each look
(the last test here: the default's twin)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.kernel.abi import SAMPLED_PAGE_RING_BYTES
from agent.model.sampling import DEFAULT_SAMPLE_RATE
from tests.support.harness import Completed

pytestmark = pytest.mark.integration

PAIRS = 30_000
RECORD = 88 + 8  # struct hs_page_event (80 bytes, rounded to 8) and its ring header, at most


def malt_calls(malt: Path, function: str) -> dict[str, int]:
    """MALT's infos of the one stack whose leaf is `function` called from page_burst.c's main."""
    doc = json.loads(malt.read_text())
    strings, instr = doc["sites"]["strings"], doc["sites"]["instr"]
    found = [
        s["infos"][function]
        for s in doc["stacks"]["stats"]
        if [strings[instr[a]["function"]] for a in s["stack"][:2]] == [function, "main"]
    ]
    assert len(found) == 1, (function, found)
    return found[0]  # type: ignore[no-any-return]


def test_page_burst_after_quiet_spell_loses_nothing(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed], tmp_path: Path
) -> None:
    """Mappings of the sample rate: every call sampled and sent, MALT's counts exact."""
    assert 2 * PAIRS > 10 * SAMPLED_PAGE_RING_BYTES // RECORD  # the burst is ten rings' worth and more
    program = build("page_burst.c")
    malt = tmp_path / "malt.json"
    done = run_heapscope(program, args=(str(PAIRS), str(DEFAULT_SAMPLE_RATE)),
                         options=("--mode=sampled", "--page-calls=yes", f"--malt-out-file={malt}", "--malt-format=1.6"))
    assert done.returncode == 0, done.stderr
    kernel = done.summary["pages"]["kernel"]
    assert kernel["lost"] == 0 and kernel["calls_full"] == 0, (kernel, done.stderr)
    assert kernel["events"] >= 2 * PAIRS and kernel["unsampled"] < 100, kernel  # the loader's few small ones
    assert "pages: NOT COUNTED" not in done.stderr
    for function in ("mmap", "munmap"):
        size = DEFAULT_SAMPLE_RATE
        assert malt_calls(malt, function) == {"count": PAIRS, "min": size, "max": size, "sum": PAIRS * size}


@pytest.mark.parametrize(
    ("size", "rate"), [(4096, DEFAULT_SAMPLE_RATE), (1 << 30, 1 << 33)], ids=["default-rate", "rate-above-4GiB"]
)
def test_small_mappings_are_sampled_by_length(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed], tmp_path: Path, size: int, rate: int
) -> None:
    """The default rate's twin: pages of 4 KiB, each sent with probability p = 4096 / rate; the others folded, counted.
    MALT's counts of them are estimates: each sample stands for 1/p calls. A rate past 32 bits (mappings of 1 GiB at
    8 GiB: p = 1/8) takes the kernel's other arithmetic."""
    program = build("page_burst.c")
    malt = tmp_path / "malt.json"
    options = ("--mode=sampled", "--page-calls=yes", f"--sample-rate={rate}", f"--malt-out-file={malt}",
               "--malt-format=1.6")
    done = run_heapscope(program, args=(str(PAIRS), str(size)), options=options)
    assert done.returncode == 0, done.stderr
    kernel = done.summary["pages"]["kernel"]
    p = size / rate
    calls, spread = 2 * PAIRS * p, (2 * PAIRS * p * (1 - p)) ** 0.5  # 469 +- 22 calls; 7,500 +- 81
    assert calls - 5 * spread < kernel["events"] < calls + 5 * spread + 50, kernel  # the loader's few on top
    assert kernel["events"] + kernel["unsampled"] >= 2 * PAIRS, kernel
    assert kernel["lost"] == 0 and kernel["calls_full"] == 0, kernel
    sigma = (PAIRS * (1 - p) / p) ** 0.5  # a Horvitz-Thompson count's standard error: 1,950 calls (6.5%); 458
    for function in ("mmap", "munmap"):
        got = malt_calls(malt, function)
        assert abs(got["count"] - PAIRS) < 5 * sigma, (function, got)
        assert got["min"] == got["max"] == size and got["sum"] == size * got["count"], (function, got)


TRIM_CYCLES = 500


def test_sampled_mode_folds_brk_and_keeps_the_mapped_peak(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    """glibc moves its break at every growth and trim of the heap's top (apache2's workers: tens of thousands of
    times a second). Sampled mode folds those calls in the kernel (probes/bpf/pages.h fold_mapped: the process's
    mapped total, read at each call) instead of sending each: the mapped total at the end and its peak (one cycle
    grows four times higher, between two ticks) are exact mode's, which sends every call (--page-calls=yes: sampled
    mode's default traces no page call, test_sampled_mode_by_default_reads_the_mapped_total)."""
    program = build("heap_trim.c")
    runs = {}
    for mode in ("sampled", "exact"):
        traced = ("--page-calls=yes",) if mode == "sampled" else ()
        done = run_heapscope(program, args=(str(TRIM_CYCLES),), options=(f"--mode={mode}", *traced))
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


def test_sampled_mode_by_default_reads_the_mapped_total(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed], tmp_path: Path
) -> None:
    """Sampled mode's default: no page call traced (no event, no fold, nothing counted in the kernel) and no mmap
    statistics in MALT's profile, while the mapped total is still there, read from /proc/PID/statm at each look: at
    the end it is the traced run's (the kernel's total_vm either way; the program's last page call is before its
    last look)."""
    program = build("heap_trim.c")
    runs = {}
    for calls in ("no", "yes"):
        malt = tmp_path / f"malt-{calls}.json"
        options = ("--mode=sampled", *(("--page-calls=yes",) if calls == "yes" else ()), f"--malt-out-file={malt}",
                   "--malt-format=1.6")
        done = run_heapscope(program, args=(str(TRIM_CYCLES),), options=options)
        assert done.returncode == 0, done.stderr
        runs[calls] = done.summary["pages"], json.loads(malt.read_text())["config"], done.stderr
    (untraced, untraced_malt, said), (traced, traced_malt, _) = runs["no"], runs["yes"]
    assert "B at the highest look (read from statm" in said and "calls applied" not in said, said
    assert untraced["traced"] is False and traced["traced"] is True, runs
    assert untraced["kernel"]["events"] == untraced["kernel"]["brk_folded"] == untraced["kernel"]["code_maps"] == 0
    assert traced["kernel"]["brk_folded"] >= TRIM_CYCLES * 100, traced
    assert untraced_malt["c"]["mmap"] is False and traced_malt["c"]["mmap"] is True, (untraced_malt, traced_malt)
    assert untraced["mapped"] > 0 and abs(untraced["mapped"] - traced["mapped"]) <= 2 * 4096, runs
    assert untraced["peak_mapped"] >= untraced["mapped"], untraced
