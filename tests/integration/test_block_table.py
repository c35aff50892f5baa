"""The kernel's table of live blocks (probes/heap.bpf.c block_slots, and the overflow hash behind it).

Blocks whose bucket is full go to the overflow table and are counted exactly like the others; blocks that fit
neither are counted as dropped and reported, and their frees as untracked: never a wrong total, never silence.
Run with the smallest table (--max-blocks=1024: 1024 slots in 512 buckets, each bucket for 32 bytes of address
space, wrapping every 16 KiB; 512 overflow entries) so that both paths fill.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.harness import Completed
from tests.support.massif_reader import MassifFile, parse_massif

pytestmark = pytest.mark.integration

SMALL_TABLE = ("--max-blocks=1024",)
SMALL_CAPACITY = 1024 + 512
SIZE_16K = 16384 - 8  # glibc: a chunk of exactly 16 KiB


def profile(done: Completed) -> MassifFile:
    assert done.returncode == 0, done.stderr
    return parse_massif(done.massif_text)


def test_colliding_blocks_are_tracked_in_the_overflow_table(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    """20 blocks 16 KiB apart share one bucket of 2 slots (and 32 KiB apart after a realloc that doubles them):
    18 live in the overflow table, and are still exact through malloc, realloc and free."""
    program = build("blocks.c")
    done = run_heapscope(program, ["20", str(SIZE_16K), "1"], options=SMALL_TABLE)
    parsed = profile(done)
    assert "NOT COUNTED" not in done.stderr, done.stderr
    assert done.counters["untracked_frees"] == 0, done.stderr
    peak = parsed.peak
    assert peak is not None
    assert peak.heap_B == 20 * 2 * SIZE_16K + 20 * 8  # and the array of pointers
    assert parsed.snapshots[-1].heap_B == 0
    c = done.counters
    assert (c["n_allocs"], c["n_frees"], c["n_reallocs"]) == (21, 21, 20), done.stderr


def test_a_full_table_is_counted_not_silent(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    """3000 live blocks in a table of at most 1536: the rest are reported as dropped, their frees as untracked,
    and the totals cover exactly the tracked blocks."""
    program = build("blocks.c")
    done = run_heapscope(program, ["3000", "24", "0"], options=SMALL_TABLE)
    parsed = profile(done)
    dropped = done.counters["dropped_blocks"]
    untracked = done.counters["untracked_frees"]
    assert "NOT COUNTED" in done.stderr, done.stderr  # and said where a person reads it
    assert 3000 - SMALL_CAPACITY <= dropped < 3000, done.stderr
    assert untracked == dropped, done.stderr
    peak = parsed.peak
    assert peak is not None
    tracked = 3000 - dropped
    assert peak.heap_B == tracked * 24 + 3000 * 8  # the kept blocks, and the array of pointers (tracked first)
    assert parsed.snapshots[-1].heap_B == 0


def test_default_table_tracks_them_all(build: Callable[..., Path], run_heapscope: Callable[..., Completed]) -> None:
    program = build("blocks.c")
    done = run_heapscope(program, ["1000", "24", "1"])
    parsed = profile(done)
    assert "NOT COUNTED" not in done.stderr, done.stderr
    peak = parsed.peak
    assert peak is not None
    assert peak.heap_B == 1000 * 48 + 1000 * 8
    assert parsed.snapshots[-1].heap_B == 0
