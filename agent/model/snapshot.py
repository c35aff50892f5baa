"""Snapshots and their series: Massif's normal, detailed and peak snapshots, and how the series is thinned
as a run gets longer (massif/ms_main.c: cull_snapshots).

Pure Python: no bcc, no I/O.
"""

from __future__ import annotations

import bisect
import enum
import heapq
from dataclasses import dataclass, field

from agent.model.tree import Tree

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
        kind = self._offer(time, tree_comes_later=False, tree=tree)
        if kind is None:
            return None
        tree = tree if kind is SnapshotKind.DETAILED else None
        return self._record(Snapshot(time, heap_B, heap_extra_B, stacks_B, tree, kind))

    def add_point(self, time: int, heap_B: int, heap_extra_B: int, stacks_B: int) -> Snapshot | None:
        """Offer a point, a sample with exact totals and no tree yet. Returns the recorded snapshot, or None when
        it is skipped. When the detailed frequency falls on it, it is DETAILED with its tree to come (give_tree,
        or tree_missed)."""
        kind = self._offer(time, tree_comes_later=True)
        if kind is None:
            return None
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

    def _offer(self, time: int, *, tree_comes_later: bool, tree: Tree | None = None) -> SnapshotKind | None:
        """The kind a sample offered at `time` is taken as (None: skipped, and counted), the detailed frequency's
        count moved on. A detailed sample needs its tree now unless it comes later (a point)."""
        if self._finished:
            raise ValueError("the series is finished")
        self._check_time(time)
        kind = self.next_kind(time)
        if kind is None:
            self.n_skipped += 1
        elif kind is SnapshotKind.DETAILED:
            if tree is None and not tree_comes_later:
                raise ValueError("this sample must be detailed (next_kind said so) but no tree was given")
            self._tree_given()
        else:
            self._since_detailed += 1
        return kind

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
