"""The web page's data (agent.export.webdata): timeline, pruned trees and diffs computed from model snapshots,
checked against sums taken independently from the same stacks."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.export.webdata import (
    OTHER_SITES,
    FlameNode,
    NoSuchSnapshot,
    SiteCache,
    SnapshotUnavailable,
    build_timeline,
    diff_snapshots,
    frame_name,
    memory_lookup,
    path_bytes,
    prune_tree,
    snapshot_id,
    snapshot_tree,
)
from agent.model.memline import MemoryLine, MemoryPoint
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import Frame, Stack
from agent.model.tree import HeapTree, StackIndex
from api.webmodels import diff_out, timeline_out, tree_out

MAIN = Frame(0x400100, "main", "prog.c", 50)


def site(i: int, caller: Frame = MAIN) -> Stack:
    return (Frame(0x401000 + 16 * i, f"fn{i}", "prog.c", 100 + i), caller)


def tree_of(stacks: dict[Stack, int]) -> HeapTree:
    return HeapTree.from_stacks(stacks)


def snap(time: int, stacks: dict[Stack, int] | None, total: int | None = None,
         kind: SnapshotKind = SnapshotKind.DETAILED) -> Snapshot:
    if stacks is None:
        return Snapshot(time, total or 0, 8, 0, None, SnapshotKind.NORMAL)
    t = tree_of(stacks)
    return Snapshot(time, t.total, 8, 0, t, kind)


def check_adds_up(node: FlameNode) -> None:
    """Every level of a pruned tree adds up: the children never exceed their parent."""
    assert sum(c.bytes for c in node.children) <= node.bytes, node.name
    for c in node.children:
        check_adds_up(c)


def count_kind(node: FlameNode, kind: str) -> int:
    return (node.kind == kind) + sum(count_kind(c, kind) for c in node.children)


def count(node: FlameNode) -> int:
    return 1 + sum(count(c) for c in node.children)


# ---- timeline -------------------------------------------------------------------------------------------


def test_timeline_has_a_point_per_snapshot_and_the_top_sites_sum_to_the_tree() -> None:
    first = {site(i): 1000 * (i + 1) for i in range(20)}
    second = {**first, site(3): 100_000}
    snaps = [snap(0, None, 0), snap(10, first), snap(20, None, 5000), snap(30, second, kind=SnapshotKind.PEAK)]
    tl = build_timeline(snaps, time_unit="ms", top=5)
    assert [p.index for p in tl.points] == [0, 1, 2, 3]
    assert [p.id for p in tl.points] == [f"{s.time}.0" for s in snaps]
    assert tl.points[0].sites is None and tl.points[2].sites is None
    # The top 5 by their largest bytes: fn3 (100,000 in the second), then fn19..fn16.
    assert tl.sites == [frame_name(site(3)[0])] + [frame_name(site(i)[0]) for i in (19, 18, 17, 16)] + [OTHER_SITES]
    for p, s in ((tl.points[1], snaps[1]), (tl.points[3], snaps[3])):
        assert p.sites is not None and s.tree is not None
        assert sum(p.sites) == s.tree.total
    assert tl.points[3].sites is not None and tl.points[3].sites[0] == 100_000
    assert tl.peak_index == 3
    assert tl.n_sites == 20


def test_timeline_without_a_peak_snapshot_marks_the_highest_point() -> None:
    snaps = [snap(0, None, 10), snap(5, None, 900), snap(9, None, 300)]
    assert build_timeline(snaps, time_unit="B").peak_index == 1


def test_memory_line_keeps_a_run_of_equal_figures_as_a_step() -> None:
    line = MemoryLine()
    for t in range(0, 100, 10):  # a sleeping target: the same figures every look
        line.add(MemoryPoint(t, 1000, 2000))
    assert [p.time for p in line.points()] == [0, 90] and len(line) == 2
    line.add(MemoryPoint(100, 1000, 3000))  # it moved: the step stays at 90, then the new figures
    line.add(MemoryPoint(110, 1000, 3000))
    assert [(p.time, p.rss) for p in line.points()] == [(0, 2000), (90, 2000), (100, 3000), (110, 3000)]
    line.add(MemoryPoint(105, 1, 1))  # before the held point: late
    assert line.n_late == 1
    assert line.at(95) == MemoryPoint(90, 1000, 2000)


def test_memory_line_is_looked_up_by_time() -> None:
    line = MemoryLine(capacity=4)
    for t in (0, 10, 20, 30, 40):  # the fifth point thins the line to every other
        line.add(MemoryPoint(t, 1000 + t, 2000 + t))
    assert [p.time for p in line.points()] == [0, 20, 40]
    assert line.n_thinned == 1
    line.add(MemoryPoint(35, 1, 1))  # late: dropped and counted
    assert line.n_late == 1
    look = memory_lookup(line.points())
    assert look is not None
    assert look(25) == MemoryPoint(20, 1020, 2020)
    assert look(-5) == MemoryPoint(0, 1000, 2000)
    snaps = [snap(0, None, 1), snap(25, None, 2)]
    tl = build_timeline(snaps, time_unit="ms", memory=look)
    assert [(p.mapped, p.rss) for p in tl.points] == [(1000, 2000), (1020, 2020)]
    assert memory_lookup([]) is None


# ---- trees ----------------------------------------------------------------------------------------------


def test_pruned_tree_keeps_the_biggest_nodes_and_sums_the_rest() -> None:
    stacks = {site(i): 10 + i for i in range(500)}
    stacks[site(1000)] = 1_000_000
    t = tree_of(stacks)
    root, n_nodes, merged = prune_tree(t, max_nodes=50, min_fraction=0.0)
    assert n_nodes == count(root)
    aggregates = count_kind(root, "other")
    assert n_nodes - aggregates == 50  # the budget (the root included), plus one aggregate per parent cut
    check_adds_up(root)
    assert root.bytes == t.total == sum(c.bytes for c in root.children)  # nothing lost at the sites' level
    assert root.children[0].name == "fn1000" and root.children[0].bytes == 1_000_000
    other = [c for c in root.children if c.kind == "other"]
    assert len(other) == 1
    kept = [c for c in root.children if c.kind == "frame"]
    assert other[0].name == f"({501 - len(kept)} smaller call sites)"
    assert other[0].bytes == sum(stacks.values()) - sum(c.bytes for c in kept)
    assert merged >= 501 - len(kept)


def test_pruned_tree_of_ten_thousand_sites_stays_small() -> None:
    index = StackIndex()
    stacks = [(Frame(0x500000 + 16 * i, f"site{i}", "big.c", i + 1), Frame(0x400000 + 16 * (i % 50), f"caller{i % 50}",
               "big.c", 20_000 + i % 50), MAIN) for i in range(10_000)]
    for s in stacks:
        index.add(s)
    t = index.tree([64 + (i % 97) for i in range(10_000)])
    root, n_nodes, merged = prune_tree(t)
    assert n_nodes <= 1000 + 1 + 1000  # nodes taken, plus at most one aggregate per parent
    check_adds_up(root)
    assert sum(c.bytes for c in root.children) == t.total
    assert merged > 0


def test_snapshot_tree_refuses_stale_ids_and_normal_snapshots() -> None:
    snaps = [snap(0, None, 0), snap(10, {site(1): 100})]
    good = snapshot_tree(snaps, snapshot_id(snaps, 1))
    assert good.root.children[0].name == "fn1" and good.root.children[0].file == "prog.c"
    with pytest.raises(SnapshotUnavailable):
        snapshot_tree(snaps, "11.0")  # no snapshot at that time (culled)
    with pytest.raises(SnapshotUnavailable):
        snapshot_tree(snaps, snapshot_id(snaps, 0))  # a normal snapshot has no tree
    with pytest.raises(NoSuchSnapshot):
        snapshot_tree(snaps, "nonsense")


def test_ids_survive_a_culling_around_them() -> None:
    snaps = [snap(0, None, 1), snap(10, None, 2), snap(10, {site(1): 7}), snap(30, {site(2): 9})]
    ids = [p.id for p in build_timeline(snaps, time_unit="B").points]
    assert ids == ["0.0", "10.0", "10.1", "30.0"]
    culled = [snaps[0], snaps[2], snaps[3]]  # the snapshot at index 1 went: later indices shifted
    assert snapshot_tree(culled, "30.0").root.children[0].name == "fn2"
    with pytest.raises(SnapshotUnavailable):
        snapshot_tree(culled, "10.1")  # now the only one at time 10 is "10.0"


# ---- diffs ----------------------------------------------------------------------------------------------


def test_diff_shows_the_growth_and_the_shrink() -> None:
    other_caller = Frame(0x400200, "loader", "prog.c", 70)
    before = {site(1): 1000, site(2): 5000, site(3): 700}
    after = {site(1): 1000, site(2): 2000, site(3, other_caller): 9000, site(4): 64}
    snaps = [snap(0, before), snap(1, None, 3), snap(5, after)]
    d = diff_snapshots(snaps, snapshot_id(snaps, 0), snapshot_id(snaps, 2))
    name = lambda i: frame_name(site(i)[0])  # noqa: E731
    assert [(c.name, c.before, c.after, c.delta) for c in d.sites_grew] == [
        (name(3), 700, 9000, 8300), (name(4), 0, 64, 64)]
    assert [(c.name, c.delta) for c in d.sites_shrank] == [(name(2), -3000)]
    assert d.grew == 8364 and d.shrank == 3000
    assert d.n_sites_changed == 3
    # By stack: fn3 under main went, fn3 under loader came.
    assert (d.stacks_grew[0].path, d.stacks_grew[0].delta) == ([name(3), frame_name(other_caller)], 9000)
    assert ([name(3), frame_name(MAIN)], -700) in [(c.path, c.delta) for c in d.stacks_shrank]
    with pytest.raises(SnapshotUnavailable):
        diff_snapshots(snaps, snapshot_id(snaps, 0), snapshot_id(snaps, 1))


def test_path_bytes_gives_each_stack_its_own_bytes() -> None:
    stacks = {site(1): 100, (MAIN,): 40, site(2): 60}
    assert path_bytes(tree_of(stacks)) == {
        (frame_name(site(1)[0]), "main (prog.c:50)"): 100,
        (frame_name(site(2)[0]), "main (prog.c:50)"): 60,
        ("main (prog.c:50)",): 40,
    }


def test_site_cache_computes_once_per_tree() -> None:
    cache = SiteCache(size=2)
    t = tree_of({site(1): 5})
    assert cache.sites(t) is cache.sites(t)
    for _ in range(3):
        cache.sites(tree_of({site(2): 1}))
    assert cache.sites(t) == {frame_name(site(1)[0]): 5}
    assert cache.paths(t) is cache.paths(t) and cache.paths(t) == path_bytes(t)


# ---- the API's models carry the same data as the dataclasses (the view file's JSON) --------------------


def test_pydantic_models_and_dataclasses_agree() -> None:
    snaps = [snap(0, {site(1): 10}), snap(10, {site(1): 30, site(2): 5}, kind=SnapshotKind.PEAK)]
    tl = build_timeline(snaps, time_unit="ms")
    assert timeline_out(tl, pid=1, command="c", state="exited").model_dump() == {
        **dataclasses.asdict(tl), "pid": 1, "command": "c", "state": "exited"}
    tree = snapshot_tree(snaps, snapshot_id(snaps, 1))
    assert tree_out(tree).model_dump() == dataclasses.asdict(tree)
    d = diff_snapshots(snaps, snapshot_id(snaps, 0), snapshot_id(snaps, 1))
    assert diff_out(d).model_dump() == dataclasses.asdict(d)
