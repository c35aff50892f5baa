"""heapscope judged by real Valgrind Massif on programs no one here wrote: Debian's own binaries.

- sqlite3 (C, libsqlite3): an in-memory database built and queried by an SQL script given on the command line;
- python3 (Debian's /usr/bin/python3, not the virtualenv's): `-c` with PYTHONHASHSEED=0, so that dict and set
  layouts, and the allocations that follow from them, are the same in both runs;
- troff (C++, groff-base): typesets a document the test writes. groff-base is installed on nearly every Debian
  system (man uses it); troff builds its nodes with operator new, its static constructors allocate, and its
  output depends only on the input and groff's font files, so both runs make the same calls.

Both tools run with Massif's options (`--run-libc-freeres=no --run-cxx-freeres=no`, so that Valgrind frees
nothing at exit that a native run keeps) and the same environment. Valgrind gives its client five variables of
its own (Debian's wrapper: LD_LIBRARY_PATH=/usr/lib/debug, GLIBCXX_FORCE_NEW, GLIBCPP_FORCE_NEW; the launcher:
LD_PRELOAD, PWD): the native run gets the same names, with the same values but LD_PRELOAD's (empty there),
since a program that copies its environment (python3's os.environ) allocates by their number.

The peak tree, the final tree and every detailed tree both files kept (kept_by_both: both tools cull these
programs' thousands of calls, each its own set) are compared as bytes per path of `function (file:line)` labels
(tests/integration/test_oracle.py), strictly, with one rewriting of Massif's side, named and bounded here:

Valgrind's unwinder, once past a process's entry point (the loader's start code, or `_start` in the executable,
which the stacks of static constructors reach: they run from `__libc_start_main@@GLIBC_2.34`, a name Valgrind
does not take for below main), falls back to taking the words at the stack pointer for return addresses: it
reads the initial stack (argc, argv's pointers) until a 0 or 1. Those frames are bare `???` (no object holds
such an address); no call made them. They are taken off the outer end of Massif's stacks, and only there: the
frame they follow must be in the executable or the loader.
"""

from __future__ import annotations

import bisect
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.capability import unavailable
from tests.support.harness import ORACLE_OPTIONS, RUN_TIMEOUT, Completed
from tests.support.massif_reader import parse_massif
from tests.support.oracle import (
    NO_CULL,
    Paths,
    Snap,
    counts_line,
    heapscope_peak,
    heapscope_schedule,
    leaf_stacks,
    massif_schedule,
    near,
    read_snapshots,
    reference_peak,
)

pytestmark = pytest.mark.integration

FREERES = ("--run-libc-freeres=no", "--run-cxx-freeres=no")
PYTHON = "/usr/bin/python3"  # Debian's interpreter: the virtualenv's is another binary
LOADER = "ld-linux-x86-64.so.2"
BARE = "???"
# What Debian's valgrind wrapper adds to the client's environment (LD_LIBRARY_PATH when it was unset).
VALGRIND_ENV = {"LD_LIBRARY_PATH": "/usr/lib/debug", "GLIBCXX_FORCE_NEW": "1", "GLIBCPP_FORCE_NEW": "1"}

SQL = (
    "CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL); "
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 500) "
    "INSERT INTO t SELECT x, printf('name-%05d', x * 7919 % 500), x * 0.5 FROM c; "
    "CREATE INDEX tn ON t(name); "
    "SELECT count(*), sum(v), max(name) FROM t WHERE name > 'name-00250';"
)
PY_CODE = (
    "import json; d = {f'k{i}': [i] * (i % 7) for i in range(5000)}; "
    "s = json.dumps(sorted(d.items())[:2000]); print(len(s))"
)


def troff_document(path: Path) -> Path:
    lines = [".ll 6i", ".ds T real programs", ".de P", ".sp", ".."]
    for i in range(100):
        words = " ".join(f"word{(i * 31 + j) % 97}" for j in range(25))
        lines += [".P", f"Paragraph {i} of \\*T: {words}"]
        if i % 50 == 0:
            lines.append(f".nr n{i} {i * 3}")
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True)
class RealProgram:
    name: str
    argv: Callable[[Path], list[str]]  # given a scratch directory
    package: str
    env: dict[str, str] = field(default_factory=dict)


PROGRAMS = [
    RealProgram("sqlite3", lambda _: ["/usr/bin/sqlite3", "-init", "/dev/null", ":memory:", SQL], "sqlite3"),
    RealProgram("python3", lambda _: [PYTHON, "-c", PY_CODE], "python3", {"PYTHONHASHSEED": "0"}),
    RealProgram("troff", lambda d: ["/usr/bin/troff", "-Tutf8", str(troff_document(d / "doc.tr"))], "groff-base"),
]


@dataclass
class Runs:
    ref: list[Snap]
    got: list[Snap]
    stderr: str


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=cwd, env=env, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    return done


@pytest.fixture(scope="module")
def runs(heapscope_cmd: list[str], valgrind_tools: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Runs]:
    return {}


