"""--ignore-fn with realloc, judged by real Massif (ignore_realloc.c).

Massif 3.19 (ms_main.c realloc_block) counts no block allocated in an ignored function, nor its reallocs or its
free, wherever they are made; a realloc made in an ignored function is not counted either, and the block is an
ignored one from then on, so its old size stays counted for good. heapscope's kernel knows each site's flag before
a call from it returns (in `run` the target waits at its first call from a new site until user space has said),
so the series, with its times in B, is Massif's snapshot for snapshot.

One figure of Massif's is not its own counters' but its tree's: a detailed snapshot's mem_heap_B is the sum of its
tree, and realloc_block adds the new size of an ignored block realloc'ed outside an ignored function to the tree
at the realloc's stack, never to the counters, and never takes it back. heapscope's trees sum to its counters; the
test checks that Massif's peak differs by exactly those bytes, at exactly those stacks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.harness import Completed
from tests.support.massif_reader import parse_massif, paths

pytestmark = pytest.mark.integration

OPTIONS = (
    "--ignore-fn=quiet_alloc",
    "--ignore-fn=quiet_realloc",
    "--detailed-freq=1000000",  # only the peak is detailed: the others are Massif's counters
    "--max-snapshots=1000",  # nothing culled
)
# Massif's tree at the peak also holds, at grow's stack, the new sizes of the ignored blocks a and d that grow
# realloc'ed (lines 14 and 20 of ignore_realloc.c); its counters never held them.
TREE_ONLY = {"main (ignore_realloc.c:14)": 800, "main (ignore_realloc.c:20)": 10}


def _series(text: str) -> list[tuple[int, int, int, str]]:
    return [(s.time, s.heap_B, s.heap_extra_B, s.heap_tree) for s in parse_massif(text).snapshots]


def _nonzero(text: str, kind: str) -> dict[tuple[str, ...], int]:
    (snap,) = [s for s in parse_massif(text).snapshots if s.heap_tree == kind]
    assert snap.tree is not None
    return {p: b for p, b in paths(snap.tree).items() if b}


def test_ignore_fn_realloc_as_massif(
    build: Callable[..., Path], run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    program = build("ignore_realloc.c")
    ref_run = run_massif(program, (), OPTIONS)
    assert ref_run.returncode == 0, ref_run.stderr
    got_run = run_heapscope(program, (), OPTIONS)
    assert got_run.returncode == 0, got_run.stderr
    ref, got = _series(ref_run.massif_text), _series(got_run.massif_text)

    # Counted: b (200 B, then ignored with its 200 B kept), c (300 B grown to 3000 B), f, g. At exit: b's 200 B
    # that Massif never takes back, and g's 40 B.
    assert [(t, h, x) for t, h, x, _ in ref] == [
        (0, 0, 0), (216, 200, 16), (528, 500, 28), (3232, 3200, 32), (3232, 3200 + 810, 32),
        (6248, 200, 16), (6320, 264, 24), (6392, 200, 16), (6448, 240, 32),
    ], "Massif 3.19 counts otherwise than this test was written for"
    assert len(got) == len(ref)
    for i, ((t, h, x, kind), (rt, rh, rx, rkind)) in enumerate(zip(got, ref, strict=True)):
        assert kind == rkind, (i, kind, rkind)
        tree_only = sum(TREE_ONLY.values()) if rkind == "peak" else 0
        assert (t, h, x) == (rt, rh - tree_only, rx), f"snapshot {i}: {(t, h, x)} against Massif's {(rt, rh, rx)}"

    # The peak's tree is Massif's but for the bytes only Massif's tree holds.
    ours, theirs = _nonzero(got_run.massif_text, "peak"), _nonzero(ref_run.massif_text, "peak")
    grow = next(p for p in theirs if len(p) == 1 and p[0].startswith("grow "))
    expected = dict(theirs)
    expected[grow] -= sum(TREE_ONLY.values())
    for label in TREE_ONLY:
        del expected[(*grow, label)]
    assert ours == expected

    # The summary says what the profile says: b's 200 B and g's 40 B live at the end, in two blocks.
    c = got_run.counters
    assert (c["heap"], c["extra"], c["blocks"]) == (240, 32, 2)
    assert (c["peak_heap"], c["peak_extra"]) == (3200, 32)
