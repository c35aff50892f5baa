"""The massif.out writer: exact layout, the strict (massif-visualizer) grammar, and the real ms_print reading
what it writes from synthetic stacks."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.export.massif import render_snapshot, write_massif
from agent.model.snapshot import Snapshot, SnapshotKind, SnapshotSeries
from agent.model.stack import Frame, Stack
from agent.model.tree import HeapTree
from tests.support.massif_reader import (
    MassifFormatError,
    parse_massif,
    paths,
    read_massif,
    stacks_from_tree,
)

MAIN20 = Frame(0x10918A, "main", "ex.c", 20)
G5 = Frame(0x109156, "g", "ex.c", 5)
F11 = Frame(0x10916C, "f", "ex.c", 11)
F10 = Frame(0x109167, "f", "ex.c", 10)
MAIN23 = Frame(0x1091A6, "main", "ex.c", 23)
MAIN25 = Frame(0x1091AB, "main", "ex.c", 25)
LIB = Frame(0x484B120, "nodbg_alloc", obj="/tmp/libnd.so")
UNKNOWN = Frame(0x4000, None)

# The manual's example at its peak, plus a frame without debug info and an unknown one.
PEAK_STACKS: dict[Stack, int] = {
    (MAIN20,): 10000,
    (G5, F11, MAIN23): 4000,
    (F10, MAIN23): 2000,
    (G5, MAIN25): 4000,
    (LIB, MAIN25): 500,
    (UNKNOWN,): 150,
}


def example_series(threshold_sites: bool = False) -> list[Snapshot]:
    s = SnapshotSeries(detailed_freq=3, max_snapshots=10)
    t = 0
    for i in range(1, 8):
        t += 1016
        kind = s.next_kind(t)
        assert kind is not None
        tree = HeapTree.from_stacks({(MAIN20,): 1000 * i}) if kind is SnapshotKind.DETAILED else None
        s.add(t, 1000 * i, 16 * i, 0, tree)
    s.set_peak(t, 20650, 200, 0, HeapTree.from_stacks(PEAK_STACKS))
    s.finish(t + 5000, 10650, 100, 0, HeapTree.from_stacks({**PEAK_STACKS, (MAIN20,): 0}))
    return s.snapshots


def write(snapshots: list[Snapshot], threshold: float = 1.0, time_unit: str = "B", desc=("--x",)) -> str:
    buf = io.StringIO()
    write_massif(buf, snapshots, desc=list(desc), cmd="./ex arg", time_unit=time_unit, threshold=threshold)
    return buf.getvalue()


def ms_print(path: Path, *args: str) -> str:
    res = subprocess.run(["ms_print", *args, str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_layout_is_massifs() -> None:
    text = write(example_series(), threshold=0.0)
    lines = text.splitlines()
    assert lines[:3] == ["desc: --x", "cmd: ./ex arg", "time_unit: B"]
    assert lines[3:12] == [
        "#-----------",
        "snapshot=0",
        "#-----------",
        "time=1016",
        "mem_heap_B=1000",
        "mem_heap_extra_B=16",
        "mem_stacks_B=0",
        "heap_tree=empty",
        "#-----------",
    ]
    peak_at = lines.index("heap_tree=peak")
    assert lines[peak_at - 6 : peak_at] == [
        "snapshot=7",
        "#-----------",
        "time=7112",
        "mem_heap_B=20650",
        "mem_heap_extra_B=200",
        "mem_stacks_B=0",
    ]
    assert lines[peak_at + 1 : peak_at + 6] == [
        "n5: 20650 (heap allocation functions) malloc/new/new[], --alloc-fns, etc.",
        " n0: 10000 0x10918A: main (ex.c:20)",
        " n2: 8000 0x109156: g (ex.c:5)",
        "  n1: 4000 0x10916C: f (ex.c:11)",
        "   n0: 4000 0x1091A6: main (ex.c:23)",
    ]
    assert " n1: 500 0x484B120: nodbg_alloc (in /tmp/libnd.so)" in lines
    assert " n0: 150 0x4000: ???" in lines
    assert text.endswith("\n")


def test_desc_none_and_sanitised_header() -> None:
    text = write(example_series(), desc=())
    assert text.startswith("desc: (none)\ncmd: ./ex arg\n")
    buf = io.StringIO()
    write_massif(buf, [], desc=["a\nb"], cmd="x\ny", time_unit="ms", threshold=1.0)
    assert buf.getvalue() == "desc: a b\ncmd: x y\ntime_unit: ms\n"


@pytest.mark.parametrize("unit", ["i", "ms", "B"])
def test_time_units_accepted(unit: str) -> None:
    assert parse_massif(write(example_series(), time_unit=unit)).time_unit == unit


def test_bad_time_unit_and_backwards_time_rejected() -> None:
    with pytest.raises(ValueError, match="time_unit"):
        write(example_series(), time_unit="s")
    a = Snapshot(10, 1, 0, 0, None, SnapshotKind.NORMAL)
    b = Snapshot(5, 1, 0, 0, None, SnapshotKind.NORMAL)
    with pytest.raises(ValueError, match="before"):
        write([a, b])


def test_strict_grammar_and_round_trip() -> None:
    snaps = example_series()
    parsed = parse_massif(write(snaps, threshold=0.0))  # strict by default: the visualizer's grammar
    assert [s.heap_tree for s in parsed.snapshots] == [
        "empty" if s.tree is None else ("peak" if s.kind is SnapshotKind.PEAK else "detailed") for s in snaps
    ]
    peak = parsed.peak
    assert peak is not None and peak.tree is not None
    got = stacks_from_tree(peak.tree)
    assert {tuple(f.label for f in k): v for k, v in got.items()} == {
        tuple(f.label for f in k): v for k, v in PEAK_STACKS.items()
    }
    assert paths(peak.tree)[("g (ex.c:5)", "main (ex.c:25)")] == 4000


def test_reader_rejects_what_the_visualizer_rejects() -> None:
    good = write(example_series(), threshold=0.0)
    with pytest.raises(MassifFormatError, match="one space"):
        parse_massif(good.replace("cmd: ", "cmd:  ", 1))
    with pytest.raises(MassifFormatError, match="#-----------"):
        parse_massif(good.replace("#-----------\nsnapshot=1\n", "snapshot=1\n", 1))
    with pytest.raises(MassifFormatError, match="column"):
        parse_massif(good.replace("\n  n1: 4000 0x10916C", "\n n1: 4000 0x10916C", 1))
    with pytest.raises(MassifFormatError):
        parse_massif(re.sub(r"\n n0: 150 0x4000: \?\?\?", "\n n0: 150", good, count=1))
    with pytest.raises(MassifFormatError, match="bigger"):
        parse_massif(good.replace(" n0: 150 0x4000", " n0: 999999 0x4000", 1))
    parse_massif(good.replace("cmd: ", "cmd:  ", 1), strict=False)  # ms_print itself tolerates that one


def inconsistent_tree() -> tuple[HeapTree, str]:
    """A corrupted tree (a child far bigger than the root) after a snapshot of negative sizes, and its file."""
    tree = HeapTree.from_stacks(PEAK_STACKS)
    tree.children[G5.label].bytes = 10**9
    snap = Snapshot(1, -5, -3, 0, None, SnapshotKind.NORMAL)
    return tree, write([snap, Snapshot(2, 1, 0, 0, tree, SnapshotKind.DETAILED)], threshold=0.0)


def test_node_never_exceeds_total_even_from_an_inconsistent_tree() -> None:
    tree, text = inconsistent_tree()
    parsed = parse_massif(text)  # strict: checks node <= total
    assert parsed.snapshots[0].heap_B == 0 and parsed.snapshots[0].heap_extra_B == 0
    detailed = parsed.snapshots[1]
    assert detailed.tree is not None and detailed.heap_B == tree.total
    assert max(n.bytes for n in detailed.tree.walk()) == tree.total


@pytest.mark.needs("ms_print")
def test_ms_print_reads_the_file_of_an_inconsistent_tree(tmp_path: Path) -> None:
    path = tmp_path / "m.out"
    path.write_text(inconsistent_tree()[1])
    ms_print(path)


def test_render_snapshot_is_a_whole_file() -> None:
    snap = Snapshot(42, 20650, 200, 0, HeapTree.from_stacks(PEAK_STACKS), SnapshotKind.PEAK)
    text = render_snapshot(snap, desc=["--threshold=0.0"], cmd="./ex", time_unit="ms", threshold=0.0)
    parsed = parse_massif(text)
    assert (parsed.desc, parsed.cmd, parsed.time_unit) == ("--threshold=0.0", "./ex", "ms")
    assert len(parsed.snapshots) == 1
    only = parsed.snapshots[0]
    assert only.number == 0 and only.heap_tree == "detailed" and only.time == 42  # never "peak"
    plain = render_snapshot(
        Snapshot(42, 5, 1, 0, None, SnapshotKind.NORMAL), desc=[], cmd="x", time_unit="B", threshold=1.0
    )
    assert parse_massif(plain).snapshots[0].heap_tree == "empty"


@pytest.mark.needs("ms_print")
def test_ms_print_reads_it_and_reports_the_sites(tmp_path: Path) -> None:
    path = tmp_path / "massif.out"
    path.write_text(write(example_series(), threshold=1.0))
    out = ms_print(path)
    assert "Command:            ./ex arg" in out
    assert re.search(r"Detailed snapshots: \[2, 5, 7 \(peak\), 8\]", out), out
    # Percentages are of useful + extra + stacks at the peak: 20,650 + 200.
    assert "->47.96% (10,000B) 0x10918A: main (ex.c:20)" in out
    assert "->38.37% (8,000B) 0x109156: g (ex.c:5)" in out
    assert "| ->19.18% (4,000B) 0x10916C: f (ex.c:11)" in out
    assert "->02.40% (500B) 0x484B120: nodbg_alloc (in /tmp/libnd.so)" in out
    # The last snapshot: main:20 freed to 0 B is below ms_print's threshold.
    assert "in 1+ places, all below ms_print's threshold (01.00%)" in out


@pytest.mark.needs("ms_print")
@pytest.mark.parametrize(("unit", "column"), [("i", "time(i)"), ("ms", "time(ms)"), ("B", "time(B)")])
def test_ms_print_time_units(tmp_path: Path, unit: str, column: str) -> None:
    path = tmp_path / "massif.out"
    path.write_text(write(example_series(), time_unit=unit))
    assert column in ms_print(path)


@pytest.mark.needs("ms_print")
def test_ms_print_threshold_aggregation_line(tmp_path: Path) -> None:
    main = Frame(0x99, "main", "t.c", 1)
    stacks: dict[Stack, int] = {(Frame(0x10 + i, f"s{i}", "t.c", i + 2), main): b for i, b in enumerate([9000, 80, 60])}
    snap = Snapshot(1, 9140, 860, 0, HeapTree.from_stacks(stacks), SnapshotKind.DETAILED)
    path = tmp_path / "massif.out"
    path.write_text(write([snap], threshold=1.0))
    out = ms_print(path, "--threshold=0.0")
    # Massif's own aggregated node, shown by ms_print as a node like any other.
    assert "->01.40% (140B) in 2 places, all below massif's threshold (1.00%)" in out
    assert "->90.00% (9,000B) 0x10: s0 (t.c:2)" in out


@pytest.mark.needs("valgrind", "gcc")
def test_reader_accepts_valgrinds_own_file(tmp_path: Path) -> None:
    src = tmp_path / "p.c"
    src.write_text(
        "#include <stdlib.h>\nvoid *k[50];\nint main(void){for(int i=0;i<40;i++)k[i]=malloc(10+i);"
        "free(k[3]);return 0;}\n"
    )
    subprocess.run(["gcc", "-g", "-o", str(tmp_path / "p"), str(src)], check=True)
    out = tmp_path / "ref.out"
    subprocess.run(
        ["valgrind", "--tool=massif", "--time-unit=B", f"--massif-out-file={out}", str(tmp_path / "p")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    ref = read_massif(out)
    assert ref.time_unit == "B" and ref.cmd.endswith("/p")
    assert ref.peak is not None and ref.last_detailed is not None
    # Our writer given Valgrind's peak stacks writes Valgrind's peak tree, byte for byte (addresses too).
    assert ref.peak.tree is not None
    snap = Snapshot(
        ref.peak.time,
        ref.peak.heap_B,
        ref.peak.heap_extra_B,
        0,
        HeapTree.from_stacks(stacks_from_tree(ref.peak.tree)),
        SnapshotKind.PEAK,
    )
    mine = parse_massif(write([snap], threshold=1.0)).snapshots[0]
    assert mine.tree is not None
    assert paths(mine.tree) == paths(ref.peak.tree)
