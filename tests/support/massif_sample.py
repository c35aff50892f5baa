"""A small massif.out, written by heapscope's own writer, for the tests of what reads one."""

from __future__ import annotations

import io

from agent.export.massif import write_massif
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import Frame
from agent.model.tree import HeapTree

MAIN = Frame(0x400100, "main", "prog.c", 50)


def sample_massif_out() -> str:
    """A massif.out of 30 sites: an empty snapshot, a detailed one, the peak (twice the bytes), and a last one."""
    stacks = {(Frame(0x401000 + 16 * i, f"fn{i}", "prog.c", 100 + i), MAIN): 100 * (i + 1) ** 2 for i in range(30)}
    t1 = HeapTree.from_stacks(stacks)
    t2 = HeapTree.from_stacks({k: v * 2 for k, v in stacks.items()})
    snaps = [
        Snapshot(0, 0, 0, 0, None, SnapshotKind.NORMAL),
        Snapshot(10, t1.total, 240, 0, t1, SnapshotKind.DETAILED),
        Snapshot(20, t2.total, 480, 0, t2, SnapshotKind.PEAK),
        Snapshot(30, 77, 16, 0, None, SnapshotKind.NORMAL),
    ]
    out = io.StringIO()
    write_massif(out, snaps, desc=["--threshold=1.0"], cmd="./prog a b", time_unit="ms", threshold=1.0)
    return out.getvalue()
