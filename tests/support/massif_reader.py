"""A reader of massif.out files, for tests: header, snapshots and heap trees.

With strict=True (the default) it also enforces massif-visualizer's stricter grammar and ms_print's limits:
`#-----------` on both sides of `snapshot=N`, snapshot numbers counting from 0, exactly one space after each
header colon, a node's `n` at the column equal to its depth, a label on every node, the announced number of
children present, and no node bigger than its snapshot's total. Valgrind's own files pass it.

`paths(tree)` gives the bytes of every root-to-node path of labels without their addresses, so that a tree
written by Valgrind and one written by heapscope can be compared (load addresses differ between the two).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent.model.stack import Frame, Stack

RULE = "#-----------"
_NODE = re.compile(r"^( *)n(\d+): (\d+) (.*)$")
_LOOSE_NODE = re.compile(r"^\s*n(\d+):\s*(\d+)\s?(.*)$")
_ADDRESS = re.compile(r"^0x[0-9A-Fa-f]+: ")
_FILE_LINE = re.compile(r"^0x([0-9A-Fa-f]+): (.*) \(([^()]*):(\d+)\)$")
_IN_OBJ = re.compile(r"^0x([0-9A-Fa-f]+): (.*) \(in (.*)\)$")
_BARE = re.compile(r"^0x([0-9A-Fa-f]+): (.*)$")


class MassifFormatError(ValueError):
    pass


@dataclass
class Node:
    bytes: int
    label: str
    depth: int
    children: list[Node] = field(default_factory=list)

    def walk(self) -> Iterator[Node]:
        yield self
        for c in self.children:
            yield from c.walk()


@dataclass
class MassifSnapshot:
    number: int
    time: int
    heap_B: int
    heap_extra_B: int
    stacks_B: int
    heap_tree: str  # empty | detailed | peak
    tree: Node | None

    @property
    def total_B(self) -> int:
        return self.heap_B + self.heap_extra_B + self.stacks_B


@dataclass
class MassifFile:
    desc: str
    cmd: str
    time_unit: str
    snapshots: list[MassifSnapshot]

    @property
    def peak(self) -> MassifSnapshot | None:
        peaks = [s for s in self.snapshots if s.heap_tree == "peak"]
        if len(peaks) > 1:
            raise MassifFormatError(f"{len(peaks)} peak snapshots")
        return peaks[0] if peaks else None

    @property
    def detailed(self) -> list[MassifSnapshot]:
        return [s for s in self.snapshots if s.tree is not None]

    @property
    def last_detailed(self) -> MassifSnapshot | None:
        d = self.detailed
        return d[-1] if d else None


class _Lines:
    def __init__(self, text: str, strict: bool) -> None:
        lines = text.splitlines()
        if not strict:
            # ms_print's reading: drop comments (from '#' on) and blank lines.
            lines = [ln.split("#", 1)[0] for ln in lines]
            lines = [ln for ln in lines if ln.strip()]
        self.lines = lines
        self.i = 0

    def peek(self) -> str | None:
        return self.lines[self.i] if self.i < len(self.lines) else None

    def next(self, what: str) -> str:
        line = self.peek()
        if line is None:
            raise MassifFormatError(f"line {self.i + 1}: expected {what}, got end of file")
        self.i += 1
        return line

    def fail(self, msg: str) -> MassifFormatError:
        return MassifFormatError(f"line {self.i}: {msg}")


def _header(lines: _Lines, key: str, strict: bool) -> str:
    line = lines.next(f"'{key}:'")
    if not line.startswith(f"{key}:"):
        raise lines.fail(f"expected '{key}:', got {line!r}")
    rest = line[len(key) + 1 :]
    if strict and not (rest.startswith(" ") and not rest.startswith("  ")):
        raise lines.fail(f"'{key}:' must be followed by exactly one space: {line!r}")
    return rest.strip()


def _field(lines: _Lines, key: str) -> str:
    line = lines.next(f"'{key}='")
    if not line.startswith(f"{key}="):
        raise lines.fail(f"expected '{key}=', got {line!r}")
    return line[len(key) + 1 :]


def _node(lines: _Lines, depth: int, total: int, strict: bool) -> Node:
    line = lines.next("a tree node")
    m = _NODE.match(line) if strict else _LOOSE_NODE.match(line)
    if m is None:
        raise lines.fail(f"bad tree node {line!r}")
    if strict:
        indent, n, nbytes, label = len(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)
        if indent != depth:
            raise lines.fail(f"node at column {indent}, depth {depth}: {line!r}")
        if not label.strip():
            raise lines.fail(f"node without a label: {line!r}")
        if nbytes > total:
            raise lines.fail(f"node of {nbytes} B is bigger than the snapshot total {total} B (ms_print dies)")
    else:
        n, nbytes, label = int(m.group(1)), int(m.group(2)), m.group(3)
    node = Node(nbytes, label, depth)
    node.children = [_node(lines, depth + 1, total, strict) for _ in range(n)]
    return node


def parse_massif(text: str, *, strict: bool = True) -> MassifFile:
    lines = _Lines(text, strict)
    desc_parts = []
    while (line := lines.peek()) is not None and line.startswith("desc:"):
        desc_parts.append(_header(lines, "desc", strict))
    if not desc_parts:
        raise MassifFormatError("missing 'desc:' line")
    cmd = _header(lines, "cmd", strict)
    time_unit = _header(lines, "time_unit", strict)
    if time_unit not in ("i", "ms", "B"):
        raise MassifFormatError(f"time_unit must be i, ms or B, got {time_unit!r}")
    snapshots: list[MassifSnapshot] = []
    while (line := lines.peek()) is not None:
        if not line.strip():
            lines.i += 1
            continue
        if strict and lines.next(RULE) != RULE:
            raise lines.fail(f"expected {RULE!r} before snapshot=")
        number = int(_field(lines, "snapshot"))
        if strict:
            if lines.next(RULE) != RULE:
                raise lines.fail(f"expected {RULE!r} after snapshot=")
            if number != len(snapshots):
                raise lines.fail(f"snapshot={number}, expected {len(snapshots)}")
        snap = MassifSnapshot(
            number=number,
            time=int(_field(lines, "time")),
            heap_B=int(_field(lines, "mem_heap_B")),
            heap_extra_B=int(_field(lines, "mem_heap_extra_B")),
            stacks_B=int(_field(lines, "mem_stacks_B")),
            heap_tree=_field(lines, "heap_tree"),
            tree=None,
        )
        if snap.heap_tree not in ("empty", "detailed", "peak"):
            raise lines.fail(f"heap_tree={snap.heap_tree!r}")
        if snap.heap_tree != "empty":
            snap.tree = _node(lines, 0, snap.total_B, strict)
        snapshots.append(snap)
    return MassifFile(" ".join(desc_parts), cmd, time_unit, snapshots)


def read_massif(path: str | Path, *, strict: bool = True) -> MassifFile:
    return parse_massif(Path(path).read_text(), strict=strict)


def strip_address(label: str) -> str:
    """`0x10918A: main (ex.c:20)` -> `main (ex.c:20)`; other labels unchanged."""
    return _ADDRESS.sub("", label, count=1)


def paths(tree: Node) -> dict[tuple[str, ...], int]:
    """Bytes per root-to-node path of address-free labels (the root itself left out). Siblings that only
    differ by address are merged (their bytes add up)."""
    out: dict[tuple[str, ...], int] = {}

    def visit(node: Node, prefix: tuple[str, ...]) -> None:
        for child in node.children:
            key = (*prefix, strip_address(child.label))
            out[key] = out.get(key, 0) + child.bytes
            visit(child, key)

    visit(tree, ())
    return out


def frame_from_label(label: str) -> Frame:
    """The Frame whose `.label` is `label` (for frames Massif writes: with file:line, `in obj`, or bare)."""
    if m := _FILE_LINE.match(label):
        return Frame(int(m.group(1), 16), m.group(2), m.group(3), int(m.group(4)))
    if m := _IN_OBJ.match(label):
        return Frame(int(m.group(1), 16), m.group(2), obj=m.group(3))
    if m := _BARE.match(label):
        fn = m.group(2)
        return Frame(int(m.group(1), 16), None if fn == "???" else fn)
    raise MassifFormatError(f"not a frame label: {label!r}")


def stacks_from_tree(tree: Node) -> dict[Stack, int]:
    """Invert a tree written with --threshold=0: the stacks (innermost first) and their bytes. A stack ends
    at every leaf, and at an inner node whose bytes exceed its children's."""
    out: dict[Stack, int] = {}

    def visit(node: Node, stack: Stack) -> None:
        own = node.bytes - sum(c.bytes for c in node.children)
        if stack and (not node.children or own > 0):
            out[stack] = own
        for child in node.children:
            if _ADDRESS.match(child.label) is None:
                raise MassifFormatError(f"aggregated node in a tree that should be complete: {child.label!r}")
            visit(child, (*stack, frame_from_label(child.label)))

    visit(tree, ())
    return out
