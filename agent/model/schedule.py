"""Massif's snapshot schedule, kept by the kernel and steered from user space.

Massif decides at every allocator event whether to take a snapshot: when the time (in the chosen unit) has
reached the last snapshot's time plus the minimum interval, which its culling raises as the run goes on
(ms_main.c maybe_take_snapshot, cull_snapshots). heapscope's kernel side makes the same comparison at every
event and records the event's time and totals as a point (probes/heap.bpf.c schedule_check); this module turns
those points into snapshots of a SnapshotSeries, which culls them as Massif does, and gives the kernel the
interval and the point count of the next culling back.

Pure: no bcc, no I/O. The kernel's side is agent.kernel.probes (schedule_points, set_schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.model.profile import SnapshotSeries


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
    series' latest snapshot (a tick's state replaced a point after it was sent) is counted in `n_late` and not
    offered."""

    series: SnapshotSeries
    to_time: Callable[[int], int] = int
    peak_kind: int = 1
    n_points: int = 0  # points read from the kernel, all of them: the kernel's count of points sent
    n_recorded: int = 0  # of which the series recorded
    n_late: int = 0

    def feed(self, points: Iterable[tuple[int, int, int, int]], stacks_B: int) -> int:
        """Offer points (time, heap, extra, kind) to the series; returns how many it recorded."""
        recorded = 0
        series = self.series
        for raw_time, heap, extra, kind in points:
            self.n_points += 1
            if series.finished:
                continue
            time = self.to_time(raw_time)
            # A point can come after a tick paid its tree with a later state: the point's event took its time
            # while the tick read the counters, and reached the ring only after (the target's thread was still
            # in its handler on the other CPU). The file stays in time order: it is counted, not offered.
            latest = series.latest_time
            if latest is not None and time < latest:
                self.n_late += 1
                continue
            if kind == self.peak_kind:
                series.add_peak_point(time, heap, extra, stacks_B)
                recorded += 1
            elif series.add_point(time, heap, extra, stacks_B) is not None:
                recorded += 1
        self.n_recorded += recorded
        return recorded

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
