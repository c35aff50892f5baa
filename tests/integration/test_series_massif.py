"""Massif's whole series, snapshot by snapshot, judged by real Valgrind Massif.

Each case runs one program under `valgrind --tool=massif` and under `heapscope run` with the same options and
--time-unit=B, and compares the two files whole: every snapshot's time, mem_heap_B, mem_heap_extra_B,
mem_stacks_B and kind (empty, detailed, peak), and every detailed tree node for node (bytes and labels, load
addresses left out; Massif's `in N places, all below massif's threshold` nodes included). That is the schedule
(which events make snapshots, the peak snapshots, the culling), the detailed frequency (every Nth snapshot, a
peak counting as detailed; an old peak stays detailed), the trees at their own instants (heapscope rebuilds
them from the kernel's snapshot log, whatever the ticks), and what Massif does not write (a peak snapshot when
nothing was freed, a snapshot at exit). The schedule's counts are compared too (Massif's --stats=yes against
heapscope's summary line).

The programs call only the allocator, and keep each block's size for its slot: Valgrind's allocator then pads
every block as heapscope's size model says, so the B clocks agree to the byte (test_schedule_massif.py shows a
program where they drift).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.harness import Completed
from tests.support.massif_reader import MassifFile, Node, parse_massif, strip_address
from tests.support.oracle import heapscope_schedule, massif_schedule

pytestmark = pytest.mark.integration

# Massif's own defaults, over the oracle's options (--threshold=0.0 --peak-inaccuracy=0.0 --detailed-freq=1).
DEFAULTS = ("--threshold=1.0", "--peak-inaccuracy=1.0", "--detailed-freq=10", "--max-snapshots=100")

Tree = tuple[int, str, tuple["Tree", ...]]
Row = tuple[int, int, int, int, str, "Tree | None"]


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    options: tuple[str, ...] = ()
    args: tuple[str, ...] = ()


CASES = [
    Case("defaults", "series.c"),
    Case("freq1_max10", "series.c", ("--detailed-freq=1", "--max-snapshots=10")),
    Case("every_peak", "series.c", ("--peak-inaccuracy=0.0", "--detailed-freq=3")),
    # The same calls spread over ~100 ms: many sampling ticks fall between the points.
    Case("paced", "series.c", args=("paced",)),
    Case("paced_freq1_max10", "series.c", ("--detailed-freq=1", "--max-snapshots=10"), ("paced",)),
    Case("many_peaks", "peaks.c"),
    Case("many_peaks_freq1", "peaks.c", ("--detailed-freq=1",)),
    Case("many_peaks_max10", "peaks.c", ("--max-snapshots=10",)),
    # Over well within one sampling tick, and never frees.
    Case("never_frees", "never_frees.c"),
    Case("never_frees_freq1_max10", "never_frees.c", ("--detailed-freq=1", "--max-snapshots=10")),
]


def canonical(node: Node) -> Tree:
    """A tree as bytes, address-free label and children (in an order of their own: ties in bytes are ordered
    by address, and the two runs load the program at different addresses)."""
    return (node.bytes, strip_address(node.label), tuple(sorted(canonical(c) for c in node.children)))


def rows(f: MassifFile) -> list[Row]:
    return [
        (s.time, s.heap_B, s.heap_extra_B, s.stacks_B, s.heap_tree, canonical(s.tree) if s.tree else None)
        for s in f.snapshots
    ]


def first_difference(ref: list[Row], got: list[Row]) -> str:
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            return f"snapshot {i}:\n  massif    {a[:5]}\n  heapscope {b[:5]}" + (
                f"\n  trees differ:\n  massif    {a[5]}\n  heapscope {b[5]}" if a[5] != b[5] else ""
            )
    return f"{len(ref)} snapshots in Massif's file, {len(got)} in heapscope's"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_whole_series_is_massifs(
    case: Case,
    build: Callable[..., Path],
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
    record_property: Callable[[str, object], None],
) -> None:
    program = build(case.source)
    options = (*DEFAULTS, *case.options)
    ref_run = run_massif(program, case.args, (*options, "--stats=yes"))
    assert ref_run.returncode == 0, ref_run.stderr
    got_run = run_heapscope(program, case.args, options)
    assert got_run.returncode == 0, got_run.stderr
    ref, got = rows(parse_massif(ref_run.massif_text)), rows(parse_massif(got_run.massif_text))
    detailed = sum(1 for r in ref if r[5] is not None)
    record_property("series", f"{len(ref)} snapshots, {detailed} with a tree")
    assert got == ref, first_difference(ref, got)
    assert detailed >= 2, "the case must compare trees"
    assert heapscope_schedule(got_run) == massif_schedule(ref_run)
    assert "NOT EXACT" not in got_run.stderr and "NOT COUNTED" not in got_run.stderr, got_run.stderr


def test_the_cases_show_what_the_issue_saw(
    build: Callable[..., Path], run_massif: Callable[..., Completed]
) -> None:
    """The cases are the ones that told heapscope's series from Massif's: a peak snapshot only after a free,
    none at exit, detailed snapshots far apart in a short run, peaks that turn detailed, and cullings."""
    def massif(source: str, *options: str, args: tuple[str, ...] = ()) -> MassifFile:
        done = run_massif(build(source), args, (*DEFAULTS, *options))
        assert done.returncode == 0, done.stderr
        return parse_massif(done.massif_text)

    never = massif("never_frees.c")
    assert [s.heap_tree for s in never.snapshots].count("peak") == 0
    assert len(never.snapshots) == 41  # the startup snapshot and one a call: nothing at exit
    assert [i for i, s in enumerate(never.snapshots) if s.tree is not None] == [9, 19, 29, 39]
    peaks = massif("peaks.c")
    assert sum(1 for s in peaks.snapshots if s.heap_tree == "detailed") > len(peaks.snapshots) // 10 + 1
    short = massif("series.c", "--detailed-freq=1", "--max-snapshots=10")
    assert 5 <= len(short.snapshots) <= 10 and all(s.tree is not None for s in short.snapshots)
