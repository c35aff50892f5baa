"""Heap trees: useful bytes per stack merged into a prefix tree rooted at the allocation site, as Massif
groups them (HeapTree), and the index that builds every snapshot's tree from one set of stacks (StackIndex).

Pure Python: no bcc, no I/O. The grouping follows Valgrind 3.19's coregrind/m_xtree.c.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.model.stack import Frame, Stack

HEAP_ROOT_LABEL = "(heap allocation functions) malloc/new/new[], --alloc-fns, etc."
PAGES_ROOT_LABEL = "(page allocation syscalls) mmap/mremap/brk, --alloc-fns, etc."


@dataclass
class HeapNode:
    """One node of the full (unthresholded) tree: a frame and the useful bytes of all stacks through it."""

    frame: Frame
    bytes: int = 0
    children: dict[str, HeapNode] = field(default_factory=dict)  # keyed by Frame.label


@dataclass
class HeapTree:
    """Useful heap bytes per trimmed stack, merged into a prefix tree.

    The first level under the root is the innermost frame (the allocation's call site), as in Massif. Frames
    merge when their labels are equal (address, function, file and line). A stack that ends at a node counts
    in that node but in none of its children, as in Massif.
    """

    root_label: str = HEAP_ROOT_LABEL
    total: int = 0
    children: dict[str, HeapNode] = field(default_factory=dict)
    n_stacks: int = 0

    @classmethod
    def from_stacks(cls, stacks: Mapping[Stack, int], root_label: str = HEAP_ROOT_LABEL) -> HeapTree:
        """Build the tree. Give every stack seen so far, including those at 0 bytes: with --threshold=0
        Massif shows sites whose blocks were all freed. Empty stacks are ignored, as Massif ignores
        allocations with no frame left after trimming. Negative counts (a racy read) count as 0."""
        tree = cls(root_label=root_label)
        for stack, nbytes in stacks.items():
            tree.add(stack, nbytes)
        return tree

    def add(self, stack: Stack, nbytes: int) -> None:
        if not stack:
            return
        nbytes = max(0, int(nbytes))
        self.total += nbytes
        self.n_stacks += 1
        level = self.children
        for frame in stack:
            key = frame.label
            node = level.get(key)
            if node is None:
                node = level[key] = HeapNode(frame)
            node.bytes += nbytes
            level = node.children


class TreeNode(Protocol):
    """What the writers read of a tree node (HeapNode, IndexedNode)."""

    @property
    def frame(self) -> Frame: ...

    @property
    def bytes(self) -> int: ...

    @property
    def children(self) -> Mapping[str, TreeNode]: ...


class Tree(Protocol):
    """What the writers read of a snapshot's tree (HeapTree, IndexedTree)."""

    @property
    def root_label(self) -> str: ...

    @property
    def total(self) -> int: ...

    @property
    def n_stacks(self) -> int: ...

    @property
    def children(self) -> Mapping[str, TreeNode]: ...


class _IndexNode:
    """A node of a StackIndex: one frame on the way from the allocation site outwards."""

    __slots__ = ("children", "frame", "kids", "number", "stack")

    def __init__(self, frame: Frame | None, number: int) -> None:
        self.frame = frame
        self.number = number  # creation order: a numbering covers the nodes made before it
        self.stack = -1  # the stack that ends here (equal labels all the way: one stack), or -1
        self.children: dict[str, _IndexNode] = {}  # by Frame.label, for add()
        # The same children in creation order: readers iterate this list while add() may append to it.
        self.kids: list[_IndexNode] = []


@dataclass(frozen=True)
class _Numbering:
    """Slots of the stacks in depth-first order: a node's stacks fill slots lo[node]..hi[node] - 1."""

    n_nodes: int
    n_stacks: int
    order: list[int]  # stack numbers, by slot
    lo: array.array[int]
    hi: array.array[int]


class StackIndex:
    """The prefix tree of a growing set of stacks (as HeapTree builds it), built once, from which the tree of
    any bytes per stack is taken without building nodes.

    Each stack gets a slot in depth-first order, so every node covers a run of slots and its bytes are the
    difference of two prefix sums: a tree costs one pass over the stacks (in C, mostly) and then only the nodes
    a reader visits, which for Massif's thresholded output is a few hundred of tens of thousands. Stacks are
    only added; a tree keeps the numbering of its time, so adding stacks later leaves it valid. add() and
    tree() must not run concurrently (the caller holds a lock); reading trees needs no lock.
    """

    def __init__(self, root_label: str = HEAP_ROOT_LABEL) -> None:
        self.root_label = root_label
        self._root = _IndexNode(None, 0)
        self._n_nodes = 1
        self.n_stacks = 0
        self._numbering: _Numbering | None = None

    def add(self, stack: Stack) -> int:
        """The number of `stack` (an existing one when its labels are equal), or -1 for an empty stack, which
        trees leave out as HeapTree does."""
        if not stack:
            return -1
        node = self._root
        for frame in stack:
            child = node.children.get(frame.label)
            if child is None:
                child = _IndexNode(frame, self._n_nodes)
                self._n_nodes += 1
                node.kids.append(child)
                node.children[frame.label] = child
            node = child
        if node.stack < 0:
            node.stack = self.n_stacks
            self.n_stacks += 1
        return node.stack

    def tree(self, values: Sequence[int], present: Sequence[bool] | None = None) -> IndexedTree:
        """The tree with values[i] bytes for stack number i (negative values, from racy reads, count as 0). With
        `present`, only the stacks it marks are in the tree (a tree of an earlier instant: Massif's tree holds
        the stacks allocated from by then, 0-byte ones too, and no others)."""
        if len(values) != self.n_stacks or (present is not None and len(present) != self.n_stacks):
            raise ValueError(f"{len(values)} values for {self.n_stacks} stacks")
        numbering = self._numbering
        if numbering is None or numbering.n_stacks != self.n_stacks:
            numbering = self._numbering = self._number()
        by_slot: Iterable[int] = map(values.__getitem__, numbering.order)
        if values and min(values) < 0:
            by_slot = (v if v > 0 else 0 for v in by_slot)
        prefix = array.array("q", itertools.accumulate(by_slot, initial=0))
        counts = None
        if present is not None and not all(present):
            counts = array.array("q", itertools.accumulate(map(present.__getitem__, numbering.order), initial=0))
        return IndexedTree(self.root_label, self._root, numbering, prefix, counts)

    def _number(self) -> _Numbering:
        n_nodes = self._n_nodes
        lo = array.array("q", bytes(8 * n_nodes))
        hi = array.array("q", bytes(8 * n_nodes))
        order: list[int] = []
        work: list[tuple[_IndexNode, bool]] = [(self._root, False)]
        while work:  # depth first, without recursion (stacks can be deeper than Python's recursion limit)
            node, closing = work.pop()
            if closing:
                hi[node.number] = len(order)
                continue
            lo[node.number] = len(order)
            if node.stack >= 0:
                order.append(node.stack)
            work.append((node, True))
            work.extend((kid, False) for kid in node.kids)
        return _Numbering(n_nodes, self.n_stacks, order, lo, hi)


class IndexedNode:
    """A node of an IndexedTree, made when a reader reaches it."""

    __slots__ = ("_node", "_tree", "bytes", "frame")

    def __init__(self, node: _IndexNode, tree: IndexedTree) -> None:
        assert node.frame is not None
        self.frame = node.frame
        self.bytes = tree.bytes_of(node)
        self._node = node
        self._tree = tree

    @property
    def children(self) -> dict[str, IndexedNode]:
        return self._tree.children_of(self._node)


class IndexedTree:
    """A tree taken from a StackIndex: read like a HeapTree (total, children, node bytes), not modified."""

    __slots__ = ("_counts", "_numbering", "_prefix", "_root", "n_stacks", "root_label", "total")

    def __init__(
        self,
        root_label: str,
        root: _IndexNode,
        numbering: _Numbering,
        prefix: array.array[int],
        counts: array.array[int] | None = None,
    ) -> None:
        self.root_label = root_label
        self._root = root
        self._numbering = numbering
        self._prefix = prefix
        # Prefix sums of the stacks present, by slot (None: all are): a node without one is not in the tree.
        self._counts = counts
        self.total = prefix[-1]
        self.n_stacks = numbering.n_stacks

    def _present(self, node: _IndexNode) -> bool:
        counts = self._counts
        if counts is None:
            return True
        n = self._numbering
        return counts[n.hi[node.number]] > counts[n.lo[node.number]]

    @property
    def children(self) -> dict[str, IndexedNode]:
        return self.children_of(self._root)

    def bytes_of(self, node: _IndexNode) -> int:
        n = self._numbering
        return self._prefix[n.hi[node.number]] - self._prefix[n.lo[node.number]]

    def children_of(self, node: _IndexNode) -> dict[str, IndexedNode]:
        # Nodes made after this tree's numbering hold none of its stacks.
        limit = self._numbering.n_nodes
        out = {}
        for kid in node.kids:
            if kid.number < limit and self._present(kid):
                view = IndexedNode(kid, self)
                out[view.frame.label] = view
        return out

    def stacks(self) -> dict[Stack, int]:
        """Bytes per stack (every stack of the numbering, 0-byte ones too): HeapTree.from_stacks gives the same
        tree back."""
        out: dict[Stack, int] = {}
        work: list[tuple[_IndexNode, Stack]] = [(kid, ()) for kid in self._root.kids]
        limit = self._numbering.n_nodes
        counts = self._counts
        while work:
            node, above = work.pop()
            if node.number >= limit or not self._present(node):
                continue
            assert node.frame is not None
            stack = (*above, node.frame)
            if node.stack >= 0 and node.stack < self.n_stacks:
                n = self._numbering
                slot = n.lo[node.number]  # a node's own stack comes first in its run
                if counts is None or counts[slot + 1] > counts[slot]:
                    out[stack] = self._prefix[slot + 1] - self._prefix[slot]
            work.extend((kid, stack) for kid in node.kids)
        return out


