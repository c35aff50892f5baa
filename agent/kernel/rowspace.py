"""Where each object's unwind rows lie in the one rows table that every target of the process shares.

An object (by its key: its build id, or a digest of its rows) is placed once, whichever targets map it, and counted by
the targets that use it. When the last one lets it go its rows stay where they are, idle, for the next target of the
same program (a recycled worker, a backend a connection, a service attached again) to find without writing them
again; the space of the least recently idle is given to a new object when no free extent holds it. Pure
bookkeeping: the BPF layer writes the rows (agent.kernel.arrays.SharedRows).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Placed:
    first: int  # first row
    count: int  # rows
    users: int  # targets that use the object


class RowSpace:
    """A range of `size` rows, handed out first-fit by object, with the free extents merged back on release.
    Not thread-safe: the caller holds a lock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []  # (first, count), sorted by first
        self.objects: dict[str, Placed] = {}  # objects some target uses
        self.idle: OrderedDict[str, Placed] = OrderedDict()  # objects none uses, their rows kept: oldest first

    @property
    def used(self) -> int:
        return sum(p.count for p in self.objects.values())

    def acquire(self, key: str, count: int) -> tuple[Placed, bool] | None:
        """The object's place, and whether it is new (its rows must be written); None when no free extent holds
        `count` rows, even with every idle object's space given back."""
        placed = self.objects.get(key)
        if placed is not None:
            placed.users += 1
            return placed, False
        placed = self.idle.pop(key, None)
        if placed is not None:  # its rows are still there
            placed.users = 1
            self.objects[key] = placed
            return placed, False
        first = self._take(count)
        while first is None and self.idle:
            _, oldest = self.idle.popitem(last=False)
            self._give(oldest.first, oldest.count)
            first = self._take(count)
        if first is None:
            return None
        placed = self.objects[key] = Placed(first, count, 1)
        return placed, True

    def _take(self, count: int) -> int | None:
        """The first row of `count` free rows, first fit; None when no extent holds them."""
        for i, (first, free) in enumerate(self._free):
            if free >= count:
                if free == count:
                    del self._free[i]
                else:
                    self._free[i] = (first + count, free - count)
                return first
        return None

    def release(self, key: str) -> None:
        """A target no longer uses the object; after the last one its rows are idle (kept until their space is
        wanted)."""
        placed = self.objects.get(key)
        if placed is None:
            return
        placed.users -= 1
        if placed.users > 0:
            return
        del self.objects[key]
        if placed.count:
            self.idle[key] = placed

    def _give(self, first: int, count: int) -> None:
        """Rows back to the free extents, merged with their neighbours."""
        if not count:
            return
        i = bisect.bisect_left(self._free, (first, 0))
        if i < len(self._free) and first + count == self._free[i][0]:  # merge with the next extent
            count += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first:  # and with the previous one
            first, count = self._free[i - 1][0], self._free[i - 1][1] + count
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (first, count))

    def free_extents(self) -> list[tuple[int, int]]:
        return list(self._free)
