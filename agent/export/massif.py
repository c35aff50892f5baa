"""massif.out writer: the file Valgrind's Massif writes (coregrind/m_xtree.c, VG_(XT_massif_print)).

Readers: `ms_print`, and massif-visualizer, whose parser is stricter (a `#-----------` line on each side of
`snapshot=N`, exactly one space after each header colon, a node's `n` at the column equal to its depth, a
label on every node). Pure: writes to the given text stream only.

ms_print dies on a node bigger than its snapshot's total (useful + extra + stacks). This cannot happen here:
a detailed snapshot's `mem_heap_B` is its tree's root (as Massif writes it), every node's bytes are capped by
its parent's, and negative counters are written as 0.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import TextIO

from agent.model.massif_tree import MassifNode, massif_tree
from agent.model.snapshot import TIME_UNITS, Snapshot, SnapshotKind

SNAPSHOT_RULE = "#-----------"


def _one_line(text: str) -> str:
    # A newline inside a label or an argument would end the record early for every reader.
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def write_header(out: TextIO, *, desc: Sequence[str], cmd: str, time_unit: str) -> None:
    """`desc:` (the profiler's arguments, or `(none)`), `cmd:` and `time_unit:` (i, ms or B)."""
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {', '.join(TIME_UNITS)}, got {time_unit!r}")
    args = [_one_line(a) for a in desc if a.strip()]
    out.write("desc: " + (" ".join(args) if args else "(none)") + "\n")
    out.write(f"cmd: {_one_line(cmd)}\n")
    out.write(f"time_unit: {time_unit}\n")


def _tree_lines(node: MassifNode, depth: int, cap: int) -> Iterator[str]:
    nbytes = min(max(node.bytes, 0), cap)
    yield f"{' ' * depth}n{len(node.children)}: {nbytes} {_one_line(node.label)}\n"
    for child in node.children:
        yield from _tree_lines(child, depth + 1, nbytes)


def write_snapshot(
    out: TextIO, snapshot: Snapshot, number: int, *, threshold: float, kind: SnapshotKind | None = None
) -> None:
    """One snapshot record. `kind` overrides the snapshot's own kind in the `heap_tree=` line (a detailed
    snapshot written as a peak or the reverse); a snapshot without a tree is always `empty`."""
    if snapshot.time < 0:
        raise ValueError(f"snapshot {number}: negative time {snapshot.time}")
    kind = kind or snapshot.kind
    extra = max(snapshot.heap_extra_B, 0)
    stacks = max(snapshot.stacks_B, 0)
    tree = None
    if snapshot.tree is not None:
        tree = massif_tree(snapshot.tree, threshold=threshold, extra_B=extra, stacks_B=stacks)
        heap = tree.bytes  # Massif writes the tree's total as mem_heap_B
        tree_kind = "peak" if kind is SnapshotKind.PEAK else "detailed"
    else:
        heap = max(snapshot.heap_B, 0)
        tree_kind = "empty"
    out.write(f"{SNAPSHOT_RULE}\nsnapshot={number}\n{SNAPSHOT_RULE}\n")
    out.write(f"time={int(snapshot.time)}\n")
    out.write(f"mem_heap_B={heap}\n")
    out.write(f"mem_heap_extra_B={extra}\n")
    out.write(f"mem_stacks_B={stacks}\n")
    out.write(f"heap_tree={tree_kind}\n")
    if tree is not None:
        out.writelines(_tree_lines(tree, 0, tree.bytes))


def write_massif(
    out: TextIO,
    snapshots: Sequence[Snapshot],
    *,
    desc: Sequence[str],
    cmd: str,
    time_unit: str,
    threshold: float,
) -> None:
    """A whole massif.out: header, then the snapshots numbered from 0 in the order given (time order).

    `desc` is the list of options shown as "Massif arguments" (Massif lists its own command-line options),
    `threshold` the --threshold percentage used to aggregate small tree nodes.
    """
    write_header(out, desc=desc, cmd=cmd, time_unit=time_unit)
    last_time = None
    for i, snap in enumerate(snapshots):
        if last_time is not None and snap.time < last_time:
            raise ValueError(f"snapshot {i}: time {snap.time} is before the previous snapshot's {last_time}")
        last_time = snap.time
        write_snapshot(out, snap, i, threshold=threshold)


def render_snapshot(snapshot: Snapshot, *, desc: Sequence[str], cmd: str, time_unit: str, threshold: float) -> str:
    """What Massif's monitor commands `snapshot` / `detailed_snapshot` write: a whole file (header and one
    snapshot numbered 0). Massif takes a fresh normal snapshot there, so it is `detailed` or `empty`, never
    `peak`."""
    buf = io.StringIO()
    write_header(buf, desc=desc, cmd=cmd, time_unit=time_unit)
    write_snapshot(buf, snapshot, 0, threshold=threshold, kind=SnapshotKind.DETAILED)
    return buf.getvalue()
