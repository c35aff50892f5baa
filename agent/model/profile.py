"""The profile model: frames, stacks, per-site counters, snapshots and Massif trees.

Pure Python: no bcc, no I/O. Everything here can be tested without root.

The behaviour follows Valgrind 3.19's Massif (massif/ms_main.c, coregrind/m_xtree.c): which stack frames are
kept, how the tree of a detailed snapshot is grouped, sorted and thresholded, and how the series of snapshots
is thinned out as a run gets longer.
"""

from __future__ import annotations

import array
import bisect
import enum
import functools
import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Frame:
    """One code location, as Massif prints it.

    `address` is the runtime address shown in the tree (the return address for a caller frame).
    Inlined calls give several Frames with the same address, innermost first.
    """

    address: int
    function: str | None = None  # None: unknown, printed as ???
    file: str | None = None  # base name of the source file, as Massif shows it
    line: int | None = None
    obj: str | None = None  # path of the ELF object holding the address
    # Directory + file name as DWARF gives it, for the xtree report (Valgrind writes the full name there).
    # Not part of the frame's identity: the Massif label only shows the base name.
    path: str | None = field(default=None, compare=False)
    # An inlined call, shown above the frame of the function it was inlined into (the next one, at the same
    # address). Recursion also puts consecutive frames at one address, so the address alone cannot tell
    # one instruction pointer's inlined calls from several calls (see ip_groups). Derived from the
    # address, like the label's other parts: not part of the identity.
    inlined: bool = field(default=False, compare=False)

    def __hash__(self) -> int:
        # Computed once: stacks of a dozen frames are dict keys by the ten thousand (trees, merges, diffs, the
        # store's reader), and the generated hash builds a tuple of the fields at every call (6x slower).
        d = self.__dict__
        try:
            return d["_hash"]  # type: ignore[no-any-return]
        except KeyError:
            h = d["_hash"] = hash((self.address, self.function, self.file, self.line, self.obj))
            return h

    def __getstate__(self) -> dict[str, object]:
        # str hashes differ from process to process: a pickled frame carries no hash.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @functools.cached_property
    def label(self) -> str:
        """Massif's `0xADDR: fn (file:line)` / `0xADDR: fn (in /obj)` / `0xADDR: ???` (computed once: trees
        of 10,000 stacks ask for it hundreds of thousands of times)."""
        fn = self.function or "???"
        if self.file and self.line:
            return f"0x{self.address:X}: {fn} ({self.file}:{self.line})"
        if self.obj:
            return f"0x{self.address:X}: {fn} (in {self.obj})"
        return f"0x{self.address:X}: {fn}"


# A call stack, innermost frame (the allocation's call site) first.
Stack = tuple[Frame, ...]


@dataclass
class SiteCounts:
    """Counters of one allocation stack, as kept in the kernel (bytes are requested sizes)."""

    cur_bytes: int = 0  # live bytes now
    cur_blocks: int = 0  # live blocks now
    tot_bytes: int = 0  # bytes ever allocated
    tot_blocks: int = 0  # blocks ever allocated
    freed_bytes: int = 0  # bytes of this stack's blocks freed
    freed_blocks: int = 0
    peak_bytes: int = 0  # live bytes at the global peak (exact)
    cur_extra: int = 0  # Massif's extra bytes (slop + admin) of the live blocks
    peak_extra: int = 0  # the same at the global peak


# ----------------------------------------------------------------------------------------------------
# Stack trimming
# ----------------------------------------------------------------------------------------------------

# Valgrind's "below main" functions (m_debuginfo's get_fnname_kind, plus the name it prints for them).
BELOW_MAIN_FUNCTIONS: frozenset[str] = frozenset(
    {"__libc_start_main", "__libc_start_call_main", "generic_start_main", "_start", "(below main)"}
)


