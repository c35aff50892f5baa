"""A stored history turned into model objects: Massif's snapshot series for a time range, the sites at a
moment, and the difference between two moments as a tree of byte deltas. No output formatting here."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent.errors import UsageError
from agent.model.options import DEFAULT_ALLOC_FNS, MassifOptions
from agent.model.snapshot import Snapshot, SnapshotKind, SnapshotSeries
from agent.model.stack import Frame, SiteCounts, Stack, trim_stack
from agent.model.tree import HEAP_ROOT_LABEL, IndexedTree, StackIndex, Tree, TreeNode
from agent.store import SnapshotRef, SnapshotUnavailable, StoredSnapshot, StoreReader
from agent.store.files import segment_paths


def open_target(store: str | os.PathLike[str], pid: int | None) -> StoreReader:
    """The history of one process in STORE: STORE/<pid>, or STORE itself when it holds segments."""
    root = Path(store)
    if not root.exists():
        raise UsageError(f"no store at {root}")
    if root.is_file() or segment_paths(root):
        return StoreReader(root)
    pids = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and segment_paths(p))
    if pid is not None:
        if pid not in pids:
            have = ", ".join(map(str, pids)) or "none"
            raise UsageError(f"no history of pid {pid} in {root} (pids there: {have})")
        return StoreReader(root / str(pid))
    if not pids:
        raise UsageError(f"no history in {root}")
    if len(pids) > 1:
        raise UsageError(f"{root} holds several processes ({', '.join(map(str, pids))}): choose one with --pid")
    return StoreReader(root / str(pids[0]))


@dataclass
class Selection:
    """The snapshots of a range that can be used, and what was left out."""

    refs: list[SnapshotRef]
    notes: list[str] = field(default_factory=list)


def select(reader: StoreReader, start_ns: int | None, end_ns: int | None) -> Selection:
    """The readable snapshots in [start_ns, end_ns] of the latest run they cover (a pid's directory may hold
    several runs: their profile times each start from 0, so one report covers one run). The range starts with
    the state at start_ns: the last snapshot before it comes first when none was taken at start_ns itself (a
    quiet target is stored rarely; its state held until the next snapshot)."""
    refs = []
    bad = 0
    in_range = reader.snapshots(start_ns, end_ns)
    if start_ns is not None and (not in_range or in_range[0].wall_ns > start_ns):
        prior = reader.before(start_ns)
        if prior is not None and "error" not in prior.info and (not in_range or run_of(prior) == run_of(in_range[0])):
            refs.append(prior)
    for ref in in_range:
        if "error" in ref.info:
            bad += 1
        else:
            refs.append(ref)
    notes = []
    if bad:
        notes.append(f"{bad} snapshots in the range have an unreadable snapinfo and are left out")
    runs = sorted({run_of(r) for r in refs})
    if len(runs) > 1:
        last = runs[-1]
        dropped = sum(1 for r in refs if run_of(r) != last)
        refs = [r for r in refs if run_of(r) == last]
        notes.append(f"the range covers {len(runs)} runs of the process: reporting the last, "
                     f"{dropped} snapshots of earlier runs left out (narrow it with --from/--to)")
    return Selection(refs, notes)


def run_of(ref: SnapshotRef) -> int:
    """Which run of the process a snapshot belongs to (its start on the wall clock)."""
    return int(ref.segment.filemeta.get("start_wall_ns", 0))


_UNSEEN = object()  # a cache miss


class Trimmer:
    """Massif's trimming of the raw stored stacks, by the profile's options, cached per stack."""

    def __init__(self, options: Mapping[str, object], *, massif: bool = True) -> None:
        extra = options.get("alloc_fns") or []
        self.alloc_fns = frozenset(DEFAULT_ALLOC_FNS) | frozenset(map(str, extra)) if massif else frozenset()  # type: ignore[call-overload]
        depth = int(options.get("depth", 30))  # type: ignore[call-overload]
        # The xtree keeps all Massif captured, down to main (as the session's xtree does).
        self.depth = depth if massif else MassifOptions(depth=depth).xtree_frames
        ignore = options.get("ignore_fns") or []
        self.ignore_fns = frozenset(map(str, ignore)) if massif else frozenset()  # type: ignore[call-overload]
        self._cache: dict[Stack, Stack | None] = {}

    def __call__(self, stack: Stack) -> Stack | None:
        """The trimmed stack, or None when --ignore-fn leaves it out."""
        got = self._cache.get(stack, _UNSEEN)
        if got is not _UNSEEN:
            return got  # type: ignore[return-value]
        out: Stack | None = trim_stack(stack, self.alloc_fns, self.depth)
        if out and out[0].function in self.ignore_fns:
            out = None
        self._cache[stack] = out
        return out

    def merge(self, sites: Mapping[Stack, SiteCounts]) -> dict[Stack, SiteCounts]:
        merged: dict[Stack, SiteCounts] = {}
        for stack, c in sites.items():
            t = self(stack)
            if t is None:
                continue
            m = merged.get(t)
            if m is None:
                merged[t] = SiteCounts(**vars(c))
            else:
                for name, v in vars(c).items():
                    setattr(m, name, getattr(m, name) + v)
        return merged


class SiteNumbers:
    """A number for each site of a segment, from its stack (`number_of`; -1 leaves the site out), asked once per
    distinct stack: a segment numbers its sites its own way, and segments repeat each other's stacks."""

    def __init__(self, number_of: Callable[[Stack], int]) -> None:
        self.number_of = number_of
        self._by_segment: dict[int, np.ndarray] = {}  # id(segment) -> number per site
        self._by_raw: dict[Stack, int] = {}

    def of(self, segment: object, stacks: Sequence[Stack], n: int) -> np.ndarray:
        """The numbers of the segment's sites 0..n-1 (`stacks`: the segment's site stacks, at least n)."""
        key = id(segment)
        have = self._by_segment.get(key)
        if have is None or len(have) < n:
            done = 0 if have is None else len(have)
            more = []
            for stack in stacks[done:n]:
                number = self._by_raw.get(stack)
                if number is None:
                    number = self._by_raw[stack] = self.number_of(stack)
                more.append(number)
            grown = np.array(more, dtype=np.int64)
            have = grown if have is None else np.concatenate([have, grown])
            self._by_segment[key] = have
        return have[:n]

    def of_snapshot(self, snap: StoredSnapshot) -> np.ndarray:
        return self.of(snap.ref.segment, snap.site_stacks, snap.counters.shape[1])


