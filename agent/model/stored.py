"""A target's kept history as the daemon and its API see it: the store's state, a range of stored snapshots, and
the difference between two stored moments. Plain values (the store itself is agent.store)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.model.snapshot import Snapshot


@dataclass(frozen=True)
class StoreStatus:
    """What a profile's store writer has done so far (all zero, and `directory` None, when it keeps no store)."""

    directory: str | None = None  # the target's directory of segments
    snapshots_written: int = 0
    quiet_skipped: int = 0  # looks not stored: nothing had moved since the last stored sample (a step)
    bytes_written: int = 0
    write_errors: int = 0  # samples the disk refused (full disk, ...): counted, never raised to the profile
    last_error: str | None = None
    first_wall_ns: int | None = None  # the oldest and newest snapshots the directory holds (any run)
    last_wall_ns: int | None = None
    snapshots_held: int = 0

    @property
    def enabled(self) -> bool:
        return self.directory is not None


@dataclass(frozen=True)
class StoredSeries:
    """Massif's snapshot series over a stored range (culled as Massif culls), and what was left out."""

    snapshots: list[Snapshot]
    notes: list[str] = field(default_factory=list)  # ranges of other runs, unreadable snapshots, skipped bytes


@dataclass(frozen=True)
class StoredDiff:
    """What grew and what shrank between two stored moments: the JSON document `heapscope diff --json`
    prints, and its text."""

    document: Mapping[str, object]
    text: str
    notes: list[str] = field(default_factory=list)
