"""Snapshots on Massif's schedule, judged by real Valgrind Massif.

Massif takes a snapshot at an allocator event once the minimum interval has passed since the last one, and a
peak snapshot before a free that comes down from a new high; it culls half its snapshots when it has
--max-snapshots, which raises the interval (ms_main.c). heapscope's kernel makes the same decisions at each
event and sends the points to the same culling (agent.model.schedule).

What is compared, for --time-unit=B (the issue's case: --detailed-freq=1, Massif's defaults otherwise):
- the snapshots in the file, heapscope's against Massif's: within 25%. The count left by Massif's culling swings
  between --max-snapshots/2 and --max-snapshots with the time of the last culling, so
- the schedule itself is compared too: the snapshots taken, the peak snapshots taken and the cullings (Massif's
  --stats=yes, heapscope's summary line). On a program that only calls the allocator they are Massif's to the
  snapshot; on sqlite3, whose blocks Valgrind's allocator sometimes pads more than the size model says (a freed
  block reused whole: the extra bytes depend on where the block lands), the B clocks drift apart by about 0.5%;
- the totals at the snapshots: with --max-snapshots=1000 neither tool culls the program's ~880 calls, so both
  files hold the state after every call. Its useful bytes must be Massif's, call by call, and every
  snapshot of heapscope's default run must be one of those states exactly (time, useful and extra bytes).
  test_series_massif.py compares whole files, trees included, on programs whose clocks do not drift.

For --time-unit=ms, Massif's times are those of the program run on Valgrind's synthetic CPU, which is ten to a
hundred times slower than the native run heapscope watches: the counts of a program that computes are not
comparable. A program that mostly sleeps runs about as long on both (Valgrind's part is a few percent): the
snapshots its schedule takes are compared (within 25%); the count left in the file depends on when the last
culling fell in two runs of slightly different lengths, so it is held to Massif's culling bounds, as sqlite3's
is (whatever the speed, after a culling the array holds from half to all of --max-snapshots).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.harness import Completed
from tests.support.massif_reader import MassifFile, parse_massif
from tests.support.oracle import counts_line, heapscope_schedule, massif_schedule, near

pytestmark = pytest.mark.integration

SQLITE = Path("/usr/bin/sqlite3")
# An in-memory table of 20,000 rows with an index, built by one statement: sqlite3's own allocations only.
SQLITE_SCRIPT = (
    "CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, val INTEGER);"
    "CREATE INDEX t_name ON t(name);"
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000) "
    "INSERT INTO t SELECT x, printf('name-%08d', (x * 7919) % 20000), x * 3 FROM c;"
    "SELECT count(*), sum(val) FROM t;"
)
SQLITE_ARGS = ("-init", "/dev/null", ":memory:", SQLITE_SCRIPT)  # -init: no ~/.sqliterc
# The issue's options on top of the oracle's (which set --peak-inaccuracy=0.0): Massif's default peaks.
ISSUE = ("--detailed-freq=1", "--peak-inaccuracy=1.0")
MAX_SNAPSHOTS = 100  # Massif's default


def runs(
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
    program: Path,
    args: tuple[str, ...],
    options: tuple[str, ...],
) -> tuple[Completed, MassifFile, Completed, MassifFile]:
    ref = run_massif(program, args, options=(*options, "--stats=yes"))
    assert ref.returncode == 0, ref.stderr
    mine = run_heapscope(program, args, options=options)
    assert mine.returncode == 0, mine.stderr
    assert "NOT COUNTED" not in mine.stderr, mine.stderr
    return ref, parse_massif(ref.massif_text), mine, parse_massif(mine.massif_text)


# ---------------------------------------------------------------------------------------------------------
# --time-unit=B


@pytest.mark.parametrize("program", ["schedule.c", "sqlite3"])
def test_b_schedule_counts(
    program: str,
    build: Callable[..., Path],
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
    record_property: Callable[[str, object], None],
) -> None:
    exe, args = (SQLITE, SQLITE_ARGS) if program == "sqlite3" else (build(program), ())
    if not exe.exists():
        pytest.fail(f"{exe} is missing: scripts/apt-packages-dev.txt installs it")
    ref_run, ref, mine_run, mine = runs(run_massif, run_heapscope, exe, args, ISSUE)
    rs, ms = massif_schedule(ref_run), heapscope_schedule(mine_run)
    line = counts_line(program, ref, mine, rs, ms)
    record_property("counts", line)
    print(line)
    assert rs.cullings >= 3, f"the case must exercise Massif's culling: {line}"
    assert near(len(mine.snapshots), len(ref.snapshots)), line
    assert near(ms.taken, rs.taken) and near(ms.peaks, rs.peaks), line
    assert abs(ms.cullings - rs.cullings) <= 1, line
    if program == "schedule.c":  # the same calls, the same clock: the same schedule
        assert (ms.peaks, ms.cullings) == (rs.peaks, rs.cullings), line
        assert abs(ms.taken - rs.taken) <= 2, line


def test_b_totals_exact_at_the_snapshots(
    build: Callable[..., Path],
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
) -> None:
    exe = build("schedule.c")
    every = ("--max-snapshots=1000", "--detailed-freq=1000")
    _, ref_all, _, mine_all = runs(run_massif, run_heapscope, exe, (), (*ISSUE, *every))
    assert len(ref_all.snapshots) < 1000 and len(mine_all.snapshots) < 1000  # nothing culled
    # Every call's state, in order (peak snapshots repeat the state before a free: left out on both sides).
    ref_heap = [s.heap_B for s in ref_all.snapshots if s.heap_tree != "peak"]
    mine_states = [s for s in mine_all.snapshots if s.heap_tree != "peak"]
    assert [s.heap_B for s in mine_states] == ref_heap  # and nothing added at exit, as in Massif
    # The first calls land where Valgrind's allocator pads as the size model says: the same clock and extra.
    same = 0
    for a, b in zip(ref_all.snapshots, mine_all.snapshots, strict=False):
        if (a.time, a.heap_B) != (b.time, b.heap_B):
            break
        assert a.heap_extra_B == b.heap_extra_B
        same += 1
    assert same > 100

    _, _, _, mine = runs(run_massif, run_heapscope, exe, (), ISSUE)
    # Every snapshot, detailed or not, is a call's state: a peak snapshot's is the state before its free.
    states = {(s.time, s.heap_B, s.heap_extra_B) for s in mine_states}
    for s in mine.snapshots:
        assert (s.time, s.heap_B, s.heap_extra_B) in states, f"snapshot at {s.time} is no call's state"


# ---------------------------------------------------------------------------------------------------------
# --time-unit=ms


def test_ms_counts_of_a_sleeping_program(
    build: Callable[..., Path],
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
    record_property: Callable[[str, object], None],
) -> None:
    ref_run, ref, mine_run, mine = runs(run_massif, run_heapscope, build("paced.c"), (), ("--time-unit=ms", *ISSUE))
    rs, ms = massif_schedule(ref_run), heapscope_schedule(mine_run)
    line = counts_line("paced.c (ms)", ref, mine, rs, ms)
    record_property("counts", line)
    print(line)
    assert rs.cullings >= 2, line
    assert near(ms.taken, rs.taken) and ms.peaks == rs.peaks, line
    assert abs(ms.cullings - rs.cullings) <= 1, line
    for f in (ref, mine):
        assert MAX_SNAPSHOTS // 2 <= len(f.snapshots) <= MAX_SNAPSHOTS + 2, line


def test_ms_sqlite_within_massifs_culling_bounds(
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
    record_property: Callable[[str, object], None],
) -> None:
    if not SQLITE.exists():
        pytest.fail(f"{SQLITE} is missing: scripts/apt-packages-dev.txt installs it")
    ref_run, ref, mine_run, mine = runs(run_massif, run_heapscope, SQLITE, SQLITE_ARGS, ("--time-unit=ms", *ISSUE))
    rs, ms = massif_schedule(ref_run), heapscope_schedule(mine_run)
    line = counts_line("sqlite3 (ms; not comparable in count: Valgrind runs it far slower)", ref, mine, rs, ms)
    record_property("counts", line)
    print(line)
    for f, s in ((ref, rs), (mine, ms)):
        assert s.cullings >= 1, line
        # After a culling the array holds from half to all of --max-snapshots (and the peak).
        assert MAX_SNAPSHOTS // 2 <= len(f.snapshots) <= MAX_SNAPSHOTS + 2, line
    times = [s.time for s in mine.snapshots]
    assert times == sorted(times)
