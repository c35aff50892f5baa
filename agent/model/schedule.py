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
    """What the kernel's side is told: the series' minimum interval (in the snapshots' unit) and the point count
    at which the series culls next, from which the kernel guesses the interval until told again."""

    interval: int
    cull_at: int


@dataclass
class PointFeed:
    """Feeds the kernel's points into a series, in order.

    `to_time` turns a point's time into the series' unit (ms from the kernel's ns; B as it is). A point earlier
    than the series' latest snapshot (a tick's state replaced a point after it was sent) is counted in
    `n_late` and not offered."""

    series: SnapshotSeries
    to_time: Callable[[int], int] = int
    n_points: int = 0  # points read from the kernel, all of them: the kernel's count of points sent
    n_recorded: int = 0  # of which the series recorded
    n_late: int = 0

    def feed(self, points: Iterable[tuple[int, int, int]], stacks_B: int) -> int:
        """Offer points (time, heap, extra) to the series; returns how many it recorded."""
        recorded = 0
        series = self.series
        for raw_time, heap, extra in points:
            self.n_points += 1
            if series.finished:
                continue
            time = self.to_time(raw_time)
            last = series.last_time
            if last is not None and time < last:
                self.n_late += 1
                continue
            if series.add_point(time, heap, extra, stacks_B) is not None:
                recorded += 1
        self.n_recorded += recorded
        return recorded

    def kernel_schedule(self) -> KernelSchedule:
        """The interval the series wants now, and the point count at which it will cull: as many points from
        now as it has room for (each point it records takes one place; points it skips make the kernel's
        guess start early, which the next feed corrects)."""
        room = max(1, self.series.max_snapshots - len(self.series))
        return KernelSchedule(self.series.min_time_interval, self.n_points + room)
