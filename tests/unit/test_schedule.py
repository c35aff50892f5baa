"""The snapshot schedule's user-space side: SnapshotSeries' points, their trees and peak points, PointFeed, and
SiteLog, which rebuilds every site's value at any point from the kernel's snapshot log.

The kernel's side (probes/heap.bpf.c schedule_check, schedule_peak_check) is modelled here by `KernelModel`, line
for line in B: the due time, the peak level, the guess after a culling and the wake-up. The reference is Massif's
own rule applied at every event (ms_main.c maybe_take_snapshot: a peak snapshot before a free that comes down
from above the last peak plus --peak-inaccuracy, a normal one after any event once the minimum interval has
passed), with the series' culling. The real kernel and real Massif meet in tests/integration/test_schedule_massif.py.
"""

from __future__ import annotations

import io
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.export.massif import write_massif
from agent.model.schedule import PointFeed, SiteLog, SiteValues
from agent.model.snapshot import Snapshot, SnapshotKind, SnapshotSeries
from agent.model.tree import HeapTree

PEAK = 1  # the kind of a peak point (probes/heap.h HS_SCHED_PEAK)
ADMIN = 8
PPM = 10_000  # --peak-inaccuracy=1.0


def tree() -> HeapTree:
    return HeapTree()


@dataclass
class Event:
    """One allocator call, as the kernel accounts it: the B time and totals before and after it."""

    t_before: int
    heap_before: int
    extra_before: int
    t_after: int
    heap_after: int
    extra_after: int
    comes_down: bool  # a free, or a realloc that shrinks its block: Massif looks for a peak before it


def events(n: int, seed: int) -> list[Event]:
    """A heap that grows, churns and shrinks, with Massif's extra bytes (16-byte rounding plus admin)."""
    rng = random.Random(seed)
    live: list[int] = []
    heap = extra = t = 0
    out = []
    for i in range(n):
        phase = i * 3 // n  # grow, churn, shrink
        free = bool(live) and (phase == 2 or (phase == 1 and rng.random() < 0.5) or rng.random() < 0.1)
        if free:
            size = live.pop(rng.randrange(len(live)))
            sign = -1
        else:
            size = rng.choice([1, 8, 16, 24, 40, 100, 1000, 4000]) + rng.randrange(64)
            live.append(size)
            sign = 1
        ex = (-size) % 16 + ADMIN
        before = (t, heap, extra)
        heap += sign * size
        extra += sign * ex
        t += size + ex
        out.append(Event(*before, t, heap, extra, comes_down=free))
    return out


def massif_reference(evs: list[Event], max_snapshots: int) -> SnapshotSeries:
    """Massif's decisions at every event, recorded through the same series (its culling is Massif's)."""
    s = SnapshotSeries(detailed_freq=10**6, max_snapshots=max_snapshots)
    s.add(0, 0, 0, 0)  # the startup snapshot
    peak_level = 0
    for e in evs:
        total = e.heap_before + e.extra_before
        if e.comes_down and total > peak_level:
            peak_level = total + total * PPM // 1_000_000
            s.add_peak_point(e.t_before, e.heap_before, e.extra_before, 0)
        s.add_point(e.t_after, e.heap_after, e.extra_after, 0)
    return s