def ip_groups(frames: Sequence[Frame]) -> list[Stack]:
    """Split a stack into instruction pointers: one IP is its inlined calls (innermost first) and the real
    function, last. A group ends at a frame that is not an inlined call, or where the address changes.
    A recursive function calling itself from one line gives one IP per call, all at the same address."""
    groups: list[Stack] = []
    start = 0
    for i, frame in enumerate(frames):
        last = i + 1 == len(frames)
        if last or not frame.inlined or frames[i + 1].address != frame.address:
            groups.append(tuple(frames[start : i + 1]))
            start = i + 1
    return groups


def _main_offset(groups: Sequence[Stack]) -> int:
    """Index of the IP where Massif stops (VG_(XT_offset_main_or_below_main)).

    Scanning from the outermost IP inwards, remember each main/below-main IP and stop at the first `main`.
    Without either, the whole stack is kept. An IP's kind is that of its real (not inlined) function.
    """
    last = len(groups) - 1
    found = last
    found_kind = "normal"
    for i in range(last, -1, -1):
        fn = groups[i][-1].function
        if fn == "main":
            return i
        if fn in BELOW_MAIN_FUNCTIONS:
            found, found_kind = i, "below"
    return found if found_kind == "below" else last


def trim_stack(frames: Sequence[Frame], alloc_fns: frozenset[str], depth: int) -> Stack:
    """Massif's filter_IPs: the part of a raw stack (innermost first) that Massif shows.

    - Drop IPs from the top while they are allocation functions. An IP with inlined frames is dropped only
      when all its frames are alloc-fns (an alloc-fn inlined into a normal function stays).
    - Cut everything below `main` (main itself is kept). Without main, cut below the innermost below-main
      function (__libc_start_main...); with neither, keep everything (thread stacks end in clone).
    - Keep at most `depth` IPs (Massif's --depth counts addresses; inlined frames come along with their IP).
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    groups = ip_groups(frames)
    top = 0
    while top < len(groups) and all(f.function is not None and f.function in alloc_fns for f in groups[top]):
        top += 1
    n_sel = len(groups) - top
    if n_sel > 0:
        mbm = _main_offset(groups)
        # Massif's special case: main itself is an alloc-fn. It keeps one IP then.
        n_sel = 1 if mbm < top else mbm - top + 1
    n_sel = min(n_sel, depth)
    return tuple(f for g in groups[top : top + n_sel] for f in g)


# ----------------------------------------------------------------------------------------------------
# Heap trees
# ----------------------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class MassifNode:
    """A node as Massif writes it: `n<len(children)>: <bytes> <label>`."""

    bytes: int
    label: str
    children: tuple[MassifNode, ...] = ()


def threshold_text(n_places: int, threshold: float) -> str:
    """Massif's label for the children that are each below the threshold, aggregated into one node."""
    places = "place," if n_places == 1 else "places, all"
    return f"in {n_places} {places} below massif's threshold ({threshold:.2f}%)"


def significance_size(total: int, extra_B: int, stacks_B: int, threshold: float) -> int:
    """The byte size a node needs to be shown (m_xtree.c): a percentage of the snapshot's whole total
    (useful + extra + stacks). When nothing is allocated, every node is insignificant unless threshold=0."""
    if total == 0 and threshold != 0:
        return 1
    return int((total + extra_B + stacks_B) * threshold / 100)


def _sort_key(item: tuple[int, int, str]) -> tuple[int, int, str]:
    nbytes, address, label = item
    # Bigger first; on a tie the lower address first (the aggregated node counts as address 0), as Massif.
    return (-nbytes, address, label)


