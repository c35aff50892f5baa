"""Massif's snapshot schedule for --pages-as-heap=yes, at the page events themselves.

Massif decides whether to take a snapshot at each page it records or unrecords (ms_main.c ms_record_page_mem,
ms_unrecord_page_mem): after the last page of a range it records; around the first page of a range it unrecords,
a peak snapshot before it and a normal one after it, and none for the pages after. heapscope applies the page
events in order in user space (agent.model.pages.PageAccount), so it offers the series those states at those
times, with Massif's byte clock. A detailed snapshot's tree is built later, from the sites' bytes kept for it
(take_owed): symbolizing is no work for the loop that drains the events.

Pure: no bcc, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.model.snapshot import Snapshot, SnapshotSeries

# The sites' bytes at an instant, read only when a snapshot takes a tree.
LiveBytes = Callable[[], dict[int, int]]


class PageSchedule:
    """Offers the page map's states to a series where Massif would (after, before_free). `time_of` turns an event's
    byte clock and its monotonic ns into the series' unit; `peak_inaccuracy` is --peak-inaccuracy, in percent."""

    def __init__(self, series: SnapshotSeries, peak_inaccuracy: float, time_of: Callable[[int, int], int]) -> None:
        self.series = series
        self.peak_inaccuracy = peak_inaccuracy
        self.time_of = time_of
        self.peak_level = 0  # the total of the latest peak snapshot (Massif's peak_snapshot_total_szB)
        self._owed: list[tuple[Snapshot, dict[int, int]]] = []

    def _time(self, time_b: int, time_ns: int) -> int:
        # ms from two CPUs' events may come a little out of order: the series' file stays in time order
        t = self.time_of(time_b, time_ns)
        latest = self.series.latest_time
        return t if latest is None or t >= latest else latest

    def after(self, time_b: int, time_ns: int, total: int, live: LiveBytes) -> None:
        """Massif's normal snapshot after a change: taken if the minimum interval has passed."""
        series = self.series
        if series.finished:
            return
        snap = series.add_point(self._time(time_b, time_ns), total, 0, 0)
        if snap is not None and snap.tree_pending:
            self._owed.append((snap, live()))

    def before_free(self, time_b: int, time_ns: int, total: int, live: LiveBytes) -> None:
        """Massif's peak snapshot before pages are unrecorded: taken when the total beats the last peak snapshot's
        by more than --peak-inaccuracy, whatever the interval."""
        level = self.peak_level
        if self.series.finished or total <= level + level * self.peak_inaccuracy / 100:
            return
        self.peak_level = total
        snap = self.series.add_peak_point(self._time(time_b, time_ns), total, 0, 0)
        self._owed.append((snap, live()))

    def take_owed(self) -> list[tuple[Snapshot, dict[int, int]]]:
        """The detailed snapshots still in the series whose trees are to come, with the sites' bytes of their
        instant; none is owed after."""
        owed, self._owed = self._owed, []
        return [(snap, live) for snap, live in owed if snap.tree_pending and self.series.holds(snap)]
