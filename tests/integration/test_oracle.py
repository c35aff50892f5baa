"""heapscope judged by real Valgrind Massif, ms_print and callgrind_annotate.

Each case compiles one program, runs it under `valgrind --tool=massif` and under `heapscope run` with the
same options, and compares:
- every snapshot's tree, one by one: with --detailed-freq=1 every snapshot is detailed, and with
  --max-snapshots=1000 (and fewer calls than that) neither tool culls, so each file holds the tree after every
  call and before every free that comes down from a new high, at its own instant; as bytes per root-to-node
  path of `function (file:line)` labels (addresses differ: Valgrind loads PIE binaries at 0x108000), with each
  snapshot's kind, mem_heap_B and mem_heap_extra_B (and time);
- the peak tree (Massif's peak snapshot: the last state before a free that beat every earlier one) and the final
  tree (the last snapshot), also restricted to the stacks made only of the program's own frames (files compiled
  into the program or its plugin);
- mem_heap_B and mem_heap_extra_B of the peak and final snapshots.

Every comparison is strict, also through libraries built without frame pointers (libc, libstdc++, the
loader): heapscope walks stacks with .eh_frame tables in the kernel.

Zero-byte paths are dropped on both sides: Massif keeps a node for a site whose blocks were all freed, which
says nothing about the heap's state.

The peak snapshot: Massif looks for a peak only when a block is freed. With --peak-inaccuracy=0.0 that is the
exact maximum whenever a free follows it, but a maximum reached after the last free (peak.c) or with no counted
free at all (--ignore-fn case) is never marked. heapscope's file marks Massif's; the exact maximum is in its
summary.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.kernel.links import uprobe_links_supported
from tests.support.annotate import annotate_inclusive
from tests.support.harness import DEBUG_FLAGS, OPTIMIZED_FLAGS, PROGRAMS, Completed
from tests.support.oracle import (
    MAX_SNAPSHOTS,
    NO_CULL,
    Snap,
    final,
    heapscope_peak,
    own_stacks,
    peak_of,
    read_snapshots,
    reference_peak,
)

pytestmark = pytest.mark.integration

def both_peaks(outcome: Outcome) -> tuple[Snap, Snap]:
    ref, got = peak_of(outcome.ref), peak_of(outcome.got)
    at = next((i for i, x in enumerate(outcome.ref) if x is ref), -1)
    if outcome.case.freeres_at_exit and at >= len(outcome.got):
        pytest.skip("Massif's peak snapshot is at a free Valgrind's freeres made at exit, after heapscope's series")
    assert (ref is None) == (got is None), f"a peak snapshot in one file only: Massif {ref}, heapscope {got}"
    if ref is None or got is None:
        pytest.skip("Massif took no peak snapshot (no counted free after a new high): neither file has one")
    return ref, got


def series_pairs(outcome: Outcome) -> list[tuple[int, Snap, Snap]]:
    """Massif's snapshots and heapscope's, one by one (with their index). Under Valgrind the program frees more at
    exit (freeres_at_exit): heapscope's series is then the start of Massif's."""
    ref, got = outcome.ref, outcome.got
    assert len(ref) < MAX_SNAPSHOTS, "Massif culled snapshots: the series are not every call's"
    if outcome.case.freeres_at_exit:
        assert len(got) <= len(ref), f"heapscope {len(got)} snapshots, Massif {len(ref)}"
    else:
        assert len(got) == len(ref), f"heapscope {len(got)} snapshots, Massif {len(ref)}"
    return list(zip(range(len(got)), ref, got, strict=False))


# ---------------------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    options: tuple[str, ...] = ()
    flags: tuple[str, ...] = DEBUG_FLAGS
    plugin: bool = False  # build plugin.c as a shared object and pass its path as the first argument
    # Valgrind runs __libc_freeres and __gnu_cxx::__freeres at exit, which free library memory (the
    # loader's tables, cached thread stacks' TLS, libstdc++'s emergency exception pool) that stays live in a
    # normal run. So the final state of the whole heap is not comparable there; only the program's own
    # stacks are.
    freeres_at_exit: bool = False
    # Massif's extra bytes for an aligned block depend on where Valgrind's own arena put it (aligned.c).
    extra_comparable: bool = True
    notes: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # set for heapscope's run


CASES = [
    Case("example", "example.c"),
    Case("sites", "sites.c"),
    Case("sites_depth2", "sites.c", options=("--depth=2",)),
    # -O2 -fomit-frame-pointer: only the kernel's .eh_frame walk finds the callers.
    Case("sites_O2", "sites.c", flags=OPTIMIZED_FLAGS),
    # The uprobes attached through perf events (kernels before 6.10), not uprobe_multi links: the same trees.
    Case("sites_O2_perf_events", "sites.c", flags=OPTIMIZED_FLAGS, env={"HEAPSCOPE_UPROBE_LINKS": "0"}),
    Case("allocfns", "allocfns.c"),
    Case("aligned", "aligned.c", extra_comparable=False),
    Case("peak", "peak.c"),
    Case("wrappers", "wrappers.c"),
    Case("wrappers_alloc_ignore", "wrappers.c", options=("--alloc-fn=xmalloc", "--ignore-fn=quiet_alloc")),
    # operator new (libstdc++, no frame pointer) calls malloc: a frame-pointer walk from there skips its
    # caller std::__new_allocator<T>::allocate, which is the program's own (inlined template) code.
    Case(
        "cxx",
        "cxx.cpp",
        freeres_at_exit=True,
    ),
    # strdup (libc) has no frame pointer: the walk from malloc skips strdup's caller `copy`.
    Case("strdup", "dup.c"),
    # start_thread and clone end the thread's stack; libc's calloc of the DTV runs inside pthread_create.
    # That DTV stays with glibc's cache of thread stacks after the join; Valgrind's freeres frees it.
    Case("thread", "threads.c", freeres_at_exit=True),
    # The loader's own allocations and the plugin's constructor run under dl_open_worker, _dl_catch_exception.
    Case("dlopen", "loader.c", plugin=True, freeres_at_exit=True),
]


@dataclass
class Outcome:
    case: Case
    ref: list[Snap]
    got: list[Snap]
    own_files: frozenset[str]
    ref_run: Completed
    got_run: Completed


def own_source_files(source: Path, *more: Path) -> frozenset[str]:
    """Base names of the program's sources and every header compiled into it (gcc -M): template code from
    libstdc++ headers is the program's own code, built with its flags."""
    names: set[str] = set()
    for src in (source, *more):
        compiler = "g++" if src.suffix == ".cpp" else "gcc"
        deps = subprocess.run([compiler, "-M", str(src)], capture_output=True, text=True, check=True).stdout
        for tok in deps.replace("\\\n", " ").split()[1:]:
            names.add(Path(tok).name)
    return frozenset(names)


