"""The store's writer: one directory per target, holding segment files written append-only.

    writer = StoreWriter(directory, StoreMeta(pid=..., cmd=...))
    writer.append(StoreSample(...))   # every sample
    writer.close()

Each append writes one snapshot, its table of contents and the outer table of contents with a single write at
the file's logical end, so a crash leaves at most one torn snapshot at the tail, which readers skip. A failed
write (a full disk) is cut off again and raised as StoreWriteError; the writer's state is left as before the
call, so the next append can succeed once there is room.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from agent.errors import EnvironmentProblem
from agent.model.stack import Stack
from agent.store.files import next_segment_seq
from agent.store.retention import Retention, apply_retention
from agent.store.sample import PeakState, StoreMeta, StoreSample
from agent.store.segment import N_FIELDS, SegmentFile, fsync_dir

_LOOKUP_LIMIT = 1 << 24


class StoreWriteError(EnvironmentProblem):
    """The store could not be written (full disk, file size limit, permissions): the profile goes on."""


@dataclass(frozen=True)
class SyncPolicy:
    """When written data is forced to the disk (fdatasync).

    interval (default): at most `interval` seconds after it was written, so a power loss costs at most that
    much history; always: after every snapshot; never: when the kernel pleases (a crash of heapscope alone
    loses nothing in any mode: each snapshot is in the kernel's page cache once append returns).
    """

    mode: Literal["always", "interval", "never"] = "interval"
    interval: float = 1.0


@dataclass
class WriterStats:
    snapshots_written: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    syncs: int = 0
    segments_deleted: int = 0
    segments_thinned: int = 0
    snapshots_thinned: int = 0
    last_error: str | None = None


def _full_disk(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class StoreWriter:
    """Appends a target's samples to its directory of segments (see the module's docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        meta: StoreMeta,
        *,
        sync: SyncPolicy | None = None,
        retention: Retention | None = None,
        checkpoint_every: int = 100,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        self.directory = Path(directory)
        self.meta = meta
        self.sync_policy = sync or SyncPolicy()
        self.retention = retention or Retention()
        self.checkpoint_every = checkpoint_every
        self.clock = clock
        self.stats = WriterStats()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreWriteError(f"store: cannot create {self.directory}: {exc.strerror}") from None
        self._next_seq = next_segment_seq(self.directory)
        self._segment: SegmentFile | None = None
        self._closed_one = False  # a segment of this writer's closed since the retention was applied
        self._number: dict[int, int] = {}  # site id -> site number (the order sites were first seen)
        self._lookup = np.full(1024, -1, dtype=np.int64)  # the same for ids below _LOOKUP_LIMIT
        self._stacks: list[Stack] = []  # by site number
        self._state = np.zeros((N_FIELDS, 0), dtype=np.int64)  # counters last written, by site number
        self._lock = threading.Lock()
        self._dirty_since: float | None = None  # monotonic time of the oldest write not yet synced
        self._sync_lock = threading.Lock()  # held through a sync by the process's syncer (close waits on it)

    # ---- appending ----------------------------------------------------------------------------------

    def append(self, sample: StoreSample) -> None:
        """Write one sample. Raises StoreWriteError when the disk refuses it (the store stays readable and
        the next append retries); ValueError for a site id whose stack was never given."""
        ids = np.fromiter(sample.sites, dtype=np.int64, count=len(sample.sites))
        rows = [
            (c.tot_blocks, c.tot_bytes, c.freed_blocks, c.freed_bytes, c.cur_blocks, c.cur_bytes, c.cur_extra,
             c.peak_bytes, c.peak_extra)
            for c in sample.sites.values()
        ]
        counters = np.array(rows, dtype=np.int64).T if rows else np.zeros((N_FIELDS, 0), dtype=np.int64)
        self.append_columns(sample, ids, counters)

    def append_columns(self, sample: StoreSample, ids: np.ndarray, counters: np.ndarray) -> None:
        """append(), with the sites' counters given as columns instead of `sample.sites` (which is ignored):
        `ids` the site ids, `counters` a (9, len(ids)) array in agent.store.format.COUNTER_FIELDS order. For
        callers that read counters as arrays (the kernel's maps are), at a tenth of the cost of SiteCounts."""
        if counters.shape != (N_FIELDS, len(ids)):
            raise ValueError(f"counters of shape {counters.shape} for {len(ids)} sites")
        with self._lock:
            new_ids = [sid for sid in sample.new_stacks if sid not in self._number]
            for sid in new_ids:
                self._number[sid] = len(self._number)
            try:
                self._index_ids(new_ids)
                n = len(self._number)
                state = np.zeros((N_FIELDS, n), dtype=np.int64)
                state[:, : self._state.shape[1]] = self._state
                if len(ids):
                    state[:, self._numbers_of(ids)] = counters
                stacks = self._stacks + [tuple(sample.new_stacks[sid]) for sid in new_ids] if new_ids else self._stacks
                self._write(_info(sample), state, stacks)
            except BaseException:
                for sid in new_ids:  # as if this sample never came
                    del self._number[sid]
                    if 0 <= sid < len(self._lookup):
                        self._lookup[sid] = -1
                raise
            self._stacks = stacks
            self._state = state

    def hold(self, sample: StoreSample) -> bool:
        """Write `sample`, which must change no site (a quiet target's state at a later look), as the segment's
        last snapshot until the next append or hold writes over it: a history cut short by SIGKILL still
        reaches the last look at a quiet target. Never synced and never a new segment: a quiet look costs one
        small write to the page cache, no disk flush. False when there is nothing to hold it after (no snapshot
        in the open segment). Raises StoreWriteError as append does."""
        with self._lock:
            seg = self._segment
            if seg is None or not seg.n_snapshots:
                return False
            try:
                seg.write(_info(sample), self._state, [], held=True)
            except OSError as exc:
                raise StoreWriteError(self._refused(exc)) from None
            return True

    def _refused(self, exc: OSError) -> str:
        """A write the disk refused: counted, and said as the user reads it."""
        self.stats.write_errors += 1
        what = "the disk is full" if _full_disk(exc) else exc.strerror
        self.stats.last_error = f"store: cannot write {self.directory}: {what}"
        return self.stats.last_error

    def _index_ids(self, new_ids: list[int]) -> None:
        """Site ids are the kernel's stack keys, small and dense: numbered through an array, not a dict."""
        small = [sid for sid in new_ids if 0 <= sid < _LOOKUP_LIMIT]
        if small and max(small) >= len(self._lookup):
            grown = np.full(max(2 * len(self._lookup), max(small) + 1), -1, dtype=np.int64)
            grown[: len(self._lookup)] = self._lookup
            self._lookup = grown
        for sid in small:
            self._lookup[sid] = self._number[sid]

    def _numbers_of(self, ids: np.ndarray) -> np.ndarray:
        if int(ids.min()) >= 0 and int(ids.max()) < len(self._lookup):
            cols = self._lookup[ids]
            if (cols >= 0).all():
                return cols
            sid = int(ids[np.flatnonzero(cols < 0)[0]])
            raise ValueError(f"site {sid} has counters but its stack was never given")
        try:
            return np.fromiter((self._number[sid] for sid in ids.tolist()), dtype=np.int64, count=len(ids))
        except KeyError as exc:
            raise ValueError(f"site {exc.args[0]} has counters but its stack was never given") from None

    def _write(self, info: dict[str, object], state: np.ndarray, stacks: list[Stack]) -> None:
        try:
            seg = self._segment_for_write(int(info["wall_ns"]))  # type: ignore[call-overload]
            written = seg.write(info, state, stacks[seg.n_sites :])
        except OSError as exc:
            raise StoreWriteError(
                f"{self._refused(exc)}; history stops at the last snapshot written "
                f"({self.stats.snapshots_written} this run) until there is room"
            ) from None
        self.stats.snapshots_written += 1
        self.stats.bytes_written += written
        self._after_write(seg)

    def _segment_for_write(self, wall_ns: int) -> SegmentFile:
        seg = self._segment
        r = self.retention
        # A segment's age is that of the history it holds (its snapshots' wall clocks), not of the file
        if seg is not None and seg.n_snapshots and (
            seg.size >= r.segment_bytes or (wall_ns - seg.first_wall_ns) / 1e9 >= r.segment_seconds
        ):
            seg.close(sync=self.sync_policy.mode != "never")
            self._segment = seg = None
            self._dirty_since = None
            self._closed_one = True
        if seg is None:
            path = self.directory / f"seg-{self._next_seq:08d}.hss"
            seg = SegmentFile(path, self.meta, seq=self._next_seq, checkpoint_every=self.checkpoint_every, extra={})
            self._next_seq += 1
            self._segment = seg
            if self.sync_policy.mode != "never":
                fsync_dir(self.directory)  # the new file's name survives a power loss
            if self._closed_one or _retention_due(self.directory):
                self._closed_one = False
                self._maintain()
        return seg

    def _after_write(self, seg: SegmentFile) -> None:
        policy = self.sync_policy
        now = time.monotonic()
        if policy.mode == "always":
            self._sync(seg)
        elif policy.mode == "interval" and self._dirty_since is None:
            # Never in the caller's way: the process's syncer syncs at most `interval` after the oldest unsynced write.
            self._dirty_since = now
            _syncer.dirty(self, now + policy.interval, policy.interval)

    def _sync(self, seg: SegmentFile) -> None:
        try:
            seg.sync()
        except OSError as exc:
            self._sync_failed(seg, exc)
            return
        self.stats.syncs += 1
        self._dirty_since = None

    def sync_due(self) -> None:
        """What appends left unsynced, forced to disk (by the process's syncer, when it is due). The sync runs
        without the writer's lock (appends go on meanwhile), on a duplicate of the descriptor, which a rotation
        closing the segment cannot pull away."""
        with self._sync_lock:
            with self._lock:
                seg = self._segment
                self._dirty_since = None
                if seg is None:
                    return
                try:
                    fd = os.dup(seg.fd)
                except OSError as exc:  # out of descriptors: said as a failed sync, tried again at the next write
                    self._sync_failed(seg, exc)
                    return
            try:
                os.fdatasync(fd)
                error = None
            except OSError as exc:
                error = exc
            finally:
                os.close(fd)
            with self._lock:
                if error is not None:
                    self._sync_failed(seg, error)
                else:
                    self.stats.syncs += 1

    def _sync_failed(self, seg: SegmentFile, exc: OSError) -> None:
        self.stats.write_errors += 1
        self.stats.last_error = f"store: cannot sync {seg.path}: {exc.strerror}"

    def close(self) -> None:
        _syncer.forget(self)
        with self._lock:
            if self._segment is not None:
                self._segment.close(sync=self.sync_policy.mode != "never")
                self._segment = None
        with self._sync_lock:  # a sync the syncer had begun is over: nothing of this writer's runs after close
            pass

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- retention ----------------------------------------------------------------------------------

    def _maintain(self) -> None:
        """Apply the retention to the closed segments (agent.store.retention); its problems are counted."""
        done = apply_retention(self.directory, self.retention, self.clock(),
                               self._segment.path if self._segment is not None else None)
        self.stats.segments_deleted += done.segments_deleted
        self.stats.segments_thinned += done.segments_thinned
        self.stats.snapshots_thinned += done.snapshots_thinned
        if done.errors:
            self.stats.last_error = done.errors[-1]


class _Syncer:
    """One thread for every writer of the process, syncing each at most its interval after its oldest unsynced
    write (SyncPolicy "interval"). A thread of each writer's own woke twice a second for a busy target, once when a
    write left it unsynced and once when that was due, and a prefork server's every new worker started one more;
    this one wakes when the earliest writer is due, and syncs with it those due within half their interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._due: dict[StoreWriter, tuple[float, float]] = {}  # writer -> (when its sync is due, its interval)
        self._waits_until = math.inf  # the thread's wake-up time, while it waits
        self._thread: threading.Thread | None = None

    def dirty(self, writer: StoreWriter, due: float, interval: float) -> None:
        """`writer` has written unsynced data: sync it by `due` (a writer already waiting keeps its earlier time)."""
        with self._lock:
            if writer in self._due:
                return
            self._due[writer] = (due, interval)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="store-sync", daemon=True)
                self._thread.start()
            elif due < self._waits_until:
                self._wake.notify()

    def forget(self, writer: StoreWriter) -> None:
        with self._lock:
            self._due.pop(writer, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                first = min((due for due, _ in self._due.values()), default=math.inf)
                if first > now:
                    self._waits_until = first
                    self._wake.wait(None if first == math.inf else first - now)
                    self._waits_until = math.inf
                    continue
                ready = [w for w, (due, interval) in self._due.items() if due - interval / 2 <= now]
                for w in ready:
                    del self._due[w]
            for w in ready:
                w.sync_due()


_syncer = _Syncer()


# A writer's first segment applies the retention to its directory only if it was not applied there in the last
# RETENTION_RECHECK seconds (by any writer): what it closes is applied at once. A process attached again and again
# (a fleet's restarts, its workers recycled) opens a segment at each attach, and one look at its directory each
# time cost more with every attach; by age or size, ten seconds of history is no more than a rounding.
RETENTION_RECHECK = 10.0
_applied_at: dict[Path, float] = {}
_applied_lock = threading.Lock()


def _retention_due(directory: Path) -> bool:
    """Whether the retention is due in directory (and, if so, noted as applied now)."""
    now = time.monotonic()
    with _applied_lock:
        if now - _applied_at.get(directory, -RETENTION_RECHECK) < RETENTION_RECHECK:
            return False
        if len(_applied_at) >= 1024:  # forget the directories not looked at lately
            for old in [d for d, t in _applied_at.items() if now - t >= RETENTION_RECHECK]:
                del _applied_at[old]
        _applied_at[directory] = now
        return True


def _info(sample: StoreSample) -> dict[str, object]:
    return {
        "wall_ns": int(sample.wall_ns),
        "time": int(sample.time),
        "heap": int(sample.heap_B),
        "extra": int(sample.extra_B),
        "stacks": int(sample.stacks_B),
        "mapped": None if sample.mapped_B is None else int(sample.mapped_B),
        "rss": None if sample.rss_B is None else int(sample.rss_B),
        "peak": _peak_json(sample.peak),
        **({} if sample.rate is None else {"rate": int(sample.rate)}),
    }


def _peak_json(peak: PeakState | None) -> dict[str, object] | None:
    if peak is None:
        return None
    return {
        "time": int(peak.time),
        "heap": int(peak.heap_B),
        "extra": int(peak.extra_B),
        "stacks": int(peak.stacks_B),
        "wall_ns": peak.wall_ns,
    }