def run_both(
    prog: RealProgram,
    heapscope_cmd: list[str],
    tmp_path_factory: pytest.TempPathFactory,
    options: tuple[str, ...],
    massif_only: tuple[str, ...] = (),
) -> tuple[Completed, Completed]:
    """The program under Massif (with `massif_only` too) and under `heapscope run`, with the same options."""
    argv = prog.argv(tmp_path_factory.mktemp(prog.name))
    if not os.path.exists(argv[0]):
        unavailable(f"{argv[0]} is missing: install Debian's {prog.package} (scripts/apt-packages-dev.txt)")
    work = tmp_path_factory.mktemp(f"{prog.name}-runs")
    # One environment for both runs (see the module docstring): what the program reads of it shapes its
    # allocations.
    env = {k: v for k, v in os.environ.items() if k not in VALGRIND_ENV and k != "LD_PRELOAD"}
    env |= {"LC_ALL": "C", "PWD": str(work), **prog.env}
    native_env = {**env, **VALGRIND_ENV, "LD_PRELOAD": ""}
    ref_out, got_out = work / "massif.ref", work / "massif.got"
    massif = ["valgrind", "-q", "--tool=massif", *options, *massif_only, *FREERES, f"--massif-out-file={ref_out}"]
    ref = _run([*massif, *argv], work, env)
    assert ref.returncode == 0, ref.stderr
    got = _run([*heapscope_cmd, "run", *options, f"--massif-out-file={got_out}", "--", *argv], work, native_env)
    assert got.returncode == 0, got.stderr
    assert got.stdout == ref.stdout, "the program did not do the same work in both runs"
    return (Completed(ref.returncode, ref.stdout, ref.stderr, ref_out, None),
            Completed(got.returncode, got.stdout, got.stderr, got_out, None))


@pytest.fixture(params=PROGRAMS, ids=[p.name for p in PROGRAMS])
def outcome(request: pytest.FixtureRequest, runs: dict[str, Runs], heapscope_cmd: list[str], tmp_path_factory) -> Runs:  # type: ignore[no-untyped-def]
    prog: RealProgram = request.param
    if prog.name in runs:
        return runs[prog.name]
    ref, got = run_both(prog, heapscope_cmd, tmp_path_factory, (*ORACLE_OPTIONS, *NO_CULL))
    runs[prog.name] = Runs(read_snapshots(ref.massif_text, check=False), read_snapshots(got.massif_text), got.stderr)
    return runs[prog.name]


def without_walk_past_entry(tree: Paths) -> Paths:
    """Massif's tree with the bare `???` frames its unwinder reads past the entry point taken off the outer end
    of each stack (see the module docstring); the frame before them must be in the executable or the loader."""
    out: Paths = {}
    for stack, nbytes in leaf_stacks(tree).items():
        end = len(stack)
        while end > 1 and stack[end - 1] == BARE:
            end -= 1
        if end < len(stack):
            entry = stack[end - 1]
            assert entry.startswith("??? (in /usr/bin/") or LOADER in entry, f"bare frames after {entry}: {stack}"
        for i in range(1, end + 1):
            out[stack[:i]] = out.get(stack[:i], 0) + nbytes
    return out


def _diff(ref: Paths, got: Paths) -> str:
    lines = [
        f"  massif={ref.get(p)} heapscope={got.get(p)}  {' <- '.join(p)}"
        for p in sorted(set(ref) | set(got))
        if ref.get(p) != got.get(p)
    ]
    return "\n".join(lines[:40])


def test_peak_tree(outcome: Runs) -> None:
    ref_peak, got_peak = reference_peak(outcome.ref), heapscope_peak(outcome.got)
    ref, got = without_walk_past_entry(ref_peak.tree), without_walk_past_entry(got_peak.tree)
    assert got == ref, "peak trees differ (bytes per path):\n" + _diff(ref, got)
    assert got_peak.heap_B == ref_peak.heap_B
    assert len(got) > 20, "a real program's peak should have more to compare than this"


DRIFT_SPAN = 32  # B: less than two calls move the clock