@pytest.fixture(scope="session")
def _outcomes() -> dict[str, Outcome]:
    return {}


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def outcome(
    request: pytest.FixtureRequest,
    _outcomes: dict[str, Outcome],
    build: Callable[..., Path],
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
) -> Outcome:
    """Both runs of one case, made once per session and shared by the comparisons."""
    case: Case = request.param
    if case.name not in _outcomes:
        _outcomes[case.name] = _run_case(case, build, run_massif, run_heapscope)
    return _outcomes[case.name]


def _run_case(
    case: Case,
    build: Callable[..., Path],
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
) -> Outcome:
    program = build(case.source, case.flags)
    args: tuple[str, ...] = ()
    own = [PROGRAMS / case.source]
    if case.plugin:
        args = (str(build("plugin.c", case.flags, shared=True)),)
        own.append(PROGRAMS / "plugin.c")
    options = (*case.options, *NO_CULL)
    ref_run = run_massif(program, args, options)
    assert ref_run.returncode == 0, ref_run.stderr
    got_run = run_heapscope(program, args, options, env=case.env)
    assert got_run.returncode == ref_run.returncode, got_run.stderr
    return Outcome(
        case,
        read_snapshots(ref_run.massif_text, check=False),
        read_snapshots(got_run.massif_text),
        own_source_files(*own),
        ref_run,
        got_run,
    )


