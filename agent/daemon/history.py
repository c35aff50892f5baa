"""A target's stored history, read for the HTTP API: a snapshot at a moment, Massif's series over a range, the
difference between two moments and what is growing over a window, from the target's directory of the store
(agent.store), through the same code as `heapscope report`, `heapscope diff` and `heapscope growth` (agent.offline).

Every call opens the directory afresh and closes it before returning: the daemon keeps no history in memory, and
a reader sees every snapshot written up to the call (each is whole on disk once its write returned). Times are
what the command line takes (agent.offline.timespec): ISO 8601, a time of day, `now`, or relative (`-30m`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from agent.errors import NotInHistory, UsageError
from agent.model.growth import GrowthReport
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stored import StoredDiff, StoredSeries, StoreStatus
from agent.model.tree import HEAP_ROOT_LABEL
from agent.offline import growth as offline_growth
from agent.offline import history
from agent.offline.commands import diff_between, diff_json, diff_text
from agent.offline.timespec import iso, parse_moment
from agent.store import StoreReader
from agent.store.files import segment_paths


@contextmanager
def _open(directory: Path) -> Iterator[StoreReader]:
    if not segment_paths(directory):
        raise NotInHistory(f"no history stored for this target yet ({directory} holds no segment)")
    reader = StoreReader(directory)
    try:
        yield reader
    finally:
        reader.close()


# A query string's unescaped `+` arrives as a space: `2026-11-23T08:00:00+01:00` as `...08:00:00 01:00`.
_PLUS_AS_SPACE = re.compile(r"^(.*\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?) (\d{2}(?::?\d{2})?)$")


def _moment(text: str, what: str, base_ns: int | None = None) -> int:
    if not text.strip():
        raise UsageError(f"{what} is empty: give a time (2026-11-23T08:00, 09:00, now, -30m)")
    text = _PLUS_AS_SPACE.sub(r"\1+\2", text.strip())
    return parse_moment(text, time.time_ns(), base_ns)


def _range(start: str | None, end: str | None) -> tuple[int | None, int | None]:
    s = _moment(start, "from") if start is not None else None
    e = _moment(end, "to", base_ns=s) if end is not None else None
    if s is not None and e is not None and e < s:
        raise UsageError(f"to ({iso(e)}) is before from ({iso(s)})")
    return s, e


def _extent(reader: StoreReader) -> str:
    refs = reader.snapshots()
    if not refs:
        return " (the store holds no snapshot)"
    return f" (the store holds {iso(refs[0].wall_ns)} to {iso(refs[-1].wall_ns)})"


def _skipped(reader: StoreReader) -> list[str]:
    return [str(s) for s in reader.skipped]


def snapshot_at(directory: Path, at: str, detailed: bool) -> Snapshot:
    """The last stored snapshot at or before `at`, as Massif's monitor commands give one (detailed: with its
    heap tree, trimmed as Massif trims by the profile's options)."""
    at_ns = _moment(at, "at")
    with _open(directory) as reader:
        snap = reader.at(at_ns, stacks=detailed)
        if snap is None:
            raise NotInHistory(f"no stored snapshot at or before {iso(at_ns)}" + _extent(reader))
        if not detailed:
            return Snapshot(snap.time, snap.heap_B, snap.extra_B, snap.stacks_B, None, SnapshotKind.NORMAL)
        meta = reader.meta
        builder = history.TreeBuilder(history.Trimmer(meta.options), meta.root_label or HEAP_ROOT_LABEL)
        tree = builder.tree(snap, "cur_bytes")
        return Snapshot(snap.time, snap.heap_B, snap.extra_B, snap.stacks_B, tree, SnapshotKind.DETAILED)


def series(directory: Path, start: str | None, end: str | None, *, max_snapshots: int,
           detailed_freq: int) -> StoredSeries:
    """Massif's series over the stored range [start, end] (either open), culled to `max_snapshots` as Massif
    culls; its trees are built before the store is closed."""
    s, e = _range(start, end)
    with _open(directory) as reader:
        sel = history.select(reader, s, e)
        if not sel.refs:
            raise NotInHistory("no stored snapshot in that range" + _extent(reader))
        got = history.massif_series(reader, sel, max_snapshots=max_snapshots, detailed_freq=detailed_freq)
        for snap in got.snapshots:
            if snap.tree is not None:
                snap.tree.total  # noqa: B018 - builds a lazy tree while its store is open
        return StoredSeries(got.snapshots, got.notes + _skipped(reader))


def diff(directory: Path, start: str, end: str, threshold: float) -> StoredDiff:
    """What grew and shrank between the last stored snapshots at or before `start` and `end`, as
    `heapscope diff` prints it (JSON and text)."""
    s, e = _range(start, end)
    assert s is not None and e is not None
    with _open(directory) as reader:
        d = diff_between(reader, s, e)
        meta = reader.meta
        notes = _skipped(reader)
        doc = {**diff_json(d, threshold), "notes": notes}
        return StoredDiff(doc, diff_text(d, meta.pid, meta.cmd, threshold), notes)


def growth(directory: Path, since: str | None, window_s: float | None, top: int) -> GrowthReport:
    """What is growing over the window (`heapscope growth`): from `since` (a time) or `window_s` seconds back from
    the last stored snapshot."""
    since_ns = _moment(since, "since") if since is not None else None
    with _open(directory) as reader:
        return offline_growth.report(reader, since_ns=since_ns, window_s=window_s, top=top)


def held(directory: Path, status: StoreStatus) -> StoreStatus:
    """`status` with what the directory holds: its oldest and newest snapshot and how many (every run)."""
    if not segment_paths(directory):
        return status
    with StoreReader(directory) as reader:
        count, first, last = reader.extent()  # two block reads a segment: a week's history is read in no time
        return replace(status, first_wall_ns=first, last_wall_ns=last, snapshots_held=count)
