"""The data the web page draws, computed from model snapshots: a timeline with the top sites' bytes, a snapshot's
tree pruned for a flame graph, and the diff of two snapshots.

Pure: the daemon's API serves these as JSON (api/routers/web.py), and `heapscope view` embeds the same objects
in a self-contained HTML file. Everything that grows with the number of sites is cut here, on the server side:
the timeline carries the top K sites (the rest summed), a tree at most N nodes (the smaller siblings summed into
one node per parent), a diff the top changes (the others counted), so the page stays fast with 10,000 sites.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.errors import UsageError
from agent.model.memline import MemoryPoint, point_at
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import Frame
from agent.model.tree import Tree, TreeNode

TOP_SITES = 12  # sites stacked in the timeline; the rest are one band
TREE_NODES = 1000  # nodes of a tree sent to the page
# Nodes under 0.01% of the snapshot are summed (a tenth of a pixel on a 1000 px graph: visible once zoomed in)
TREE_MIN_FRACTION = 0.0001
DIFF_ROWS = 40  # rows of each diff table (grew, shrank)
OTHER_SITES = "(other sites)"

Mode = Literal["exact", "sampled"]
NodeKind = Literal["root", "frame", "other", "below_threshold"]


class SnapshotUnavailable(UsageError):
    """A snapshot id that no longer names a kept snapshot (the series was culled), or one without a tree."""

    http_status = 409


class NoSuchSnapshot(UsageError):
    http_status = 404


# ---- names ----------------------------------------------------------------------------------------------


def is_below_threshold(frame: Frame) -> bool:
    """A node Massif wrote for the children under its threshold (`in N places, ...`), read back from a file."""
    return frame.address == 0 and (frame.function or "").startswith("in ") and "threshold" in (frame.function or "")


def frame_name(frame: Frame) -> str:
    """`function (file:line)`, `function (in /obj)` or `function`: a site without its address, so that the same
    code is one site across snapshots, runs and tools."""
    fn = frame.function or "???"
    if frame.file and frame.line:
        return f"{fn} ({frame.file}:{frame.line})"
    if frame.obj:
        return f"{fn} (in {frame.obj})"
    return fn


# ---- snapshot ids ---------------------------------------------------------------------------------------


def snapshot_ids(snaps: Sequence[Snapshot]) -> list[str]:
    """Opaque ids the page sends back: `TIME.N`, the Nth snapshot at that time (almost always .0). They name
    the same snapshot while the series is culled around it (an index would shift), and a culled one is refused
    (only among snapshots of one same time can a culling shift N). A history store may issue its own ids in
    the same field."""
    ids = []
    seen: dict[int, int] = {}
    for s in snaps:
        n = seen.get(s.time, 0)
        seen[s.time] = n + 1
        ids.append(f"{s.time}.{n}")
    return ids


def snapshot_id(snaps: Sequence[Snapshot], index: int) -> str:
    return snapshot_ids(snaps)[index]


def find_snapshot(snaps: Sequence[Snapshot], sid: str) -> tuple[int, Snapshot]:
    time_text, sep, n_text = sid.partition(".")
    try:
        int(time_text), int(n_text)
    except ValueError:
        raise NoSuchSnapshot(f"bad snapshot id {sid!r} (expected TIME.N from the timeline)") from None
    if not sep:
        raise NoSuchSnapshot(f"bad snapshot id {sid!r} (expected TIME.N from the timeline)")
    for index, other in enumerate(snapshot_ids(snaps)):
        if other == sid:
            return index, snaps[index]
    raise SnapshotUnavailable(f"snapshot {sid} is no longer kept (older snapshots are thinned out): reload")


# ---- the timeline ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelinePoint:
    id: str
    index: int
    time: int
    kind: str  # normal, detailed, peak
    heap: int  # useful bytes
    extra: int
    stacks: int
    mapped: int | None  # bytes mapped at that time, when known
    rss: int | None
    # Bytes of each of Timeline.sites (the last entry is the other sites), for snapshots with a tree.
    sites: list[int] | None


@dataclass(frozen=True)
class Timeline:
    time_unit: str
    mode: Mode
    estimate: bool  # sampled: every byte figure is an estimate
    sites: list[str]  # the top sites by their largest bytes in any snapshot, then OTHER_SITES
    points: list[TimelinePoint]
    peak_index: int | None  # the peak snapshot, or the point of most heap + extra + stacks
    n_sites: int  # distinct sites in the snapshots' trees


class SiteCache:
    """Bytes per site and per stack of a snapshot's tree, computed once per tree: the live page asks for the
    timeline every second, and a tree of 10,000 sites costs milliseconds to sum by site and a few hundred to
    walk by stack. Keeps the trees it describes alive, so an id() is never reused while cached."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._items: OrderedDict[tuple[int, str], tuple[Tree, dict[Any, int]]] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, tree: Tree, what: str, compute: Callable[[Tree], dict[Any, int]]) -> dict[Any, int]:
        key = (id(tree), what)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and hit[0] is tree:
                self._items.move_to_end(key)
                return hit[1]
        out = compute(tree)
        with self._lock:
            self._items[key] = (tree, out)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return out

    def sites(self, tree: Tree) -> dict[str, int]:
        return self._get(tree, "sites", site_bytes)

    def paths(self, tree: Tree) -> dict[tuple[str, ...], int]:
        return self._get(tree, "paths", path_bytes)


