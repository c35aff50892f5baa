"""Massif's snapshot schedule, kept by the kernel and steered from user space.

Massif decides at every allocator event whether to take a snapshot: when the time (in the chosen unit) has
reached the last snapshot's time plus the minimum interval, which its culling raises as the run goes on
(ms_main.c maybe_take_snapshot, cull_snapshots). heapscope's kernel side makes the same comparison at every
event and records the event's time and totals as a point (probes/heap.bpf.c schedule_check); this module turns
those points into snapshots of a SnapshotSeries, which culls them as Massif does, and gives the kernel the
interval and the point count of the next culling back.

The kernel also logs, for each site, its value right before its first change after each point (the snapshot log,
probes/heap.bpf.c site_touch): SiteLog rebuilds from it every site's value at any point, so a detailed snapshot's
tree is the tree of its own instant, however long ago the point was sent.

Pure: no bcc, no I/O. The kernel's side is agent.kernel.probes (schedule_points, set_schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from agent.model.snapshot import Snapshot, SnapshotSeries


@dataclass(frozen=True)
class KernelSchedule:
    """What the kernel's side is told, in the snapshots' unit: the series' minimum interval, the point count at
    which the series culls next (from which the kernel guesses the interval until told again), and when the
    next snapshot is due (the latest snapshot's time plus the interval; None before the first snapshot)."""

    interval: int
    cull_at: int
    due: int | None


@dataclass
class PointFeed:
    """Feeds the kernel's points into a series, in order.

    `to_time` turns a point's time into the series' unit (ms from the kernel's ns; B as it is). A point of kind
    `peak_kind` is one of Massif's peak snapshots (SnapshotSeries.add_peak_point). A point earlier than the
    series' latest snapshot (a tick's state replaced a point after it was sent: SnapshotSeries.tree_missed) is
    counted in `n_late` and not offered. The snapshots recorded with a tree to come wait in `owed`, with their
    points' epochs (take_owed)."""

    series: SnapshotSeries
    to_time: Callable[[int], int] = int
    peak_kind: int = 1
    n_points: int = 0  # points read from the kernel, all of them: the kernel's count of points sent
    n_recorded: int = 0  # of which the series recorded
    n_late: int = 0
    next_epoch: int = 0  # the epoch after the latest point read: the kernel's points are numbered from 0
    owed: list[tuple[Snapshot, int]] = field(default_factory=list)

    def feed(self, points: Iterable[tuple[int, int, int, int, int]], stacks_B: int) -> int:
        """Offer points (time, heap, extra, kind, epoch) to the series; returns how many it recorded."""
        recorded = 0
        series = self.series
        for raw_time, heap, extra, kind, epoch in points:
            self.n_points += 1
            self.next_epoch = max(self.next_epoch, epoch + 1)
            if series.finished:
                continue
            time = self.to_time(raw_time)
            # A point can come after a tick's later state took the place of a point whose tree was missed: the
            # point's event took its time while the tick read the counters, and reached the ring only after (the
            # target's thread was still in its handler on the other CPU). The file stays in time order: it is
            # counted, not offered.
            latest = series.latest_time
            if latest is not None and time < latest:
                self.n_late += 1
                continue
            if kind == self.peak_kind:
                snap: Snapshot | None = series.add_peak_point(time, heap, extra, stacks_B)
            else:
                snap = series.add_point(time, heap, extra, stacks_B)
            if snap is None:
                continue
            recorded += 1
            if snap.tree_pending:
                self.owed.append((snap, epoch))
        self.n_recorded += recorded
        return recorded

    def take_owed(self) -> list[tuple[Snapshot, int]]:
        """The snapshots still in the series whose trees are to come, with their points' epochs; none is owed
        after."""
        owed, self.owed = self.owed, []
        return [(snap, epoch) for snap, epoch in owed if snap.tree_pending and self.series.holds(snap)]

    def kernel_schedule(self) -> KernelSchedule:
        """What the series wants now. It culls after as many points as it has room for (each point it records
        takes one place; points it skips make the kernel's guess start early, which the next feed corrects).
        The due time realigns the kernel's points with the series' snapshots after a culling or a tree (the
        kernel moves the due time on from its own latest point, with the interval it knew then)."""
        series = self.series
        room = max(1, series.max_snapshots - len(series))
        last = series.last_time
        due = None if last is None else last + series.min_time_interval
        return KernelSchedule(series.min_time_interval, self.n_points + room, due)


class SiteLog:
    """The kernel's snapshot log, read into memory: records (site, epoch, bytes, extra, allocs), each a site's
    live bytes, extra bytes and allocations so far right before its first change once `epoch` points had been
    sent (the points are numbered from 0, so the change came after point epoch - 1).

    A site's values at point k are then those of its earliest record with an epoch above k; with no such
    record, it has not changed since, and has its values now. The kernel submits a record before the change it
    precedes: read the sites first and the log after (add), and every change the read saw has its record.
    Records that no point still to be read can need are dropped (forget)."""

    def __init__(self) -> None:
        self._records: list[tuple[int, int, int, int, int]] = []  # in the order the kernel reserved them

    def __len__(self) -> int:
        return len(self._records)

    def add(self, records: Iterable[tuple[int, int, int, int, int]]) -> None:
        self._records.extend(records)

    def values_at(self, epochs: Sequence[int], now: SiteValues) -> dict[int, SiteValues]:
        """Every site's values at each point of `epochs`, from the sites' values read now (`now`, indexed by site
        id; a record of a site beyond them is of a site made after the read, and is left out)."""
        n = len(now.bytes)
        # Latest epochs first: walking the records back from the latest, each site ends with its earliest
        # record above the point (of two with one epoch, the first reserved: another CPU's racing change).
        records = sorted(self._records, key=lambda r: r[1])  # stable: the reserved order within an epoch
        cur = SiteValues(list(now.bytes), list(now.extra), list(now.allocs))
        out: dict[int, SiteValues] = {}
        i = len(records) - 1
        for k in sorted(set(epochs), reverse=True):
            while i >= 0 and records[i][1] > k:
                site, _, nbytes, extra, allocs = records[i]
                if site < n:
                    cur.bytes[site] = nbytes
                    cur.extra[site] = extra
                    cur.allocs[site] = allocs
                i -= 1
            out[k] = SiteValues(list(cur.bytes), list(cur.extra), list(cur.allocs))
        return out

    def forget(self, next_epoch: int) -> None:
        """Drop the records no point from `next_epoch` on can need: a record serves the points before its epoch."""
        self._records = [r for r in self._records if r[1] > next_epoch]


@dataclass(frozen=True)
class SiteValues:
    """Per site id: live bytes, extra bytes, and allocations so far (0: not in Massif's tree)."""

    bytes: list[int]
    extra: list[int]
    allocs: list[int]