def kept_by_both(ref: list[Snap], got: list[Snap]) -> list[tuple[int, Snap, Snap]]:
    """The snapshots both files kept, paired (with Massif's index). Both series are taken at the same calls, but
    a real program calls the allocator thousands of times, so both tools cull, and the B clocks drift apart
    (Valgrind's allocator pads some reused blocks more than the size model says): each file keeps a set of its
    own. A call's state has the same useful bytes and kind in both, at times that differ by the drift, which
    moves one way only (Valgrind's slop is never below the model's, or never above).

    So: anchors first, states whose useful bytes no other snapshot of either file has within 2% of their time,
    kept as the longest chain that runs forward in both files with the drift moving one way. Between two anchors
    whose drifts differ by DRIFT_SPAN or less, a call's state is then in heapscope's file at Massif's time plus a
    drift in that span: each of Massif's snapshots there is paired with heapscope's that has its useful bytes and
    kind at such a time, when exactly one does and no other of Massif's does. Two calls' states with equal useful
    bytes are further apart than that (each call moves the clock by 24 B at least: 1 B, 15 B of slop, 8 B of
    admin), so a pair is one call's state in both files."""
    by_key: tuple[dict[tuple[int, str], list[int]], dict[tuple[int, str], list[int]]] = ({}, {})
    for table, snaps in zip(by_key, (ref, got), strict=True):
        for k, x in enumerate(snaps):
            table.setdefault((x.heap_B, x.kind), []).append(k)

    def within(snaps: list[Snap], table: dict[tuple[int, str], list[int]], r: Snap, lo: int, hi: int) -> list[int]:
        return [k for k in table.get((r.heap_B, r.kind), []) if lo <= snaps[k].time <= hi]

    anchors = []
    for i, r in enumerate(ref):
        w = r.time // 50 + 4096
        gs = within(got, by_key[1], r, r.time - w, r.time + w)
        if len(gs) == 1 and len(within(ref, by_key[0], r, r.time - 2 * w, r.time + 2 * w)) == 1:
            anchors.append((i, gs[0], got[gs[0]].time - r.time))
    chain: list[tuple[int, int, int]] = []
    for sign in (1, -1):
        length, prev = [1] * len(anchors), [-1] * len(anchors)
        for b, (_, jb, ob) in enumerate(anchors):
            for a in range(b):
                _, ja, oa = anchors[a]
                if ja < jb and sign * (ob - oa) >= 0 and length[a] + 1 > length[b]:
                    length[b], prev[b] = length[a] + 1, a
        b = max(range(len(anchors)), key=length.__getitem__, default=-1)
        run = []
        while b >= 0:
            run.append(anchors[b])
            b = prev[b]
        if len(run) > len(chain):
            chain = run[::-1]
    at = [ref[i].time for i, _, _ in chain]
    pairs = []
    for i, r in enumerate(ref):
        p = bisect.bisect_right(at, r.time)
        lo, hi = sorted((chain[max(p - 1, 0)][2], chain[min(p, len(chain) - 1)][2]))
        if hi - lo > DRIFT_SPAN:
            continue
        gs = within(got, by_key[1], r, r.time + lo, r.time + hi)
        if len(gs) == 1 and len(within(ref, by_key[0], r, r.time - (hi - lo), r.time + (hi - lo))) == 1:
            pairs.append((i, r, got[gs[0]]))
    return pairs


def test_every_detailed_tree(outcome: Runs) -> None:
    """Every detailed snapshot both tools kept (--detailed-freq=1: all of them), each at its own instant: the same
    tree, strictly (see kept_by_both for which ones both kept)."""
    pairs = kept_by_both(outcome.ref, outcome.got)
    # Most are paired: the others were culled from one file, or share their useful bytes with a neighbour.
    assert len(pairs) > len(outcome.ref) // 2, f"{len(pairs)} paired of {len(outcome.ref)} and {len(outcome.got)}"
    for i, r, g in pairs:
        where = f"Massif's snapshot {i} (time {r.time}; heapscope's {g.time})"
        rt, gt = without_walk_past_entry(r.tree), without_walk_past_entry(g.tree)
        assert gt == rt, f"{where}: trees differ (bytes per path):\n" + _diff(rt, gt)


def test_final_tree(outcome: Runs) -> None:
    """The state at exit: with freeres off, both tools see the program's own end state."""
    ref_end, got_end = outcome.ref[-1], outcome.got[-1]
    assert ref_end.kind != "empty" and got_end.kind != "empty", "the last snapshot has no tree"
    ref, got = without_walk_past_entry(ref_end.tree), without_walk_past_entry(got_end.tree)
    assert got == ref, "final trees differ (bytes per path):\n" + _diff(ref, got)
    assert got_end.heap_B == ref_end.heap_B


@pytest.mark.parametrize("prog", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_snapshot_count(
    prog: RealProgram,
    heapscope_cmd: list[str],
    valgrind_tools: None,
    tmp_path_factory: pytest.TempPathFactory,
    record_property: Callable[[str, object], None],
) -> None:
    """Snapshots on Massif's schedule: under `--time-unit=B --detailed-freq=1` and Massif's defaults otherwise
    (--max-snapshots=100, --peak-inaccuracy=1.0), heapscope writes as many snapshots as Massif, within 25%, and
    its schedule took as many (peaks included; Massif's --stats=yes against heapscope's summary line)."""
    options = (*ORACLE_OPTIONS, "--peak-inaccuracy=1.0")
    ref, got = run_both(prog, heapscope_cmd, tmp_path_factory, options, massif_only=("--stats=yes",))
    ref_file, got_file = parse_massif(ref.massif_text), parse_massif(got.massif_text)
    rs, gs = massif_schedule(ref), heapscope_schedule(got)
    line = counts_line(prog.name, ref_file, got_file, rs, gs)
    record_property("counts", line)
    print(line)
    assert rs.taken > len(ref_file.snapshots), f"Massif's culling must be part of the case: {line}"
    assert near(len(got_file.snapshots), len(ref_file.snapshots)), line
    assert near(gs.taken, rs.taken) and near(gs.peaks, rs.peaks), line