def site_bytes(tree: Tree) -> dict[str, int]:
    """Bytes per site (the first level of the tree, Massif's allocation sites), by name."""
    out: dict[str, int] = {}
    for node in tree.children.values():
        name = frame_name(node.frame)
        out[name] = out.get(name, 0) + max(node.bytes, 0)
    return out


def memory_lookup(points: Sequence[MemoryPoint]) -> Callable[[int], MemoryPoint | None] | None:
    """A lookup by time over sampled memory points (None when there are none)."""
    if not points:
        return None
    times = [p.time for p in points]
    return lambda t: point_at(points, times, t)


def build_timeline(
    snaps: Sequence[Snapshot],
    *,
    time_unit: str,
    mode: Mode = "exact",
    memory: Callable[[int], MemoryPoint | None] | None = None,
    top: int = TOP_SITES,
    cache: SiteCache | None = None,
) -> Timeline:
    per_snap: list[dict[str, int] | None] = []
    biggest: dict[str, int] = {}
    for s in snaps:
        if s.tree is None:
            per_snap.append(None)
            continue
        sites = cache.sites(s.tree) if cache is not None else site_bytes(s.tree)
        per_snap.append(sites)
        for name, b in sites.items():
            if b > biggest.get(name, -1):
                biggest[name] = b
    ranked = sorted(biggest, key=lambda n: (-biggest[n], n))[:top]
    points = []
    ids = snapshot_ids(snaps)
    for i, (s, by_site) in enumerate(zip(snaps, per_snap, strict=True)):
        row = None
        if by_site is not None and s.tree is not None:
            row = [by_site.get(n, 0) for n in ranked]
            row.append(max(s.tree.total - sum(row), 0))
        mem = memory(s.time) if memory is not None else None
        points.append(
            TimelinePoint(
                id=ids[i], index=i, time=s.time, kind=str(s.kind), heap=max(s.heap_B, 0),
                extra=max(s.heap_extra_B, 0), stacks=max(s.stacks_B, 0),
                mapped=None if mem is None else mem.mapped, rss=None if mem is None else mem.rss, sites=row,
            )
        )
    peak = next((i for i, s in enumerate(snaps) if s.kind is SnapshotKind.PEAK), None)
    if peak is None and snaps:
        peak = max(range(len(snaps)), key=lambda i: snaps[i].total_B)
    return Timeline(
        time_unit=time_unit, mode=mode, estimate=mode == "sampled", sites=[*ranked, OTHER_SITES], points=points,
        peak_index=peak, n_sites=len(biggest),
    )


# ---- a snapshot's tree, pruned --------------------------------------------------------------------------


@dataclass
class FlameNode:
    name: str  # `function` (or the root's / an aggregate's label)
    file: str | None
    line: int | None
    obj: str | None
    address: int | None
    bytes: int
    kind: NodeKind
    children: list[FlameNode] = field(default_factory=list)


@dataclass(frozen=True)
class SnapshotTree:
    id: str
    index: int
    time: int
    kind: str
    heap: int
    extra: int
    stacks: int
    estimate: bool
    root: FlameNode
    n_nodes: int  # nodes sent (aggregates included)
    n_merged: int  # tree nodes summed into "(N smaller ...)" aggregates


