"""Reading Massif's files and schedules for the comparisons with real Valgrind (test_oracle, test_depth,
test_aligned_extra, test_real_programs, test_schedule_massif, test_series_massif, test_modes): each snapshot as
bytes per root-to-node path of labels, the peak and final snapshots, the stacks of a program's own files, and the
schedule's counts from Massif's --stats=yes and heapscope's summary line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.support.massif_reader import MassifFile, parse_massif, paths

if TYPE_CHECKING:
    from tests.support.harness import Completed

# Massif's culling would drop states; with this many slots and fewer snapshots written, none was dropped.
MAX_SNAPSHOTS = 1000
NO_CULL = (f"--max-snapshots={MAX_SNAPSHOTS}",)

Paths = dict[tuple[str, ...], int]


# ---------------------------------------------------------------------------------------------------------
# Reading the files


@dataclass
class Snap:
    heap_B: int
    extra_B: int
    kind: str  # empty | detailed | peak
    tree: Paths  # non-zero paths; empty for an empty snapshot
    time: int = 0

    @property
    def total_B(self) -> int:
        return self.heap_B + self.extra_B


# Valgrind does not implement clone3, so under it glibc starts threads with clone instead: the bottom frame
# of a thread's stack is the one place where the program itself runs differently under Massif.
_VALGRIND_RUNS_CLONE = {"clone3 (clone3.S:81)": "clone (clone.S:100)"}


def _as_under_valgrind(path: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_VALGRIND_RUNS_CLONE.get(label, label) for label in path)


def read_snapshots(text: str, *, check: bool = True) -> list[Snap]:
    """Each snapshot of a massif.out with its tree as bytes per path. `check`: through the strict reader, which
    fails on anything ms_print would not read (heapscope's files); without it, line by line and about three times
    faster, for Valgrind's own files (a real program's run at --threshold=0.0 writes hundreds of megabytes)."""
    if not check:
        return _massifs_snapshots(text)
    parsed = parse_massif(text)
    out = []
    for s in parsed.snapshots:
        tree: Paths = {}
        if s.tree is not None:
            for p, b in paths(s.tree).items():
                if b != 0:
                    key = _as_under_valgrind(p)
                    tree[key] = tree.get(key, 0) + b
        out.append(Snap(s.heap_B, s.heap_extra_B, s.heap_tree, tree, s.time))
    return out


def _massifs_snapshots(text: str) -> list[Snap]:
    out: list[Snap] = []
    fields: dict[str, str] = {}
    tree: Paths = {}
    prefix: list[tuple[str, ...]] = [()]  # the path of the last node at each depth

    def close() -> None:
        if fields:
            kept = {p: b for p, b in tree.items() if b != 0}
            out.append(Snap(int(fields["mem_heap_B"]), int(fields["mem_heap_extra_B"]), fields["heap_tree"], kept,
                            int(fields["time"])))

    for line in text.split("\n"):
        body = line.lstrip(" ")
        if body[:1] == "n" and body[1:2].isdigit():  # a node: `n<children>: <bytes> <label>`, indented by depth
            depth = len(line) - len(body)
            nbytes, _, label = body.partition(": ")[2].partition(" ")
            if depth == 0:
                continue  # the root: not part of any path
            if label.startswith("0x"):
                label = label.partition(": ")[2]
            key = (*prefix[depth - 1], _VALGRIND_RUNS_CLONE.get(label, label))
            tree[key] = tree.get(key, 0) + int(nbytes)
            del prefix[depth:]
            prefix.append(key)
        elif line.startswith("snapshot="):
            close()
            fields, tree, prefix = {}, {}, [()]
            fields["snapshot"] = line[9:]
        elif "=" in line and fields:
            name, _, value = line.partition("=")
            fields[name] = value
    close()
    return out


def peak_of(snaps: list[Snap]) -> Snap | None:
    """The file's peak snapshot (None when it has none: Massif takes one only at a free)."""
    peaks = [s for s in snaps if s.kind == "peak"]
    assert len(peaks) <= 1, f"{len(peaks)} peak snapshots"
    if peaks:
        assert peaks[0].tree or peaks[0].heap_B == 0, "a peak snapshot without its tree"
    return peaks[0] if peaks else None


def reference_peak(snaps: list[Snap]) -> Snap:
    """Massif's peak snapshot, which the case must have."""
    peak = peak_of(snaps)
    assert peak is not None, "no peak snapshot"
    return peak


heapscope_peak = reference_peak  # heapscope's file marks Massif's peak


def final(snaps: list[Snap]) -> Snap:
    last = snaps[-1]
    assert last.kind != "empty", "the last snapshot (the state at exit) has no tree"
    return last


_FILE_LINE = re.compile(r"\(([^():]+):\d+\)$")


def label_file(label: str) -> str | None:
    m = _FILE_LINE.search(label)
    return m.group(1) if m else None


def leaf_stacks(tree: Paths) -> Paths:
    """Bytes held by each full stack (the bytes of a node not passed on to its children)."""
    passed_on: Paths = {}  # each node's children's bytes, summed in one pass (trees have thousands of paths)
    for p, b in tree.items():
        if len(p) > 1:
            passed_on[p[:-1]] = passed_on.get(p[:-1], 0) + b
    return {p: b - passed_on.get(p, 0) for p, b in tree.items() if b != passed_on.get(p, 0)}


def own_stacks(tree: Paths, own_files: frozenset[str]) -> Paths:
    """The full stacks whose every frame is in the program's own source files (root label excepted)."""
    out: Paths = {}
    for p, b in leaf_stacks(tree).items():
        frames = [lab for lab in p if not lab.startswith("(heap allocation functions)")]
        if frames and all(label_file(lab) in own_files for lab in frames):
            out[p] = b
    return out




# Massif's schedule, as its --stats=yes and heapscope's summary line count it

SCHEDULE_TOLERANCE = 0.25


@dataclass(frozen=True)
class Schedule:
    """What the schedule did: snapshots taken (peaks included), peak snapshots taken, cullings."""

    taken: int
    peaks: int
    cullings: int


def massif_schedule(run: Completed) -> Schedule:
    """From Massif's --stats=yes lines."""

    def stat(name: str) -> int:
        m = re.search(rf"Massif: {name}:\s+(\d+)", run.stderr)
        assert m, f"no '{name}' in Massif's statistics:\n{run.stderr[-2000:]}"
        return int(m.group(1))

    return Schedule(stat("real snapshots"), stat("peak snapshots"), stat("cullings"))


def heapscope_schedule(run: Completed) -> Schedule:
    """From heapscope's summary line."""
    m = re.search(r"snapshots: (\d+) taken on Massif's schedule \((\d+) at peaks\), (\d+) cullings", run.stderr)
    assert m, f"no schedule line in heapscope's summary:\n{run.stderr[-2000:]}"
    return Schedule(int(m.group(1)), int(m.group(2)), int(m.group(3)))


def near(mine: int, ref: int) -> bool:
    return abs(mine - ref) <= SCHEDULE_TOLERANCE * ref


def counts_line(name: str, ref: MassifFile, mine: MassifFile, rs: Schedule, ms: Schedule) -> str:
    return (
        f"{name}: snapshots in the file heapscope {len(mine.snapshots)}, Massif {len(ref.snapshots)}; taken "
        f"{ms.taken} / {rs.taken}, peaks {ms.peaks} / {rs.peaks}, cullings {ms.cullings} / {rs.cullings}"
    )