@dataclass
class KernelModel:
    """probes/heap.bpf.c's schedule in B: control words and the points it sends."""

    max_snapshots: int
    due: int = 0
    peak_level: int = 0
    interval: int = 0
    cull_at: int = 0
    n_points: int = 0
    signalled: int = 0
    woken: bool = False
    pending: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cull_at = self.max_snapshots - 1  # HeapProbes.start_schedule

    def _interval(self, t: int) -> int:
        if not self.cull_at or self.n_points + 1 < self.cull_at:
            return self.interval
        if self.signalled != self.cull_at:
            self.signalled = self.cull_at
            self.woken = True
        return max(self.interval, t // self.max_snapshots)

    def _send(self, point: tuple[int, int, int, int]) -> None:
        self.pending.append((*point, self.n_points))  # numbered from 0 (its epoch)
        self.n_points += 1

    def event(self, e: Event) -> None:
        if e.comes_down:
            total = e.heap_before + e.extra_before
            if total > self.peak_level:
                self.peak_level = total + total * PPM // 1_000_000
                self.due = e.t_before + self._interval(e.t_before)
                self._send((e.t_before, e.heap_before, e.extra_before, PEAK))
        if e.t_after >= self.due:
            self.due = e.t_after + self._interval(e.t_after)
            self._send((e.t_after, e.heap_after, e.extra_after, 0))

    def drain(self) -> list[tuple[int, int, int, int, int]]:
        out, self.pending = self.pending, []
        return out


def steer(kernel: KernelModel, feed: PointFeed, steered: list[int]) -> None:
    """Session._steer: the interval, the next culling, and after a culling the due time, when the kernel sent
    nothing unseen. `steered`: the series' cullings when the due time was last given."""
    k = feed.kernel_schedule()
    kernel.interval, kernel.cull_at = k.interval, k.cull_at
    if feed.series.n_cullings != steered[0] and kernel.n_points == feed.n_points and k.due is not None:
        kernel.due = k.due
        steered[0] = feed.series.n_cullings


def run_kernel(evs: list[Event], max_snapshots: int, drain_every: int | None) -> SnapshotSeries:
    """The kernel model and the feed. drain_every=None: user space answers every wake-up before the next event
    (run mode, B: the target is stopped); else it drains only every so many events (attach, or ms)."""
    series = SnapshotSeries(detailed_freq=10**6, max_snapshots=max_snapshots)
    feed = PointFeed(series, peak_kind=PEAK)
    kernel = KernelModel(max_snapshots)
    series.add(0, 0, 0, 0)  # the first tick
    steered = [0]
    steer(kernel, feed, steered)
    for i, e in enumerate(evs):
        kernel.event(e)
        tick = drain_every is not None and i % drain_every == drain_every - 1
        if (kernel.woken and drain_every is None) or tick:
            kernel.woken = False
            feed.feed(kernel.drain(), 0)
            steer(kernel, feed, steered)
    feed.feed(kernel.drain(), 0)
    return series


def shape(s: SnapshotSeries) -> list[tuple[int, int, int, str]]:
    return [(x.time, x.heap_B, x.heap_extra_B, x.kind.value) for x in s.snapshots]


@pytest.mark.parametrize(("n", "seed", "max_snapshots"), [(3000, 1, 100), (20000, 2, 100), (5000, 3, 20)])
def test_points_in_the_loop_are_massifs_snapshots(n: int, seed: int, max_snapshots: int) -> None:
    """With user space answering each culling before the next event, the series is exactly Massif's: the same
    snapshots (times, totals, peaks), taken, culled and kept alike."""
    evs = events(n, seed)
    ref = massif_reference(evs, max_snapshots)
    got = run_kernel(evs, max_snapshots, drain_every=None)
    assert ref.n_cullings >= 3  # the case exercises the culling
    assert ref.n_peaks_taken >= 3
    assert shape(got) == shape(ref)
    assert (got.n_taken, got.n_peaks_taken, got.n_cullings) == (ref.n_taken, ref.n_peaks_taken, ref.n_cullings)


@pytest.mark.parametrize("drain_every", [50, 500, 5000])
def test_points_drained_late_stay_close_and_exact(drain_every: int) -> None:
    """Drained only now and then, the kernel guesses the interval after each culling: the series takes about as
    many snapshots as Massif (within 25%), and each is the exact state after (or, for peaks, before) an
    event."""
    evs = events(20000, 4)
    ref = massif_reference(evs, 100)
    got = run_kernel(evs, 100, drain_every=drain_every)
    assert abs(got.n_taken - ref.n_taken) <= 0.25 * ref.n_taken
    assert got.n_peaks_taken == ref.n_peaks_taken  # peak points never wait for user space
    states = {(e.t_after, e.heap_after, e.extra_after) for e in evs}
    states |= {(e.t_before, e.heap_before, e.extra_before) for e in evs}
    for x in got.snapshots:
        assert (x.time, x.heap_B, x.heap_extra_B) in states


def test_a_point_the_frequency_falls_on_is_detailed_with_its_tree_to_come() -> None:
    """Massif's count: every detailed_freq-th snapshot is detailed, and the count starts again there. The point's
    tree comes later (give_tree), the point's own time and totals stay; the tree's left-out bytes (--ignore-fn)
    come off its totals."""
    s = SnapshotSeries(detailed_freq=3, max_snapshots=100)
    s.add(0, 0, 0, 0)
    a = s.add_point(10, 1, 8, 0)
    assert a is not None and a.kind is SnapshotKind.NORMAL and not a.tree_pending
    p = s.add_point(20, 2, 8, 0)  # the third
    assert p is not None and p.kind is SnapshotKind.DETAILED and p.tree is None and p.tree_pending
    q = s.add_point(30, 3, 8, 0)  # the count started again
    assert q is not None and q.kind is SnapshotKind.NORMAL
    s.give_tree(p, tree(), ignored_heap_B=1, ignored_extra_B=8)
    assert p.tree is not None and not p.tree_pending and (p.time, p.heap_B, p.heap_extra_B) == (20, 1, 0)
    assert [x.time for x in s.snapshots] == [0, 10, 20, 30]
    r = s.add_point(40, 4, 8, 0)
    assert r is not None and r.kind is SnapshotKind.NORMAL
    assert s.add_point(50, 5, 8, 0) is not None and s.snapshots[-1].kind is SnapshotKind.DETAILED


def test_a_missed_tree_takes_a_later_state_in_the_latest_points_place_and_is_dropped_elsewhere() -> None:
    """The snapshot log lost records: the latest point gives its place to the state of the tick, with its tree,
    and the schedule goes on from the point's time; an earlier one stays a normal snapshot; a peak stays the
    peak."""
    s = SnapshotSeries(detailed_freq=1, max_snapshots=100)
    s.add(0, 0, 0, 0, tree())
    p = s.add_point(10, 1, 8, 0)
    peak = s.add_peak_point(12, 2, 8, 0)
    q = s.add_point(20, 1, 8, 0)
    assert p is not None and q is not None and p.tree_pending and peak.tree_pending and q.tree_pending
    assert s.tree_missed(p, 25, 3, 8, 0, tree()) is None
    assert p.kind is SnapshotKind.NORMAL and p.tree is None and not p.tree_pending
    assert s.tree_missed(peak, 25, 3, 8, 0, tree()) is None and peak.kind is SnapshotKind.PEAK
    new = s.tree_missed(q, 25, 3, 8, 0, tree())
    assert new is not None and new.kind is SnapshotKind.DETAILED and s.snapshots[-1] is new
    assert (new.time, new.scheduled_at, s.last_time, s.latest_time) == (25, 20, 20, 25)
    with pytest.raises(ValueError, match="backwards"):
        s.add_point(21, 5, 8, 0)  # after the replaced point, before the tick's time: the file would go back
    assert s.add_point(25, 5, 8, 0) is not None


def test_a_point_read_after_a_missed_trees_later_state_is_counted_late_and_the_file_stays_in_order() -> None:
    """The target's thread took a point's time in the kernel while the tick read the counters, and put the point
    in the ring after a missed tree had been replaced by the tick's own, later, state."""
    s = SnapshotSeries(detailed_freq=3, max_snapshots=100)
    feed = PointFeed(s, to_time=lambda ns: ns // 1_000_000, peak_kind=PEAK)
    s.add(0, 0, 0, 0)
    assert feed.feed([(10_000_000, 1, 8, 0, 0), (20_000_000, 2, 8, 0, 1)], 0) == 2
    [(owed, epoch)] = feed.take_owed()
    assert owed.time == 20 and epoch == 1
    assert s.tree_missed(owed, 30, 3, 8, 0, tree()) is not None
    assert feed.feed([(25_000_000, 9, 8, 0, 2), (31_000_000, 4, 8, 0, 3)], 0) == 1 and feed.n_late == 1
    assert [x.time for x in s.snapshots] == [0, 10, 30, 31]
    out = io.StringIO()
    write_massif(out, s.snapshots, desc=[], cmd="t", time_unit="ms", threshold=1.0)  # raises if out of order
    assert out.getvalue().count("snapshot=") == 4


def test_feed_owes_the_trees_of_detailed_and_peak_points_with_their_epochs() -> None:
    s = SnapshotSeries(detailed_freq=2, max_snapshots=10)
    feed = PointFeed(s, peak_kind=PEAK)
    s.add(0, 0, 0, 0)
    assert feed.feed([(10, 1, 0, 0, 0), (20, 2, 0, PEAK, 1), (30, 1, 0, 0, 2), (40, 2, 0, 0, 3)], 0) == 4
    assert [(x.time, e) for x, e in feed.take_owed()] == [(10, 0), (20, 1), (40, 3)]
    assert feed.take_owed() == [] and feed.next_epoch == 4
    for t in range(5, 10):  # the 10th snapshot culls: owed snapshots culled meanwhile are not owed any more
        feed.feed([(t * 10, t, 0, 0, t - 1)], 0)
    owed = feed.take_owed()
    assert s.n_cullings == 1 and all(s.holds(x) for x, _ in owed)
    assert len(owed) < 3 and feed.next_epoch == 9

def test_peak_points_follow_massif() -> None:
    """A peak point is taken whatever the interval, is the one uncullable peak (the previous turns normal),
    resets the detailed count, and the next snapshot is due an interval after it."""
    s = SnapshotSeries(detailed_freq=2, max_snapshots=10)
    s.add(0, 0, 0, 0)
    for t in range(1, 9):
        s.add_point(t * 10, t, 0, 0)
    assert s.n_cullings == 0 and len(s) == 9
    first = s.add_peak_point(80, 9, 0, 0)  # the 10th snapshot: culls
    assert s.n_cullings == 1 and first in s.snapshots and s.peak is first
    interval = s.min_time_interval
    assert interval > 0
    assert s.add_point(80 + interval - 1, 1, 0, 0) is None  # too soon after the peak
    second = s.add_peak_point(80 + interval - 1, 10, 0, 0)  # a peak is taken anyway
    assert s.peak is second and first.kind is SnapshotKind.DETAILED  # Massif's old peak keeps its tree
    assert s.next_kind(10**6) is SnapshotKind.NORMAL  # the peak counted as the detailed one
    assert s.n_peaks_taken == 2


def test_set_peak_takes_a_peak_points_place() -> None:
    s = SnapshotSeries(detailed_freq=10, max_snapshots=100)
    s.add(0, 0, 0, 0)
    s.add_peak_point(40, 100, 8, 0)
    s.add_point(50, 60, 8, 0)
    exact = s.set_peak(40, 100, 8, 0, tree())  # the same instant: replaces the tree-less peak point
    assert exact is not None and exact.tree is not None
    assert [x.time for x in s.snapshots] == [0, 40, 50] and s.peak is exact
    t = SnapshotSeries(detailed_freq=10, max_snapshots=100)
    t.add(0, 0, 0, 0)
    point = t.add_peak_point(40, 100, 8, 0)
    later = t.set_peak(45, 101, 8, 0, tree())  # another instant: the point stays, as the normal one it is
    assert later is not None and point.kind is SnapshotKind.NORMAL
    assert [x.time for x in t.snapshots] == [0, 40, 45]
    u = SnapshotSeries(detailed_freq=10, max_snapshots=100)
    u.add(0, 0, 0, 0)
    u.add_peak_point(40, 100, 8, 0)  # the kernel's totals count --ignore-fn allocations
    lower = u.set_peak(40, 90, 8, 0, tree())  # the exact peak without them: still the one peak, with a tree
    assert lower is not None and u.peak is lower and len(u) == 2


def test_feed_converts_times_counts_late_points_and_steers() -> None:
    s = SnapshotSeries(detailed_freq=10, max_snapshots=10)
    feed = PointFeed(s, to_time=lambda ns: ns // 1_000_000, peak_kind=PEAK)
    s.add(0, 0, 0, 0)
    k = feed.kernel_schedule()
    assert (k.interval, k.cull_at, k.due) == (0, 9, 0)
    assert feed.feed([(1_500_000, 1, 0, 0, 0), (2_000_000, 2, 0, PEAK, 1), (3_000_000, 3, 0, 0, 2)], 7) == 3
    assert [(x.time, x.stacks_B) for x in s.snapshots] == [(0, 0), (1, 7), (2, 7), (3, 7)]
    assert s.peak is not None and s.peak.time == 2
    s.add_point(5, 4, 0, 0)
    assert feed.feed([(4_000_000, 9, 0, 0, 3)], 0) == 0 and feed.n_late == 1  # before the latest snapshot
    assert feed.n_points == 4
    k = feed.kernel_schedule()
    assert k.cull_at == 4 + (10 - len(s)) and k.due == 5 + s.min_time_interval


def test_site_log_gives_every_sites_values_at_every_point() -> None:
    """probes/heap.bpf.c site_touch, modelled: before a site changes, if it has not changed since the latest
    point, a record of its values; a point bumps the epoch. Reading the sites and then the log at random moments,
    the values at every point read since are the values the sites had at that point, new sites (0 before their
    first allocation) and a racing CPU's second record in one epoch (the first one counts) included."""
    rng = random.Random(11)
    values: list[list[int]] = []  # per site: bytes, extra, allocs
    stamps: list[int] = []
    ring: list[tuple[int, int, int, int, int]] = []
    truth: dict[int, SiteValues] = {}
    epoch = 0
    log = SiteLog()
    owed: list[int] = []
    checked = 0
    for _ in range(20000):
        r = rng.random()
        if r < 0.02 or not values:
            values.append([0, 0, 0])
            stamps.append(0)
        elif r < 0.1:  # a point
            truth[epoch] = SiteValues(*(list(col) for col in zip(*values, strict=True)))
            owed.append(epoch)
            epoch += 1
        elif r < 0.12:  # user space: the sites, then the log
            now = SiteValues(*(list(col) for col in zip(*values, strict=True)))
            log.add(ring)
            ring = []
            got = log.values_at(owed, now)
            for k in owed:
                n = len(truth[k].bytes)
                assert got[k].bytes[:n] == truth[k].bytes and got[k].allocs[:n] == truth[k].allocs
                assert got[k].extra[:n] == truth[k].extra
                assert not any(got[k].allocs[n:])  # sites made after the point: not allocated then
                checked += 1
            owed = []
            log.forget(epoch)
        else:  # an allocation or a free at one site
            site = rng.randrange(len(values))
            v = values[site]
            if stamps[site] != epoch:
                stamps[site] = epoch
                ring.append((site, epoch, *v))
                if rng.random() < 0.05:  # another CPU's change raced the stamp: its record comes second
                    ring.append((site, epoch, v[0] + 7, v[1], v[2] + 1))
            size = rng.randrange(1, 100)
            if v[0] >= size and rng.random() < 0.4:
                v[0] -= size
                v[1] -= 8
            else:
                v[0] += size
                v[1] += 8
                v[2] += 1
    assert checked > 1000 and len(log) < 200


def test_site_log_leaves_out_sites_beyond_the_read_and_keeps_what_later_points_need() -> None:
    log = SiteLog()
    log.add([(0, 1, 5, 8, 1), (3, 1, 0, 0, 0), (0, 2, 9, 16, 2)])
    now = SiteValues([12, 0], [24, 0], [3, 0])
    got = log.values_at([0, 1, 2], now)
    assert got[0].bytes == [5, 0] and got[1].bytes == [9, 0] and got[2].bytes == [12, 0]
    log.forget(1)  # points from 1 on are read yet: the record of epoch 1 serves only point 0
    assert len(log) == 1 and log.values_at([1], now)[1].allocs == [2, 0]


def massif_cull(snaps: list[Snapshot], max_snapshots: int) -> list[Snapshot]:
    """ms_main.c cull_snapshots' choice, as Massif makes it: max_snapshots/2 times, scan for the snapshot whose
    neighbours are closest (the first on a tie; never the first, the last or the peak) and remove it."""
    snaps = list(snaps)
    for _ in range(max_snapshots // 2):
        best = -1
        best_span = 0
        for j in range(1, len(snaps) - 1):
            span = snaps[j + 1].time - snaps[j - 1].time
            if snaps[j].kind is not SnapshotKind.PEAK and (best < 0 or span < best_span):
                best, best_span = j, span
        if best < 0:
            break
        del snaps[best]
    return snaps


def test_culling_removes_what_massifs_scan_removes() -> None:
    """SnapshotSeries culls with a heap of spans (it runs while the target waits): the same snapshots go as in
    Massif's scan, ties (equal times, equal spans) and the peak included."""
    rng = random.Random(7)
    for _ in range(2000):
        m = rng.choice([10, 11, 20, 100])
        t = 0
        snaps = []
        for _ in range(m):
            t += rng.choice([0, 0, 1, 2, 3, 5, 8, 100, rng.randrange(1000)])
            snaps.append(Snapshot(t, 0, 0, 0, None, SnapshotKind.NORMAL))
        if rng.random() < 0.5:
            snaps[rng.randrange(m)].kind = SnapshotKind.PEAK
        s = SnapshotSeries(detailed_freq=10, max_snapshots=m)
        for x in snaps:
            if x.kind is SnapshotKind.PEAK:
                s.add_peak_point(x.time, 0, 0, 0)
            else:
                s.add_point(x.time, 0, 0, 0)
        kept = [(x.time, x.kind is SnapshotKind.PEAK) for x in s.snapshots]
        assert kept == [(x.time, x.kind is SnapshotKind.PEAK) for x in massif_cull(snaps, m)]


def test_jiffy_length_from_two_readings_of_timer_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ms schedule skips the clock until the jiffy before the due time: the jiffy's length is measured from
    /proc/timer_list and rounded to a rate Linux offers; unreadable, it is 0 (the clock is read always)."""
    import agent.kernel.probes as kp

    timer_list = tmp_path / "timer_list"
    readings = iter([(5_000_000_000, 1000), (5_050_000_000, 1012)])  # 12 jiffies in 50 ms: 240 Hz, so 250

    def write_next(_: float = 0) -> None:
        ns, jiffies = next(readings)
        timer_list.write_text(f"Timer List Version: v0.9\nnow at {ns} nsecs\n\njiffies: {jiffies}\n")

    write_next()
    monkeypatch.setattr(kp.time, "sleep", write_next)
    assert kp.jiffy_ns(str(tmp_path)) == 4_000_000
    monkeypatch.setattr(kp.time, "sleep", lambda _: None)
    assert kp.jiffy_ns(str(tmp_path / "missing")) == 0