def _diff(ref: Mapping[tuple[str, ...], int], got: Mapping[tuple[str, ...], int]) -> str:
    lines = []
    for p in sorted(set(ref) | set(got)):
        if ref.get(p) != got.get(p):
            lines.append(f"  massif={ref.get(p)} heapscope={got.get(p)}  {' <- '.join(reversed(p))}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Trees


def test_attached_through(outcome: Outcome) -> None:
    """uprobe_multi links on this kernel (6.10+), perf events when asked for."""
    asked_perf = outcome.case.env.get("HEAPSCOPE_UPROBE_LINKS") == "0"
    # Before Linux 6.10 (no whole-process pid filter for links) perf events are the right fallback.
    expected = "perf events" if asked_perf or not uprobe_links_supported() else "uprobe_multi links"
    assert "probes attached to" in outcome.got_run.stderr
    assert f"({expected})" in outcome.got_run.stderr, outcome.got_run.stderr


def test_every_detailed_tree(outcome: Outcome) -> None:
    """Every snapshot, one by one: its kind and its tree (each at its own instant), its useful bytes, and its
    extra bytes and time where Valgrind's allocator pads as the size model says. Where Valgrind's freeres frees
    at exit, a peak snapshot there turns heapscope's last peak into the detailed one it is in Massif's file."""
    pairs = series_pairs(outcome)
    assert sum(1 for _, r, _ in pairs if r.kind != "empty") > 2, "too few trees to compare"
    last_peak = max((i for i, _, g in pairs if g.kind == "peak"), default=-1)
    for i, ref, got in pairs:
        where = f"snapshot {i} (Massif's time {ref.time}, heapscope's {got.time})"
        superseded = outcome.case.freeres_at_exit and i == last_peak and (ref.kind, got.kind) == ("detailed", "peak")
        assert got.kind == ref.kind or superseded, f"{where}: kind"
        assert got.tree == ref.tree, f"{where}: trees differ (bytes per path):\n" + _diff(ref.tree, got.tree)
        assert got.heap_B == ref.heap_B, f"{where}: mem_heap_B"
        if outcome.case.extra_comparable:
            assert (got.time, got.extra_B) == (ref.time, ref.extra_B), f"{where}: time, mem_heap_extra_B"


def test_peak_tree(outcome: Outcome) -> None:
    ref_peak, got_peak = both_peaks(outcome)
    ref, got = ref_peak.tree, got_peak.tree
    assert got == ref, "peak trees differ (bytes per path):\n" + _diff(ref, got)


def test_peak_own_stacks(outcome: Outcome) -> None:
    ref_peak, got_peak = both_peaks(outcome)
    ref = own_stacks(ref_peak.tree, outcome.own_files)
    got = own_stacks(got_peak.tree, outcome.own_files)
    assert ref, "the program has no stack of its own at the peak: the comparison would be empty"
    assert got == ref, "own stacks at the peak differ:\n" + _diff(ref, got)


def test_final_tree(outcome: Outcome) -> None:
    if outcome.case.freeres_at_exit:
        pytest.skip("Valgrind's __libc_freeres/__gnu_cxx::__freeres change the final state: own stacks only")
    ref, got = final(outcome.ref).tree, final(outcome.got).tree
    assert got == ref, "final trees differ (bytes per path):\n" + _diff(ref, got)


def test_final_own_stacks(outcome: Outcome) -> None:
    ref = own_stacks(final(outcome.ref).tree, outcome.own_files)
    got = own_stacks(final(outcome.got).tree, outcome.own_files)
    assert ref, "the program has no stack of its own at exit: the comparison would be empty"
    assert got == ref, "own stacks at exit differ:\n" + _diff(ref, got)


# ---------------------------------------------------------------------------------------------------------
# Totals


def test_peak_totals(outcome: Outcome) -> None:
    ref, got = both_peaks(outcome)
    if not outcome.case.extra_comparable:
        assert got.heap_B == ref.heap_B, "peak mem_heap_B"
        return
    assert (got.heap_B, got.extra_B) == (ref.heap_B, ref.extra_B), "peak mem_heap_B, mem_heap_extra_B"


def test_final_totals(outcome: Outcome) -> None:
    ref, got = final(outcome.ref), final(outcome.got)
    if outcome.case.freeres_at_exit:
        # Valgrind's freeres only frees: heapscope's end state holds at least Massif's.
        assert got.heap_B >= ref.heap_B
        assert got.heap_B > 0
        return
    if not outcome.case.extra_comparable:
        assert got.heap_B == ref.heap_B, "final mem_heap_B"
        return
    assert (got.heap_B, got.extra_B) == (ref.heap_B, ref.extra_B), "final mem_heap_B, mem_heap_extra_B"


def test_peak_snapshot_is_massifs_and_the_summary_has_the_exact_peak(
    build: Callable[..., Path], run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    """peak.c: Massif marks the first wave (the last state before a free beat the previous peak); the real
    maximum is the second wave, never freed. heapscope's file marks Massif's peak; its summary gives the real
    one, which is also the final state."""
    program = build("peak.c")
    ref = read_snapshots(run_massif(program, (), NO_CULL).massif_text)
    got_run = run_heapscope(program, (), NO_CULL)
    got = read_snapshots(got_run.massif_text)
    ref_peak, got_peak = peak_of(ref), peak_of(got)
    assert ref_peak is not None and got_peak is not None
    assert (got_peak.time, got_peak.heap_B, got_peak.tree) == (ref_peak.time, ref_peak.heap_B, ref_peak.tree)
    c = got_run.counters
    assert c["peak_heap"] == max(s.heap_B for s in ref) == final(got).heap_B > got_peak.heap_B


# ---------------------------------------------------------------------------------------------------------
# The readers: ms_print and callgrind_annotate


def _grouped(n: int) -> str:
    return f"{n:,}"


def test_ms_print_reads_heapscope_output(
    build: Callable[..., Path], run_massif: Callable[..., Completed], run_heapscope: Callable[..., Completed]
) -> None:
    program = build("example.c")
    ref = read_snapshots(run_massif(program).massif_text)
    run = run_heapscope(program)
    got = read_snapshots(run.massif_text)
    done = subprocess.run(["ms_print", str(run.massif_out)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    peak = reference_peak(ref)
    # The graph's y axis tops at the peak's useful bytes, and the peak's tree is printed with its bytes.
    assert re.search(rf"\b{re.escape(_grouped(peak.heap_B))}B\)? \(heap allocation functions\)", text), text
    # Every top-level site of the peak appears as an `->` line with its bytes, e.g. main (example.c:20).
    tops = {p[1]: b for p, b in heapscope_peak(got).tree.items() if len(p) == 2}
    assert tops
    for label, nbytes in tops.items():
        line = rf"->\d+\.\d+% \({re.escape(_grouped(nbytes))}B\) 0x[0-9A-F]+: {re.escape(label)}"
        assert re.search(line, text), f"{label} with {nbytes} B not in ms_print output"


XTREE_CASES = [("example.c", ()), ("sites.c", ()), ("wrappers.c", ("--alloc-fn=xmalloc",)), ("peak.c", ())]


@pytest.mark.parametrize(("source", "options"), XTREE_CASES, ids=[s for s, _ in XTREE_CASES])
def test_xtree_matches_valgrind(
    source: str,
    options: tuple[str, ...],
    build: Callable[..., Path],
    run_massif: Callable[..., Completed],
    run_heapscope: Callable[..., Completed],
) -> None:
    program = build(source)
    ref_run = run_massif(program, (), options, xtree=True)
    got_run = run_heapscope(program, (), options, xtree=True)
    assert ref_run.xtree_out is not None and got_run.xtree_out is not None
    assert got_run.xtree_out.exists(), f"heapscope wrote no xtree file; stderr:\n{got_run.stderr}"
    ref = annotate_inclusive(ref_run.xtree_out)
    got = annotate_inclusive(got_run.xtree_out)
    # curB, totB, totFdB per function, inclusive. Valgrind books a free on the stack that frees the block.
    pick = {k: (v[0], v[2], v[4]) for k, v in ref.items() if k[0] == source}
    mine = {k: (v[0], v[2], v[4]) for k, v in got.items() if k[0] == source}
    assert mine == pick, f"(curB, totB, totFdB) per function differ:\nvalgrind  {pick}\nheapscope {mine}"
    # main's inclusive current bytes are the whole heap at exit: the final snapshot's useful bytes.
    final_heap = final(read_snapshots(got_run.massif_text)).heap_B
    assert got[(source, "main")][0] == final_heap