class TreeBuilder:
    """Heap trees of stored snapshots through one StackIndex (as the session builds its trees): each site is
    trimmed and numbered once, and a snapshot's tree is then one pass over its counter column."""

    def __init__(self, trim: Trimmer, root_label: str) -> None:
        self.trim = trim
        self.index = StackIndex(root_label)
        self._sites = SiteNumbers(self._number)

    def _number(self, stack: Stack) -> int:
        t = self.trim(stack)
        return -1 if not t else self.index.add(t)

    def numbers(self, snap: StoredSnapshot) -> np.ndarray:
        """The trimmed stack's number of every site of the snapshot's segment (-1: ignored or empty)."""
        return self._sites.of_snapshot(snap)

    def values(self, snap: StoredSnapshot, field: str) -> list[int]:
        """Bytes per stack number of one counter (sites with equal trimmed stacks add up)."""
        nums = self.numbers(snap)
        col = snap.column(field)
        keep = nums >= 0
        out = np.zeros(self.index.n_stacks, dtype=np.int64)
        np.add.at(out, nums[keep], col[keep])
        return out.tolist()

    def tree(self, snap: StoredSnapshot, field: str) -> IndexedTree:
        return self.index.tree(self.values(snap, field))


class LazyTree:
    """A snapshot's heap tree, built when a writer first reads it: Massif's culling drops most detailed
    snapshots of a long range before anyone looks at their trees."""

    def __init__(self, reader: StoreReader, ref: SnapshotRef, builder: TreeBuilder, peak: bool = False):
        self._reader = reader
        self._ref = ref
        self._builder = builder
        self._peak = peak
        self.root_label = builder.index.root_label
        self._tree: Tree | None = None

    def _built(self) -> Tree:
        if self._tree is None:
            try:
                snap = self._reader.load(self._ref)
                self._tree = self._builder.tree(snap, "peak_bytes" if self._peak else "cur_bytes")
            except SnapshotUnavailable:
                self._tree = StackIndex(self.root_label).tree([])  # an empty tree
        return self._tree

    @property
    def total(self) -> int:
        return self._built().total

    @property
    def n_stacks(self) -> int:
        return self._built().n_stacks

    @property
    def children(self) -> Mapping[str, TreeNode]:
        return self._built().children


@dataclass
class MassifSeries:
    snapshots: list[Snapshot]
    time_unit: str
    notes: list[str]


def massif_series(
    reader: StoreReader, sel: Selection, *, max_snapshots: int, detailed_freq: int
) -> MassifSeries:
    """Massif's snapshot series over the selected snapshots, culled to `max_snapshots` as Massif culls: every
    stored snapshot is offered in order, the peak (when it falls in the range) is the exact one, the last
    snapshot is the final, detailed state."""
    meta = reader.meta
    builder = TreeBuilder(Trimmer(meta.options), meta.root_label or HEAP_ROOT_LABEL)
    series = SnapshotSeries(detailed_freq=detailed_freq, max_snapshots=max_snapshots)
    refs = sel.refs
    notes = list(sel.notes)
    if not refs:
        return MassifSeries([], meta.time_unit, notes)
    last_time = None
    backwards = 0
    for ref in refs[:-1]:
        i = ref.info
        t = int(i["time"])
        if last_time is not None and t < last_time:
            backwards += 1
            continue
        last_time = t
        tree = LazyTree(reader, ref, builder) if series.next_kind(t) is SnapshotKind.DETAILED else None
        series.add(t, int(i["heap"]), int(i["extra"]), int(i["stacks"]), tree)
    if backwards:
        notes.append(f"{backwards} snapshots with a time before the previous one were left out")
    final = refs[-1]
    peak = final.peak
    if peak is not None and peak.time >= refs[0].time:
        # The first snapshot that knew this peak holds its tree in the sites' peak_bytes.
        holder = next((r for r in refs if r.peak == peak), final)
        series.set_peak(peak.time, peak.heap_B, peak.extra_B, peak.stacks_B,
                        LazyTree(reader, holder, builder, peak=True))
    elif peak is not None:
        notes.append("the profile's peak is before the range: no peak snapshot")
    fi = final.info
    ft = max(int(fi["time"]), last_time or 0)
    series.finish(ft, int(fi["heap"]), int(fi["extra"]), int(fi["stacks"]), LazyTree(reader, final, builder))
    return MassifSeries(series.snapshots, meta.time_unit, notes)


