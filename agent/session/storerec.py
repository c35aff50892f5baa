"""Keeping a profile's history in the store (agent.store): every stored sample of the session, not only the
snapshots Massif's culling keeps in memory.

The pipeline opens one StoreRecorder per target (STORE/<pid>/) and hands it the session's columns
(Session.store_columns) every `StoreSettings.interval` seconds, and once more at the end. A disk that refuses a
write (full, a quota, gone) never reaches the profile: the error is counted (StoreStatus.write_errors, the metric
heapscope_store_write_errors_total), said in one line when it starts and when writing works again, and the
next sample is tried as usual. The target is never touched by any of this.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from agent.model.counters import Counters
from agent.model.options import MassifOptions
from agent.model.profile import HEAP_ROOT_LABEL, PAGES_ROOT_LABEL, Stack, trim_stack
from agent.model.stored import StoreStatus
from agent.store import PeakState, Retention, StoreMeta, StoreSample, StoreWriteError, StoreWriter, SyncPolicy


@dataclass(frozen=True)
class StoreSettings:
    """Where and how a command keeps its profiles' history."""

    root: Path  # STORE: one directory per process under it (STORE/<pid>/)
    interval: float = 1.0  # seconds between stored samples
    sync: SyncPolicy = field(default_factory=SyncPolicy)
    retention: Retention = field(default_factory=Retention)
    checkpoint_every: int = 100

    def directory(self, pid: int) -> Path:
        return self.root / str(pid)


@dataclass
class StoreColumns:
    """One sample of the session as the store takes it: counters, and the sites' counters as columns."""

    counters: Counters
    time: int  # the profile's time of the sample
    peak_time: int
    stacks_B: int
    mapped_B: int | None
    ids: np.ndarray  # site ids
    sites: np.ndarray  # (9, len(ids)) in agent.store.format.COUNTER_FIELDS order
    new_stacks: Mapping[int, Stack]  # the stacks of ids not given to the store before, symbolized


def _quiet(line: str) -> None:
    pass


def store_meta(pid: int, cmd: str, opts: MassifOptions, desc: tuple[str, ...], start_wall_ns: int) -> StoreMeta:
    return StoreMeta(
        pid=pid,
        cmd=cmd,
        time_unit=opts.time_unit,
        desc=desc,
        root_label=PAGES_ROOT_LABEL if opts.pages_as_heap else HEAP_ROOT_LABEL,
        options=asdict(opts),
        start_wall_ns=start_wall_ns,
    )