def _flame(frame: Frame, nbytes: int) -> FlameNode:
    if is_below_threshold(frame):
        return FlameNode(frame.function or "", None, None, None, None, nbytes, "below_threshold")
    return FlameNode(frame.function or "???", frame.file, frame.line, frame.obj, frame.address, nbytes, "frame")


def prune_tree(
    tree: Tree, *, max_nodes: int = TREE_NODES, min_fraction: float = TREE_MIN_FRACTION
) -> tuple[FlameNode, int, int]:
    """The biggest nodes of `tree`, best first, until `max_nodes` are taken or the next is under
    `min_fraction` of the total. Where some of a parent's children were taken, the others become one node
    `(N smaller call sites)` with their bytes summed, so every level still adds up; a node none of whose
    children was taken stands for its whole subtree. Returns the root, the nodes sent and the tree nodes
    left out (summed into an aggregate or into their parent)."""
    root = FlameNode(tree.root_label, None, None, None, None, max(tree.total, 0), "root")
    min_bytes = max(1, int(tree.total * min_fraction))
    seq = 0
    # (-bytes, seq, node, the parent's FlameNode); a parent's untaken children are counted in `pending`.
    frontier: list[tuple[int, int, TreeNode, FlameNode]] = []
    pending: dict[int, list[int]] = {}  # id(parent FlameNode) -> [children left, their bytes]
    parents: dict[int, FlameNode] = {}

    def offer(children: Mapping[str, TreeNode], parent: FlameNode) -> None:
        nonlocal seq
        if not children:
            return
        acc = pending.setdefault(id(parent), [0, 0])
        parents[id(parent)] = parent
        for node in children.values():
            b = max(node.bytes, 0)
            acc[0] += 1
            acc[1] += b
            heapq.heappush(frontier, (-b, seq, node, parent))
            seq += 1

    offer(tree.children, root)
    taken = 1
    while frontier and taken < max_nodes:
        neg, _, node, parent = heapq.heappop(frontier)
        if -neg < min_bytes:
            break
        out = _flame(node.frame, -neg)
        parent.children.append(out)
        acc = pending[id(parent)]
        acc[0] -= 1
        acc[1] -= -neg
        taken += 1
        offer(node.children, out)
    merged = 0
    for pid, (count, nbytes) in pending.items():
        if count <= 0:
            continue
        merged += count
        if nbytes <= 0 or not parents[pid].children:
            continue  # zero-byte sites (freed), or a subtree left whole: nothing to add
        label = f"({count} smaller call site{'s' if count > 1 else ''})"
        parents[pid].children.append(FlameNode(label, None, None, None, None, nbytes, "other"))
        taken += 1
    return root, taken, merged


def snapshot_tree(
    snaps: Sequence[Snapshot], sid: str, *, mode: Mode = "exact", max_nodes: int = TREE_NODES,
    min_fraction: float = TREE_MIN_FRACTION,
) -> SnapshotTree:
    index, snap = find_snapshot(snaps, sid)
    if snap.tree is None:
        raise SnapshotUnavailable(
            f"snapshot {sid} is a normal one: Massif keeps a tree only for detailed snapshots and the peak"
        )
    root, n_nodes, merged = prune_tree(snap.tree, max_nodes=max_nodes, min_fraction=min_fraction)
    return SnapshotTree(
        id=sid, index=index, time=snap.time, kind=str(snap.kind), heap=max(snap.heap_B, 0),
        extra=max(snap.heap_extra_B, 0), stacks=max(snap.stacks_B, 0), estimate=mode == "sampled", root=root,
        n_nodes=n_nodes, n_merged=merged,
    )


# ---- the diff of two snapshots --------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    name: str  # the site (`function (file:line)`), or the path's innermost frame
    path: list[str]  # site first, then its callers outwards (one entry for a site row)
    before: int
    after: int
    delta: int


@dataclass(frozen=True)
class SnapshotRef:
    id: str
    index: int
    time: int
    kind: str
    heap: int


