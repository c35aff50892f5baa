"""Reading a massif.out file (Valgrind's Massif or heapscope wrote it) back into model snapshots.

The grammar is Massif's (massif/ms_main.c, pp_snapshot): a header (`desc:`, `cmd:`, `time_unit:`), then per
snapshot `snapshot=N`, `time=`, `mem_heap_B=`, `mem_heap_extra_B=`, `mem_stacks_B=`, `heap_tree=` and, for
detailed and peak snapshots, the tree: one node a line, `n<children>: <bytes> <label>`, children after their
parent. The reader is lenient where ms_print is (spacing, indentation) and strict where a mistake would change
the figures (a missing field, a child count that does not match). Pure: it takes text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.errors import UsageError
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import Frame
from agent.model.tree import HeapNode, HeapTree

_FILE_LINE = re.compile(r"^0x([0-9A-Fa-f]+): (.*) \(([^()]*):(\d+)\)$")
_IN_OBJ = re.compile(r"^0x([0-9A-Fa-f]+): (.*) \(in (.*)\)$")
_BARE = re.compile(r"^0x([0-9A-Fa-f]+): ?(.*)$")
_FIELDS = ("time", "mem_heap_B", "mem_heap_extra_B", "mem_stacks_B", "heap_tree")
_KINDS = {"empty": SnapshotKind.NORMAL, "detailed": SnapshotKind.DETAILED, "peak": SnapshotKind.PEAK}


class MassifFileError(UsageError):
    """The text is not a massif.out file; the message says where."""


@dataclass(frozen=True)
class MassifFile:
    desc: str
    cmd: str
    time_unit: str
    snapshots: list[Snapshot]


def parse_label(label: str) -> Frame:
    """A tree label back into a Frame: `0xADDR: fn (file:line)`, `0xADDR: fn (in /obj)`, `0xADDR: fn` or
    `0xADDR: ???`. Anything else (Massif's `in N places, ...below massif's threshold`) is a Frame at address 0
    whose function is the label."""
    m = _FILE_LINE.match(label)
    if m:
        return Frame(int(m[1], 16), _fn(m[2]), m[3], int(m[4]))
    m = _IN_OBJ.match(label)
    if m:
        return Frame(int(m[1], 16), _fn(m[2]), obj=m[3])
    m = _BARE.match(label)
    if m:
        return Frame(int(m[1], 16), _fn(m[2]))
    return Frame(0, label)


def _fn(text: str) -> str | None:
    return None if text in ("???", "") else text


class _Lines:
    def __init__(self, text: str, name: str) -> None:
        self.lines = text.splitlines()
        self.name = name
        self.i = 0

    def error(self, what: str) -> MassifFileError:
        return MassifFileError(f"{self.name}:{self.i}: {what}")

    def next(self) -> str | None:
        """The next line that is not a `#` rule or blank, or None at the end."""
        while self.i < len(self.lines):
            line = self.lines[self.i]
            self.i += 1
            if line.strip() and not line.startswith("#"):
                return line
        return None

    def field(self, key: str) -> str:
        line = self.next()
        if line is None:
            raise self.error(f"the file ends where `{key}=` (or `{key}:`) was expected")
        k, sep, value = line.partition("=" if key in _FIELDS or key == "snapshot" else ":")
        if not sep or k.strip() != key:
            raise self.error(f"expected `{key}`, found {line[:60]!r}")
        return value.strip()


def _int(lines: _Lines, key: str) -> int:
    text = lines.field(key)
    try:
        return int(text)
    except ValueError:
        raise lines.error(f"{key}={text!r} is not a whole number") from None


def _node(lines: _Lines, line: str | None, what: str) -> tuple[int, int, str]:
    """`n<children>: <bytes> <label>` -> (children, bytes, label); split by hand, not by a regular expression:
    a 10,000-site file has hundreds of thousands of these lines."""
    if line is None:
        raise lines.error(f"{what}, found the end of the file")
    head, sep, rest = line.lstrip().partition(":")
    nbytes, _, label = rest.strip().partition(" ")
    try:
        if not sep or head[:1] != "n":
            raise ValueError
        return int(head[1:]), int(nbytes), label
    except ValueError:
        raise lines.error(f"{what}, found {line[:60]!r}") from None


def _tree(lines: _Lines, frames: dict[str, Frame]) -> HeapTree:
    kids, total, label = _node(lines, lines.next(), "a detailed snapshot's tree was expected")
    root = HeapTree(root_label=label, total=total)
    # (children still to read, the dict they go into)
    work: list[tuple[int, dict[str, HeapNode]]] = [(kids, root.children)]
    while work:
        left, into = work[-1]
        if left == 0:
            work.pop()
            continue
        work[-1] = (left - 1, into)
        kids, nbytes, label = _node(
            lines, lines.next(), "a tree node was expected (its parent announced more children)"
        )
        frame = frames.get(label)
        if frame is None:  # the same labels come back in every snapshot: one Frame each
            frame = frames[label] = parse_label(label)
        node = HeapNode(frame, nbytes)
        key = label
        while key in into:  # Massif's labels are unique per level; keep a repeated one apart, not merged
            key += "'"
        into[key] = node
        root.n_stacks += kids == 0
        work.append((kids, node.children))
    return root


def parse_massif(text: str, name: str = "massif.out") -> MassifFile:
    lines = _Lines(text, name)
    desc = lines.field("desc")
    cmd = lines.field("cmd")
    time_unit = lines.field("time_unit")
    if time_unit not in ("i", "ms", "B"):
        raise lines.error(f"time_unit {time_unit!r} is not one of i, ms, B")
    snaps: list[Snapshot] = []
    frames: dict[str, Frame] = {}
    while True:
        line = lines.next()
        if line is None:
            break
        if not line.startswith("snapshot="):
            raise lines.error(f"expected `snapshot=N`, found {line[:60]!r}")
        time = _int(lines, "time")
        heap = _int(lines, "mem_heap_B")
        extra = _int(lines, "mem_heap_extra_B")
        stacks = _int(lines, "mem_stacks_B")
        kind_text = lines.field("heap_tree")
        kind = _KINDS.get(kind_text)
        if kind is None:
            raise lines.error(f"heap_tree={kind_text!r} is not one of empty, detailed, peak")
        tree = None if kind is SnapshotKind.NORMAL else _tree(lines, frames)
        snaps.append(Snapshot(time, heap, extra, stacks, tree, kind))
    if not snaps:
        raise lines.error("no snapshot in the file")
    return MassifFile(desc, cmd, time_unit, snaps)
