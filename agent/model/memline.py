"""Mapped memory and RSS over a profile's time: the two lines the web page draws beside the heap.

Snapshots carry heap bytes only; these are sampled beside them, at the session's sampling interval, and
looked up by a snapshot's time. Pure Python: the caller reads /proc and the page map.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryPoint:
    time: int  # in the profile's time unit, as Snapshot.time
    mapped: int | None  # bytes mapped (the page syscalls' total), None before the page map is seeded
    rss: int | None  # resident set size, None once the process is gone


def point_at(points: Sequence[MemoryPoint], times: Sequence[int], time: int) -> MemoryPoint | None:
    """The last of `points` (in time order, `times` theirs) at or before `time`; the first one if `time` is
    earlier; None when there are none."""
    if not points:
        return None
    i = bisect.bisect_right(times, time) - 1
    return points[max(i, 0)]


class MemoryLine:
    """A bounded series of MemoryPoints in time order. When it is full every other point goes, so a long run
    keeps an even coverage in `capacity` points (the same idea as Massif's culling, simpler). A run of points
    with the same figures keeps its first and its last only (a sleeping target's line is two points, not one a
    second), so that it still draws as a step."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {capacity}")
        self.capacity = capacity
        self._times: list[int] = []
        self._points: list[MemoryPoint] = []
        self._lock = threading.Lock()  # the sampler appends while HTTP readers look up
        self.n_thinned = 0  # times every other point went
        self.n_late = 0
        self._held: MemoryPoint | None = None  # the last of a run of equal figures, not yet in the series

    def add(self, point: MemoryPoint) -> None:
        with self._lock:
            held = self._held
            if self._times and point.time < (held or self._points[-1]).time:
                self.n_late += 1  # time never goes back: a late reading is dropped, and counted
                return
            last = self._points[-1] if self._points else None
            if last is not None and (point.mapped, point.rss) == (last.mapped, last.rss):
                self._held = point
                return
            self._held = None
            if held is not None:
                self._append(held)
            self._append(point)

    def _append(self, point: MemoryPoint) -> None:
        self._times.append(point.time)
        self._points.append(point)
        if len(self._points) > self.capacity:
            self._points = self._points[::2]
            self._times = [p.time for p in self._points]
            self.n_thinned += 1

    def points(self) -> list[MemoryPoint]:
        with self._lock:
            return self._points + ([self._held] if self._held is not None else [])

    def at(self, time: int) -> MemoryPoint | None:
        """The last point at or before `time` (the first one if `time` is earlier), None when empty."""
        with self._lock:
            if not self._points:
                return None
            return point_at(self._points, self._times, time)

    def __len__(self) -> int:
        return len(self._points) + (self._held is not None)