def _massif_children(level: Mapping[str, TreeNode], sig: int, threshold: float) -> tuple[MassifNode, ...]:
    shown: list[tuple[tuple[int, int, str], MassifNode]] = []
    insig_bytes = 0
    insig_count = 0
    for key, node in level.items():
        if node.bytes < sig:
            insig_bytes += node.bytes
            insig_count += 1
            continue
        mn = MassifNode(node.bytes, key, _massif_children(node.children, sig, threshold))
        shown.append(((node.bytes, node.frame.address, key), mn))
    if insig_count:
        label = threshold_text(insig_count, threshold)
        shown.append(((insig_bytes, 0, ""), MassifNode(insig_bytes, label)))
    shown.sort(key=lambda pair: _sort_key(pair[0]))
    return tuple(mn for _, mn in shown)


def massif_tree(tree: Tree, *, threshold: float, extra_B: int = 0, stacks_B: int = 0) -> MassifNode:
    """The tree Massif writes for a detailed snapshot: children sorted by size, and at every level the
    children below the threshold (percent of useful + extra + stacks bytes) merged into one node,
    `in N places, all below massif's threshold (T%)`. threshold=0 keeps everything."""
    if not 0.0 <= threshold <= 100.0:
        raise ValueError(f"threshold must be between 0.0 and 100.0, got {threshold}")
    sig = significance_size(tree.total, extra_B, stacks_B, threshold)
    return MassifNode(tree.total, tree.root_label, _massif_children(tree.children, sig, threshold))


# ----------------------------------------------------------------------------------------------------
# Snapshots
# ----------------------------------------------------------------------------------------------------

TIME_UNITS: tuple[str, ...] = ("i", "ms", "B")


class SnapshotKind(enum.StrEnum):
    NORMAL = "normal"  # counters only
    DETAILED = "detailed"  # counters and a heap tree
    PEAK = "peak"  # the one snapshot at the peak of useful + extra + stacks, with a heap tree


@dataclass
class Snapshot:
    time: int
    heap_B: int
    heap_extra_B: int
    stacks_B: int
    tree: Tree | None
    kind: SnapshotKind
    # The time the schedule counts this snapshot at, when not `time`: a tick's state that took a point's place
    # (SnapshotSeries.tree_missed) keeps the point's time for the culling and the next due time.
    schedule_time: int | None = field(default=None, compare=False, repr=False)
    # A point's tree is still to come (SnapshotSeries.give_tree or tree_missed).
    tree_pending: bool = field(default=False, compare=False, repr=False)

    @property
    def scheduled_at(self) -> int:
        return self.time if self.schedule_time is None else self.schedule_time

    @property
    def total_B(self) -> int:
        return self.heap_B + self.heap_extra_B + self.stacks_B

    @property
    def is_detailed(self) -> bool:
        return self.tree is not None