class StoreRecorder:
    """One target's store writer, and the session-side state it needs (which stacks were given, which sites
    --ignore-fn leaves out, the stack bytes at the peak). Used by the sampling thread only; status() may be read
    from any thread."""

    def __init__(self, writer: StoreWriter, opts: MassifOptions, say: Callable[[str], None] = _quiet) -> None:
        self.writer = writer
        self.opts = opts
        self.say = say
        self.known: set[int] = set()  # site ids whose stack the store has
        self._ignored: dict[int, bool] = {}  # site id -> made directly in an --ignore-fn function
        self._ignore_fns = frozenset(opts.ignore_fns)
        self._alloc_fns = opts.all_alloc_fns
        self._peak_gen = -1
        self._peak_stacks = 0  # stack bytes when the peak last moved
        self._failing = 0  # samples refused in a row
        self.errors = 0  # samples not stored (a refused write, or an error of ours)
        self.last_error: str | None = None
        self.closed = False

    @classmethod
    def open(cls, settings: StoreSettings, meta: StoreMeta, opts: MassifOptions,
             say: Callable[[str], None] = _quiet) -> StoreRecorder:
        """The writer of STORE/<pid>. Raises StoreWriteError when the directory cannot be made or used."""
        directory = settings.directory(meta.pid)
        _refuse_link(directory)
        writer = StoreWriter(directory, meta, sync=settings.sync, retention=settings.retention,
                             checkpoint_every=settings.checkpoint_every)
        _refuse_link(directory)  # made now, or there before: a plain directory either way
        return cls(writer, opts, say)

    def record(self, take: Callable[[Container[int]], StoreColumns], rss: int | None) -> bool:
        """Store one sample taken by `take` (Session.store_columns: the stacks of sites not in its argument come
        with it). False when it could not be stored: counted and said, never raised."""
        if self.closed:
            return False
        try:
            cols = take(self.known)
            sample = self._sample(cols, rss, time.time_ns())
            self.writer.append_columns(sample, cols.ids, cols.sites)
        except StoreWriteError as exc:
            return self._failed(str(exc))
        except Exception as exc:  # a bug of ours, or a read of the probes that failed: the profile goes on
            return self._failed(f"store: cannot store a sample: {type(exc).__name__}: {exc}")
        self.known.update(cols.new_stacks)
        if self._failing:
            self.say(f"store: writing {self.writer.directory} again, after {self._failing} samples not stored")
            self._failing = 0
        return True

    def _failed(self, message: str) -> bool:
        self.errors += 1
        self.last_error = message
        if not self._failing:  # one line when it starts, not one a second
            self.say(message)
        self._failing += 1
        return False

    def _sample(self, cols: StoreColumns, rss: int | None, wall_ns: int) -> StoreSample:
        c = cols.counters
        heap, extra = c.heap, c.extra
        peak_heap, peak_extra = c.peak_heap, c.peak_extra
        if self._ignore_fns and len(cols.ids):
            mask = self._ignored_mask(cols)
            if mask.any():  # --ignore-fn: left out of the totals, as the session's trees leave them out
                heap -= int(cols.sites[5, mask].sum())
                extra -= int(cols.sites[6, mask].sum())
                peak_heap -= int(cols.sites[7, mask].sum())
                peak_extra -= int(cols.sites[8, mask].sum())
        peak = None
        if c.peak_total > 0:
            if c.peak_gen != self._peak_gen:
                self._peak_gen = c.peak_gen
                self._peak_stacks = cols.stacks_B
            # The kernel's clock is the monotonic one: the peak's wall clock is as far before this sample's.
            peak_wall = wall_ns - max(0, time.monotonic_ns() - c.peak_ns) if c.peak_ns else None
            peak = PeakState(cols.peak_time, peak_heap, peak_extra, self._peak_stacks, peak_wall)
        return StoreSample(
            wall_ns=wall_ns,
            time=cols.time,
            heap_B=heap,
            extra_B=extra,
            stacks_B=cols.stacks_B,
            sites={},
            new_stacks=cols.new_stacks,
            mapped_B=cols.mapped_B,
            rss_B=rss,
            peak=peak,
        )

    def _ignored_mask(self, cols: StoreColumns) -> np.ndarray:
        for sid, stack in cols.new_stacks.items():
            if sid not in self._ignored:
                trimmed = trim_stack(stack, self._alloc_fns, self.opts.depth)
                self._ignored[sid] = bool(trimmed) and trimmed[0].function in self._ignore_fns
        ignored = self._ignored
        return np.fromiter((ignored.get(i, False) for i in cols.ids.tolist()), dtype=bool, count=len(cols.ids))

    def status(self) -> StoreStatus:
        s = self.writer.stats
        return StoreStatus(
            directory=str(self.writer.directory),
            snapshots_written=s.snapshots_written,
            bytes_written=s.bytes_written,
            write_errors=self.errors,
            last_error=self.last_error,
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.writer.close()
        except OSError as exc:  # the last sync: history up to the last write is in the page cache regardless
            self._failed(f"store: cannot close {self.writer.directory}: {exc.strerror}")


def _refuse_link(directory: Path) -> None:
    """STORE/<pid> must be a directory of its own: a symbolic link there would take the history elsewhere."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreWriteError(f"store: cannot use {directory}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StoreWriteError(f"store: {directory} is not a plain directory (a symbolic link or a file): refused")
