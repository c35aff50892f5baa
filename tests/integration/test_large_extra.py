"""Extra bytes of large blocks, judged by real Massif (large_blocks.c).

A block too big for the 4 MiB superblocks of Valgrind's client arena gets a superblock of its own, whole pages, and
Massif's extra bytes for it run to the page end (up to 4,095 bytes of slop, plus --heap-admin). The rule depends
on the size alone, so heapscope's figures are Massif's to the byte: malloc, calloc, a realloc that stays within
its slop and one that moves, and the sizes at the edge of a superblock.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.harness import Completed
from tests.support.massif_reader import parse_massif

pytestmark = pytest.mark.integration

OPTIONS = ("--detailed-freq=1000000", "--max-snapshots=1000")


def _series(text: str) -> list[tuple[int, int, int]]:
    return [(s.time, s.heap_B, s.heap_extra_B) for s in parse_massif(text).snapshots]


def test_large_blocks_extra_as_massif(
    build: Callable[..., Path], run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    program = build("large_blocks.c")
    ref_run = run_massif(program, (), OPTIONS)
    assert ref_run.returncode == 0, ref_run.stderr
    got_run = run_heapscope(program, (), OPTIONS)
    assert got_run.returncode == 0, got_run.stderr
    ref, got = _series(ref_run.massif_text), _series(got_run.massif_text)
    # Massif's own figures first: the 10 MiB block's 4,040 extra bytes (4,032 of slop and 8 of admin).
    assert ref[1] == (10_489_800, 10 << 20, 4040)
    assert got == ref
    peak = max(ref, key=lambda s: s[1] + s[2])
    c = got_run.counters
    assert (c["peak_heap"], c["peak_extra"]) == peak[1:]