class SnapshotSeries:
    """Massif's snapshot array (ms_main.c maybe_take_snapshot / cull_snapshots), fed with samples.

    The caller offers samples in time order. For each one it first asks `next_kind(time)`:
      - None: too soon after the last snapshot (Massif's minimum time interval), skip the sample;
      - NORMAL: call `add(...)` with the counters;
      - DETAILED: build the heap tree too (a map read), then `add(..., tree=...)`.
    Every `detailed_freq`-th recorded snapshot is detailed. When the array reaches `max_snapshots`, half of
    them are culled: one at a time, the snapshot whose neighbours are closest in time goes, whatever its
    kind (detailed ones are not protected). The first, the last and the peak snapshot are never culled.
    The smallest gap left becomes the new minimum interval, so snapshots get sparser as the run goes on.

    Sampled at ticks (--pages-as-heap=yes, the stored history), the peak is given out of band (`set_peak`):
    inserted in time order, it replaces the previous peak when higher, and does not count in the detailed
    frequency; `finish` adds the final state.

    The kernel's points (exact totals at the events where Massif takes its snapshots) go through `add_point`
    and `add_peak_point` (Massif's peak snapshots: a free coming down from a new high, taken whatever the
    interval; the previous peak turns detailed, keeping its tree, and the next snapshot is due an interval
    after it). A point the detailed frequency falls on, and every peak point, is recorded with its tree to
    come: `give_tree` sets the tree of the point's own instant (rebuilt from the kernel's snapshot log), or
    `tree_missed` says it cannot be had. `close` ends such a series as Massif's ends, at its last snapshot.
    """

    def __init__(self, *, detailed_freq: int = 10, max_snapshots: int = 100) -> None:
        if detailed_freq < 1:
            raise ValueError(f"detailed_freq must be at least 1, got {detailed_freq}")
        if max_snapshots < 10:
            # Massif's own lower bound; culling needs room beside the three uncullable snapshots.
            raise ValueError(f"max_snapshots must be at least 10, got {max_snapshots}")
        self.detailed_freq = detailed_freq
        self.max_snapshots = max_snapshots
        self._snapshots: list[Snapshot] = []
        self._min_interval = 0
        self._earliest_next = 0  # zero lets the startup sample in
        self._since_detailed = 0
        self._last_time: int | None = None
        self._finished = False
        self.n_cullings = 0
        self.n_skipped = 0
        self.n_taken = 0  # snapshots recorded by add, add_point and add_peak_point (Massif's "real snapshots")
        self.n_peaks_taken = 0  # of which by add_peak_point

    # -- queries

    @property
    def snapshots(self) -> list[Snapshot]:
        """The recorded snapshots in time order (a copy of the list; the snapshots themselves are shared)."""
        return list(self._snapshots)

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def peak(self) -> Snapshot | None:
        for s in self._snapshots:
            if s.kind is SnapshotKind.PEAK:
                return s
        return None

    @property
    def min_time_interval(self) -> int:
        return self._min_interval

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def last_time(self) -> int | None:
        """The time of the latest snapshot offered to add/add_point/finish (None before any): later samples may
        not be earlier."""
        return self._last_time

    @property
    def latest_time(self) -> int | None:
        """The latest snapshot's own time (None before any): no later snapshot may be earlier, as Massif's file
        is in time order. A tick's state that took a point's place (tree_missed) can be later than last_time, the
        point's, from which the schedule goes on."""
        if not self._snapshots:
            return self._last_time
        t = self._snapshots[-1].time
        return t if self._last_time is None else max(t, self._last_time)

    def holds(self, snap: Snapshot) -> bool:
        """`snap` itself (not an equal one) is in the series: not culled."""
        return any(x is snap for x in self._snapshots)

    def next_kind(self, time: int) -> SnapshotKind | None:
        """What a sample at `time` would be recorded as, or None if it would be skipped. No side effect."""
        if self._finished or time < self._earliest_next:
            return None
        if self._since_detailed == self.detailed_freq - 1:
            return SnapshotKind.DETAILED
        return SnapshotKind.NORMAL

    # -- updates

    def add(
        self, time: int, heap_B: int, heap_extra_B: int, stacks_B: int, tree: Tree | None = None
    ) -> Snapshot | None:
        """Offer a sample. Returns the recorded snapshot, or None when it is skipped (see next_kind).
        A detailed one needs `tree`; a normal one drops any tree given."""
        if self._finished:
            raise ValueError("the series is finished")
        self._check_time(time)
        kind = self.next_kind(time)
        if kind is None:
            self.n_skipped += 1
            return None
        if kind is SnapshotKind.DETAILED:
            if tree is None:
                raise ValueError("this sample must be detailed (next_kind said so) but no tree was given")
            self._tree_given()
        else:
            tree = None
            self._since_detailed += 1
        return self._record(Snapshot(time, heap_B, heap_extra_B, stacks_B, tree, kind))

    def add_point(self, time: int, heap_B: int, heap_extra_B: int, stacks_B: int) -> Snapshot | None:
        """Offer a point, a sample with exact totals and no tree yet. Returns the recorded snapshot, or None when
        it is skipped. When the detailed frequency falls on it, it is DETAILED with its tree to come (give_tree,
        or tree_missed)."""
        if self._finished:
            raise ValueError("the series is finished")
        self._check_time(time)
        kind = self.next_kind(time)
        if kind is None:
            self.n_skipped += 1
            return None
        if kind is SnapshotKind.DETAILED:
            self._tree_given()
        else:
            self._since_detailed += 1
        pending = kind is SnapshotKind.DETAILED
        return self._record(Snapshot(time, heap_B, heap_extra_B, stacks_B, None, kind, tree_pending=pending))

    def add_peak_point(self, time: int, heap_B: int, heap_extra_B: int, stacks_B: int) -> Snapshot:
        """Record one of Massif's peak snapshots, its tree to come: taken whatever the interval, it becomes the
        peak, counts as detailed for the frequency, and the next snapshot is due an interval after it. The
        previous peak turns into the detailed snapshot it is in Massif's file (its kind goes, its tree stays)."""
        if self._finished:
            raise ValueError("the series is finished")
        self._check_time(time)
        for old in self._snapshots:
            if old.kind is SnapshotKind.PEAK:
                has_tree = old.tree is not None or old.tree_pending
                old.kind = SnapshotKind.DETAILED if has_tree else SnapshotKind.NORMAL
        self.n_peaks_taken += 1
        self._tree_given()
        snap = Snapshot(time, heap_B, heap_extra_B, stacks_B, None, SnapshotKind.PEAK, tree_pending=True)
        return self._record(snap)

    def _tree_given(self) -> None:
        """A detailed snapshot (or a peak, which counts as one) was taken: the frequency's count starts again."""
        self._since_detailed = 0

    def _record(self, snap: Snapshot) -> Snapshot:
        """Append a taken snapshot, cull if the series is full, and set when the next one is due."""
        self._snapshots.append(snap)
        self._last_time = snap.time
        self.n_taken += 1
        self._cull_if_full()
        self._earliest_next = snap.time + self._min_interval
        return snap

    def give_tree(self, snap: Snapshot, tree: Tree, ignored_heap_B: int = 0, ignored_extra_B: int = 0) -> None:
        """The tree of a point at its own instant. Its totals lose what the tree leaves out (--ignore-fn)."""
        snap.tree = tree
        snap.tree_pending = False
        snap.heap_B -= ignored_heap_B
        snap.heap_extra_B -= ignored_extra_B

    def tree_missed(
        self, snap: Snapshot, time: int, heap_B: int, heap_extra_B: int, stacks_B: int, tree: Tree
    ) -> Snapshot | None:
        """The tree of a point's instant cannot be had: the state at `time` with its tree takes the point's
        place when the point is the latest snapshot (not the first), and the schedule goes on from the point's
        time, as if it had been kept; else the point stays without a tree, a normal snapshot (a peak stays the
        peak). Returns the snapshot put in its place, if any."""
        snap.tree_pending = False
        snaps = self._snapshots
        if len(snaps) >= 2 and snaps[-1] is snap and time >= snap.time:
            new = Snapshot(time, heap_B, heap_extra_B, stacks_B, tree, snap.kind, schedule_time=snap.time)
            snaps[-1] = new
            return new
        if snap.kind is SnapshotKind.DETAILED:
            snap.kind = SnapshotKind.NORMAL
        return None

    def set_peak(self, time: int, heap_B: int, heap_extra_B: int, stacks_B: int, tree: Tree) -> Snapshot | None:
        """Record the state at the peak, if higher (useful + extra + stacks) than the current peak, or if the
        current one is a peak point (no tree). The old peak snapshot is removed; the new one goes in time order
        (after snapshots at the same time). Returns the new peak snapshot, or None when it is not higher."""
        current = self.peak
        total = heap_B + heap_extra_B + stacks_B
        if current is not None and current.tree is None:
            # A peak point (add_peak_point) has no tree: the exact peak takes its place, or, at another
            # instant, leaves it as the normal snapshot it is in Massif's file. Its totals may be higher:
            # the kernel's count --ignore-fn allocations.
            if current.time == time:
                self._snapshots.remove(current)
            else:
                current.kind = SnapshotKind.NORMAL
        elif current is not None and total <= current.total_B:
            return None
        elif current is not None:
            self._snapshots.remove(current)
        snap = Snapshot(time, heap_B, heap_extra_B, stacks_B, tree, SnapshotKind.PEAK)
        at = bisect.bisect_right([s.time for s in self._snapshots], time)
        self._snapshots.insert(at, snap)
        if self._cull_if_full() and self._last_time is not None:
            self._earliest_next = self._last_time + self._min_interval
        return snap

    def finish(
        self, time: int, heap_B: int, heap_extra_B: int, stacks_B: int, tree: Tree | None = None
    ) -> Snapshot:
        """Record the final state unconditionally (detailed when `tree` is given) and close the series.

        Massif 3.19 takes no extra snapshot at exit: its last one is whatever the last event produced, and
        is detailed only if the frequency says so. heapscope samples, so it records the end state explicitly;
        give a tree so that the final state has one."""
        if self._finished:
            raise ValueError("the series is already finished")
        self._check_time(time)
        kind = SnapshotKind.DETAILED if tree is not None else SnapshotKind.NORMAL
        snap = Snapshot(time, heap_B, heap_extra_B, stacks_B, tree, kind)
        self._snapshots.append(snap)
        self._last_time = time
        self._cull_if_full()
        self._finished = True
        return snap

    def close(self) -> None:
        """End the series where it stands, as Massif's ends at exit: with its last snapshot, none added."""
        self._finished = True

    # -- internals

    def _check_time(self, time: int) -> None:
        latest = self.latest_time
        if latest is not None and time < latest:
            raise ValueError(f"time went backwards: {time} after {latest}")

    def _uncullable(self, i: int) -> bool:
        return i == 0 or i == len(self._snapshots) - 1 or self._snapshots[i].kind is SnapshotKind.PEAK

    def _cull_if_full(self) -> bool:
        if len(self._snapshots) < self.max_snapshots:
            return False
        self._min_interval = self._cull()
        return True

    def _cull(self) -> int:
        """Massif's cull_snapshots: remove max_snapshots/2, return the new minimum time interval.

        Massif removes, one at a time, the snapshot whose neighbours are closest in time (the first such one
        on a tie), never the first, the last or the peak. The same choice, with the spans in a heap keyed by
        (span, position) instead of a scan per removal: the kernel's schedule culls while the target waits."""
        self.n_cullings += 1
        snaps = self._snapshots
        n = len(snaps)
        times = [x.scheduled_at for x in snaps]
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        alive = [True] * n
        cullable = [0 < j < n - 1 and snaps[j].kind is not SnapshotKind.PEAK for j in range(n)]
        heap = [(times[j + 1] - times[j - 1], j) for j in range(n) if cullable[j]]
        heapq.heapify(heap)
        removed = 0
        while heap and removed < self.max_snapshots // 2:
            span, j = heapq.heappop(heap)
            if not alive[j] or span != times[nxt[j]] - times[prev[j]]:
                continue  # gone, or its span grew since (a newer entry holds it)
            alive[j] = False
            removed += 1
            p, q = prev[j], nxt[j]
            nxt[p], prev[q] = q, p
            for k in (p, q):
                if cullable[k]:
                    heapq.heappush(heap, (times[nxt[k]] - times[prev[k]], k))
        snaps[:] = [x for x, keep in zip(snaps, alive, strict=True) if keep]
        # Gaps between two uncullable snapshots never grow, so they would pin the interval: skip them.
        gaps = [
            snaps[i].scheduled_at - snaps[i - 1].scheduled_at
            for i in range(1, len(snaps))
            if not (self._uncullable(i) and self._uncullable(i - 1))
        ]
        return min(gaps) if gaps else self._min_interval
