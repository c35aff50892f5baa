"""--pages-as-heap=yes judged by real Massif, snapshot by snapshot (page_series.c), and a burst of page calls at full
speed, none of them lost.

heapscope applies the page syscalls in order in user space, by Massif's rules (agent/model/pages.py with massif=True:
a page mapped over stays counted, the break moves by Massif's arithmetic) and takes Massif's snapshots at them
(agent/model/pageschedule.py). What a native run cannot have the same is what the program starts with: Valgrind
maps its client's stack itself, preloads its own library into it, and gives it no vDSO. So the series are compared
from page_series.c's first call on (a 64 MiB mapping marks it): each snapshot's time and total as a change from the
marker's must be Massif's, every one of them, through brk moves by pages and by unaligned amounts, mremap shrinking
and moving, and MAP_FIXED over live pages.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.harness import Completed
from tests.support.massif_reader import parse_massif

pytestmark = pytest.mark.integration

OPTIONS = (
    "--pages-as-heap=yes",
    "--detailed-freq=1000000",
    "--max-snapshots=1000",  # no culling: a snapshot at every page event Massif would take one at
)
MARKER = 16384 * 4096


def _from_marker(text: str) -> list[tuple[int, int, str]]:
    """The snapshots from the marker's on, as (time, total) changes from the marker's, with their kinds."""
    snaps = parse_massif(text).snapshots
    i = next(k for k, s in enumerate(snaps) if s.heap_B >= MARKER)
    t0, h0 = snaps[i].time, snaps[i].heap_B
    return [(s.time - t0, s.heap_B - h0, s.heap_tree) for s in snaps[i:]]


def test_page_series_as_massif(
    build: Callable[..., Path], run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    program = build("page_series.c")
    ref_run = run_massif(program, ("40",), OPTIONS)
    assert ref_run.returncode == 0, ref_run.stderr
    got_run = run_heapscope(program, ("40",), OPTIONS)
    assert got_run.returncode == 0, got_run.stderr
    assert len(parse_massif(ref_run.massif_text).snapshots) < 1000, "Massif culled: the series are not whole"
    ref, got = _from_marker(ref_run.massif_text), _from_marker(got_run.massif_text)
    assert len(ref) > 300  # 40 rounds of 8 calls, most of them a snapshot
    for i, (theirs, ours) in enumerate(zip(ref, got, strict=False)):
        assert ours == theirs, f"snapshot {i} after the marker: {ours} against Massif's {theirs}"
    assert len(got) == len(ref)
    assert "pages: NOT COUNTED" not in got_run.stderr


def test_page_calls_at_full_speed_lose_nothing(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    """25,000 rounds: 200,000 page syscalls in a tight loop, over four times what the ring holds (~47,000). The
    kernel stops the target from three quarters full until the loop has drained the ring (`run` only)."""
    program = build("page_series.c")
    done = run_heapscope(program, ("25000",), ("--pages-as-heap=yes", "--max-snapshots=100"))
    assert done.returncode == 0, done.stderr
    pages = done.summary["pages"]
    kernel = pages["kernel"]
    assert kernel["lost"] == 0 and kernel["calls_full"] == 0, (kernel, done.stderr)
    assert kernel["events"] >= 8 * 25_000
    assert pages["stats"]["applied"] + pages["stats"]["failed"] + pages["stats"]["invalid"] >= 8 * 25_000
    assert "pages: NOT COUNTED" not in done.stderr