def load_at_end(reader: StoreReader, sel: Selection) -> StoredSnapshot | None:
    """The last readable snapshot of the selection."""
    for ref in reversed(sel.refs):
        try:
            return reader.load(ref)
        except SnapshotUnavailable:
            continue
    return None


# ---- differences ------------------------------------------------------------------------------------------


@dataclass
class DeltaNode:
    """A node of a tree of byte deltas: a frame and the change of all the stacks through it."""

    frame: Frame | None  # None for the root
    label: str
    bytes: int = 0
    blocks: int = 0
    children: dict[str, DeltaNode] = field(default_factory=dict)


@dataclass
class Diff:
    before: StoredSnapshot
    after: StoredSnapshot
    grew: DeltaNode
    shrank: DeltaNode
    new_sites: int
    gone_sites: int


def diff(before: StoredSnapshot, after: StoredSnapshot, trim: Trimmer, root_label: str) -> Diff:
    """The change of live bytes per trimmed stack between two snapshots, split in the stacks that grew and the
    ones that shrank, each merged into a tree (allocation site first, then its callers, as Massif's trees)."""
    numbers = StackNumbers(trim)
    a_bytes, a_blocks = numbers.live(before)
    b_bytes, b_blocks = numbers.live(after)
    n = len(numbers.stacks)
    a_bytes, a_blocks = (np.pad(x, (0, n - len(x))) for x in (a_bytes, a_blocks))
    d_bytes, d_blocks = b_bytes - a_bytes, b_blocks - a_blocks
    changed = np.flatnonzero((d_bytes != 0) | (d_blocks != 0))
    new_sites = int(np.count_nonzero((a_bytes[changed] == 0) & (b_bytes[changed] != 0)))
    gone_sites = int(np.count_nonzero((a_bytes[changed] != 0) & (b_bytes[changed] == 0)))
    grew = DeltaNode(None, root_label)
    shrank = DeltaNode(None, root_label)
    for k, db, dk in zip(changed.tolist(), d_bytes[changed].tolist(), d_blocks[changed].tolist(), strict=True):
        root = grew if db > 0 or (db == 0 and dk > 0) else shrank
        _add(root, numbers.stacks[k], db, dk)
    return Diff(before, after, grew, shrank, new_sites, gone_sites)


class StackNumbers(SiteNumbers):
    """Trimmed stacks numbered once for the sites of the snapshots' segments (a diff's two snapshots mostly
    share one), so that each snapshot's live bytes per trimmed stack are one pass over its counter columns.
    `stacks[k]` is trimmed stack number k; -1 is a site --ignore-fn leaves out."""

    def __init__(self, trim: Trimmer) -> None:
        super().__init__(self._number)
        self.trim = trim
        self.stacks: list[Stack] = []
        self._index: dict[Stack, int] = {}

    def _number(self, raw: Stack) -> int:
        t = self.trim(raw)
        if t is None:
            return -1
        k = self._index.get(t)
        if k is None:
            k = self._index[t] = len(self.stacks)
            self.stacks.append(t)
        return k

    def live(self, snap: StoredSnapshot) -> tuple[np.ndarray, np.ndarray]:
        """Live bytes and blocks per trimmed stack number (sites with equal trimmed stacks add up)."""
        nums = self.of_snapshot(snap)
        keep = nums >= 0
        out = []
        for field_name in ("cur_bytes", "cur_blocks"):
            total = np.zeros(len(self.stacks), dtype=np.int64)
            np.add.at(total, nums[keep], snap.column(field_name)[keep])
            out.append(total)
        return out[0], out[1]


def _add(root: DeltaNode, stack: Sequence[Frame], d_bytes: int, d_blocks: int) -> None:
    root.bytes += d_bytes
    root.blocks += d_blocks
    level = root.children
    for frame in stack:
        node = level.get(frame.label)
        if node is None:
            node = level[frame.label] = DeltaNode(frame, frame.label)
        node.bytes += d_bytes
        node.blocks += d_blocks
        level = node.children