@dataclass(frozen=True)
class Diff:
    a: SnapshotRef
    b: SnapshotRef
    estimate: bool
    grew: int  # bytes of the sites that grew, summed
    shrank: int  # bytes of the sites that shrank, summed (positive)
    sites_grew: list[Change]
    sites_shrank: list[Change]
    stacks_grew: list[Change]
    stacks_shrank: list[Change]
    n_sites_changed: int  # sites that changed (the tables show the top DIFF_ROWS of each way)
    n_stacks_changed: int


def path_bytes(tree: Tree) -> dict[tuple[str, ...], int]:
    """The bytes of the stacks that end at each node (its bytes less its children's), by path of names from
    the site outwards. Zero entries are left out."""
    out: dict[tuple[str, ...], int] = {}
    work: list[tuple[TreeNode, tuple[str, ...]]] = [(n, ()) for n in tree.children.values()]
    while work:
        node, above = work.pop()
        path = (*above, frame_name(node.frame))
        kids = node.children
        own = node.bytes - sum(k.bytes for k in kids.values())
        if own > 0:
            out[path] = out.get(path, 0) + own
        work.extend((k, path) for k in kids.values())
    return out


def _changes(
    before: Mapping[tuple[str, ...], int], after: Mapping[tuple[str, ...], int], rows: int
) -> tuple[list[Change], list[Change], int]:
    deltas = []
    for key in before.keys() | after.keys():
        a, b = before.get(key, 0), after.get(key, 0)
        if a != b:
            deltas.append((b - a, key, a, b))
    grew = heapq.nlargest(rows, (d for d in deltas if d[0] > 0), key=lambda d: (d[0], d[1]))
    shrank = heapq.nsmallest(rows, (d for d in deltas if d[0] < 0), key=lambda d: (d[0], d[1]))

    def change(d: tuple[int, tuple[str, ...], int, int]) -> Change:
        delta, key, a, b = d
        return Change(name=key[0], path=list(key), before=a, after=b, delta=delta)

    return [change(d) for d in grew], [change(d) for d in shrank], len(deltas)


def _ref(snaps: Sequence[Snapshot], index: int, s: Snapshot) -> SnapshotRef:
    return SnapshotRef(id=snapshot_id(snaps, index), index=index, time=s.time, kind=str(s.kind), heap=max(s.heap_B, 0))


def diff_snapshots(
    snaps: Sequence[Snapshot], a_id: str, b_id: str, *, mode: Mode = "exact", rows: int = DIFF_ROWS,
    cache: SiteCache | None = None,
) -> Diff:
    """What grew and what shrank from snapshot a to snapshot b (both with a tree), by site and by stack."""
    ia, sa = find_snapshot(snaps, a_id)
    ib, sb = find_snapshot(snaps, b_id)
    for sid, s in ((a_id, sa), (b_id, sb)):
        if s.tree is None:
            raise SnapshotUnavailable(f"snapshot {sid} has no tree (a normal snapshot): pick detailed ones or the peak")
    assert sa.tree is not None and sb.tree is not None
    sites_a = cache.sites(sa.tree) if cache is not None else site_bytes(sa.tree)
    sites_b = cache.sites(sb.tree) if cache is not None else site_bytes(sb.tree)
    site_rows_a: dict[tuple[str, ...], int] = {(k,): v for k, v in sites_a.items()}
    site_rows_b: dict[tuple[str, ...], int] = {(k,): v for k, v in sites_b.items()}
    grew, shrank, n_sites = _changes(site_rows_a, site_rows_b, rows)
    all_site_deltas = [site_rows_b.get(k, 0) - site_rows_a.get(k, 0) for k in site_rows_a.keys() | site_rows_b.keys()]
    paths_a = cache.paths(sa.tree) if cache is not None else path_bytes(sa.tree)
    paths_b = cache.paths(sb.tree) if cache is not None else path_bytes(sb.tree)
    st_grew, st_shrank, n_stacks = _changes(paths_a, paths_b, rows)
    return Diff(
        a=_ref(snaps, ia, sa), b=_ref(snaps, ib, sb), estimate=mode == "sampled",
        grew=sum(d for d in all_site_deltas if d > 0), shrank=-sum(d for d in all_site_deltas if d < 0),
        sites_grew=grew, sites_shrank=shrank, stacks_grew=st_grew, stacks_shrank=st_shrank,
        n_sites_changed=n_sites, n_stacks_changed=n_stacks,
    )
