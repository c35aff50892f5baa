"""How the stack walk reads the user stack: in long runs (one read serves many frames), which stop where exec
left the main thread's stack pointer, and are read again up to the page end where a stack of unknown end has
nothing readable above it (probes/heap.bpf.c stack_word)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.harness import Completed
from tests.support.massif_reader import parse_massif, paths

pytestmark = pytest.mark.integration


def unwind_counts(done: Completed) -> tuple[int, int]:
    """(bad reads, runs read again to a page end) from the summary."""
    return done.counters["unwind_bad_read"], done.counters["unwind_short_reads"]


def test_a_stack_with_nothing_above_it_is_walked_whole(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    program = build("coroutine.c")
    done = run_heapscope(program)
    assert done.returncode == 0, done.stderr
    bad, again = unwind_counts(done)
    assert bad == 0, done.stderr
    assert again > 0, done.stderr  # the long runs did reach the PROT_NONE page
    final = parse_massif(done.massif_text).snapshots[-1]
    assert final.tree is not None
    found = {path[-2:]: n for path, n in paths(final.tree).items() if len(path) >= 2}
    assert found.get(("leaf (coroutine.c:16)", "coroutine (coroutine.c:22)")) == 1045, paths(final.tree)


def test_the_main_stack_is_read_without_a_retry(
    build: Callable[..., Path], run_heapscope: Callable[..., Completed]
) -> None:
    """Where the main thread's stack ends is known (/proc/PID/stat startstack): no run reaches past it, into
    pages the kernel's random gap may have left untouched. Several runs: the gap is random."""
    program = build("peak.c")
    for _ in range(5):
        done = run_heapscope(program)
        assert done.returncode == 0, done.stderr
        assert unwind_counts(done) == (0, 0), done.stderr
