"""Keeping a profile's history in the store (agent.store): every stored sample of the session, not only the
snapshots Massif's culling keeps in memory.

The pipeline opens one StoreRecorder per target (STORE/<pid>/) and hands it the session's columns
(Session.store_columns) every `StoreSettings.interval` seconds, and once more at the end. A quiet target (its
kernel counters, page events and RSS all where they were at the last stored sample) is stored only every
`StoreSettings.quiet_interval` seconds: a sleeping service costs neither a sample nor an fdatasync a second. When
it moves again, the last state is first stored once more at the last quiet look, so that the history is a step
where it stood still and every reader (`at`, ranges, the charts) sees what it would have seen in a full record.
Meanwhile each quiet look leaves that step at the segment's end, written over by the next (StoreWriter.hold),
so a heapscope killed by SIGKILL during a quiet stretch leaves a history that still reaches its last look.

A disk that refuses a write (full, a quota, gone) never reaches the profile: the error is counted
(StoreStatus.write_errors, the metric heapscope_store_write_errors_total), said in one line when it starts and when
writing works again, and the next sample is tried as usual. The target is never touched by any of this.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from agent.model.counters import Counters
from agent.model.options import MassifOptions
from agent.model.stack import Stack, trim_stack
from agent.model.stored import StoreStatus
from agent.model.tree import HEAP_ROOT_LABEL, PAGES_ROOT_LABEL
from agent.store import PeakState, Retention, StoreMeta, StoreSample, StoreWriteError, StoreWriter, SyncPolicy
from agent.store.format import COUNTER_FIELDS


@dataclass(frozen=True)
class StoreSettings:
    """Where and how a command keeps its profiles' history."""

    root: Path  # STORE: one directory per process under it (STORE/<pid>/)
    interval: float = 1.0  # seconds between stored samples
    sync: SyncPolicy = field(default_factory=SyncPolicy)
    retention: Retention = field(default_factory=Retention)
    checkpoint_every: int = 100
    quiet_interval: float = 60.0  # seconds between stored samples of a target that does not move

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


_NO_IDS = np.zeros(0, dtype=np.int64)  # a sample that changes no site
_NO_COUNTERS = np.zeros((len(COUNTER_FIELDS), 0), dtype=np.int64)


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

    def __init__(self, writer: StoreWriter, opts: MassifOptions, say: Callable[[str], None] = _quiet,
                 quiet_interval: float = 60.0) -> None:
        self.writer = writer
        self.quiet_interval = quiet_interval
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
        self.quiet_skipped = 0  # samples not stored because nothing had moved since the last stored one
        self._token: bytes | None = None  # what the last stored sample saw (activity and RSS)
        self._last: StoreSample | None = None  # the last stored sample
        self._last_at = 0.0  # time.monotonic() when it was stored
        self._quiet_at: tuple[int, int] | None = None  # (wall_ns, profile time) of the last quiet look not stored

    @classmethod
    def open(cls, settings: StoreSettings, meta: StoreMeta, opts: MassifOptions,
             say: Callable[[str], None] = _quiet) -> StoreRecorder:
        """The writer of STORE/<pid>. Raises StoreWriteError when the directory cannot be made or used."""
        directory = settings.directory(meta.pid)
        _refuse_link(directory)
        writer = StoreWriter(directory, meta, sync=settings.sync, retention=settings.retention,
                             checkpoint_every=settings.checkpoint_every)
        _refuse_link(directory)  # made now, or there before: a plain directory either way
        return cls(writer, opts, say, settings.quiet_interval)

    def record(self, take: Callable[[Container[int]], StoreColumns], rss: int | None,
               token: bytes | None = None, now: Callable[[], int] | None = None, rate: int | None = None) -> bool:
        """Store one sample taken by `take` (Session.store_columns: the stacks of sites not in its argument come
        with it). `token` (HeapProbes.activity) and `rss` equal to the last stored sample's mean nothing moved:
        the sample is skipped (`now` gives the profile time of this look) unless `quiet_interval` has passed.
        `rate`: sampled mode's rate in force, stored with the sample. False when it could not be stored: counted
        and said, never raised."""
        if self.closed:
            return False
        if token is not None:
            token += repr(rss).encode()
            mono = time.monotonic()
            if token == self._token and self._last is not None and mono - self._last_at < self.quiet_interval:
                self.quiet_skipped += 1
                self._quiet_at = wall, t = (time.time_ns(), now() if now is not None else self._last.time)
                try:  # the step so far, where a SIGKILL would leave it (written over by the next sample)
                    self.writer.hold(replace(self._last, wall_ns=wall, time=t, new_stacks={}))
                except StoreWriteError as exc:
                    return self._failed(str(exc))
                return True
            if token == self._token:
                self._quiet_at = None  # still quiet, stored once a quiet_interval: no step to mark
        try:
            if self._quiet_at is not None and self._last is not None:
                # It moves again: the state it held until the last quiet look, at that look's time.
                wall, t = self._quiet_at
                self._quiet_at = None
                held = replace(self._last, wall_ns=wall, time=t, new_stacks={})
                self.writer.append_columns(held, _NO_IDS, _NO_COUNTERS)
            cols = take(self.known)
            sample = self._sample(cols, rss, time.time_ns(), rate)
            self.writer.append_columns(sample, cols.ids, cols.sites)
            self._token, self._last, self._last_at = token, sample, time.monotonic()
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

    def _sample(self, cols: StoreColumns, rss: int | None, wall_ns: int, rate: int | None = None) -> StoreSample:
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
            rate=rate,
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
            quiet_skipped=self.quiet_skipped,
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
