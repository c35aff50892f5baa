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
import os
import threading
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from agent.errors import EnvironmentProblem
from agent.model.profile import Frame, Stack
from agent.store import format as fmt
from agent.store.files import SEGMENT_RE, segment_paths
from agent.store.sample import PeakState, StoreMeta, StoreSample

_LOOKUP_LIMIT = 1 << 24
N_FIELDS = len(fmt.COUNTER_FIELDS)


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


@dataclass(frozen=True)
class ThinRule:
    """Snapshots older than `older_than_s` are kept at most one per `keep_every_s` seconds."""

    older_than_s: float
    keep_every_s: float


@dataclass(frozen=True)
class Retention:
    """How much history is kept. A segment closes at `segment_bytes` or when it holds `segment_seconds` of
    history (by its snapshots' wall clocks); closed segments are
    deleted, oldest first, while the target's directory exceeds `max_bytes` or once they are older than
    `max_age_s` (a segment's age is its file's modification time: when its last snapshot was written), and
    thinned by `thin` (the rule with the largest age that a segment has reached applies)."""

    max_bytes: int | None = 4 << 30
    max_age_s: float | None = 7 * 86400.0
    segment_bytes: int = 64 << 20
    segment_seconds: float = 3600.0
    thin: tuple[ThinRule, ...] = ()


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


def _frame_strings(f: Frame) -> tuple[str | None, ...]:
    return (f.function, f.file, f.obj, f.path)


@dataclass
class _Pending:
    """What a snapshot adds to a segment's state, committed once its bytes are written."""

    strings: dict[str, int]
    frames: dict[Frame, int]
    n_sites: int
    state: np.ndarray
    size: np.ndarray
    xpb: np.ndarray
    unit: np.ndarray
    quantum: np.ndarray
    snaptoc: fmt.TocEntry
    tables: list[fmt.TocEntry]
    peak: object
    outer: tuple[int, int]


class SegmentFile:
    """One segment being written: its tables (strings, frames, sites) and the counters last written."""

    def __init__(self, path: Path, meta: StoreMeta, *, seq: int, checkpoint_every: int, extra: dict[str, object]):
        self.path = path
        self.checkpoint_every = checkpoint_every
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        self.first_wall_ns = 0  # wall clock of the first snapshot
        self.strings: dict[str, int] = {}
        self.frames: dict[Frame, int] = {}
        self.n_sites = 0
        self.prev = np.zeros((N_FIELDS, 0), dtype=np.int64)
        self.size_hint = np.zeros(0, dtype=np.int64)  # the sites' hints (docs/store-format.md, "Counters")
        self.xpb_hint = np.zeros(0, dtype=np.int64)
        self.unit_hint = np.zeros(0, dtype=np.int64)
        # per site, a common divisor of every byte count it had in this segment (0: none yet): the unit hints
        self.quantum = np.zeros(0, dtype=np.int64)
        self.n_snapshots = 0
        self.outer: list[tuple[int, int]] = []  # (start, end) of outer TOC k, at k-1
        self.snaptocs: list[fmt.TocEntry] = []  # inner TOC of snapshot k, at k-1 (key: wall clock ns)
        self.tables: list[list[fmt.TocEntry]] = []  # table blocks of snapshot k, at k-1 (key: its seq)
        self.last_peak: object = None  # the peak (as in snapinfo) of the last snapshot written
        self.torn = False  # a failed write may have left bytes past `offset`
        self.held_end = 0  # the end of a held (provisional) snapshot past `offset`, else 0
        filemeta = {**meta.to_json(), "subversion": fmt.FORMAT_SUBVERSION, "segment": seq,
                    "checkpoint_every": checkpoint_every, **extra}
        head = fmt.MAGIC + fmt.json_block(fmt.K_FILEMETA, filemeta)
        self.filemeta_entry = fmt.TocEntry(fmt.K_FILEMETA, len(fmt.MAGIC), len(head))
        try:
            _pwrite_all(self.fd, head, 0)
        except OSError:
            os.close(self.fd)
            os.unlink(path)
            raise
        self.offset = len(head)

    @property
    def size(self) -> int:
        return self.offset

    def encode(
        self, info: dict[str, object], state: np.ndarray, stacks: Sequence[Stack]
    ) -> tuple[bytes, _Pending]:
        """The bytes of one snapshot (blocks, inner TOC, outer TOC, trailing offset) at the current end, and the
        table changes to commit once they are written. `state` is (9, n_sites) in COUNTER_FIELDS order, `stacks`
        the stacks of the sites this segment has not listed yet (sites n_sites.. in order)."""
        n = state.shape[1]
        if n != self.n_sites + len(stacks):
            raise ValueError(f"{n} sites but {self.n_sites} known and {len(stacks)} new")
        seq = self.n_snapshots
        checkpoint = seq % self.checkpoint_every == 0
        prev = np.zeros((N_FIELDS, n), dtype=np.int64)
        quantum = _quantum(self.quantum, state)
        if checkpoint:
            listed = np.arange(n, dtype=np.int64)
            # hints start afresh at a checkpoint: each site's block size, extra per block and byte unit now
            size, xpb, unit = fmt.hints_of(state, quantum)
            hint = (size != 0) | (xpb != 0) | (unit > 1)
        else:
            prev[:, : self.n_sites] = self.prev
            listed = np.flatnonzero(np.any(state != prev, axis=0))
            size = np.zeros(n, dtype=np.int64)
            xpb = np.zeros(n, dtype=np.int64)
            unit = np.zeros(n, dtype=np.int64)
            size[: self.n_sites] = self.size_hint
            xpb[: self.n_sites] = self.xpb_hint
            unit[: self.n_sites] = self.unit_hint
            hint = np.zeros(n, dtype=bool)
            # a site without a hint gets one as soon as it has blocks; hints do not change until the checkpoint
            # (but for a unit that no longer divides the byte residuals, below)
            maybe = np.flatnonzero(((size == 0) & (state[0] != 0)) | ((xpb == 0) & (state[4] != 0)))
            if len(maybe):
                new_size, new_xpb, new_unit = fmt.hints_of(state[:, maybe], quantum[maybe])
                sized = (size[maybe] == 0) & (new_size != 0)
                extra = (xpb[maybe] == 0) & (new_xpb != 0)
                size[maybe[sized]] = new_size[sized]
                unit[maybe[sized]] = new_unit[sized]
                xpb[maybe[extra]] = new_xpb[extra]
                hint[maybe[sized | extra]] = True
        # A byte residual that is not a multiple of its site's unit: the unit becomes their common divisor.
        r1, r3 = fmt.byte_residuals(prev, state, size)
        u = np.maximum(unit, 1)
        off = ((r1 % u) != 0) | ((r3 % u) != 0)
        if off.any():
            unit[off] = np.gcd(np.gcd(u[off], r1[off]), r3[off])
            hint |= off
        hinted = np.flatnonzero(hint)
        # New strings, frames and sites: only what this segment has not written yet.
        new_strings: dict[str, int] = {}
        new_frames: dict[Frame, int] = {}
        frame_rows: list[Frame] = []
        stk_len: list[int] = []
        stk_frm: list[int] = []

        def string_ref(s: str | None) -> int:
            if s is None:
                return 0
            i = self.strings.get(s)
            if i is None:
                i = new_strings.get(s)
                if i is None:
                    i = new_strings[s] = len(self.strings) + len(new_strings)
            return i + 1

        for stack in stacks:
            stk_len.append(len(stack))
            for f in stack:
                k = self.frames.get(f)
                if k is None:
                    k = new_frames.get(f)
                    if k is None:
                        k = new_frames[f] = len(self.frames) + len(new_frames)
                        frame_rows.append(f)
                stk_frm.append(k)
        frame_cols = [[], [], [], [], [], [], []]  # type: list[list[int]]
        for f in frame_rows:
            frame_cols[0].append(f.address if f.address < 1 << 63 else f.address - (1 << 64))
            frame_cols[1].append(string_ref(f.function))
            frame_cols[2].append(string_ref(f.file))
            frame_cols[3].append(f.line or 0)
            frame_cols[4].append(string_ref(f.obj))
            frame_cols[5].append(string_ref(f.path))
            frame_cols[6].append(1 if f.inlined else 0)

        peak_moved = info.get("peak") != self.last_peak
        info = {
            **info,
            "peak_moved": peak_moved,
            "seq": seq,
            "checkpoint": checkpoint,
            "listed": len(listed),
            "hinted": len(hinted),
            "sites": n,
            "frames": len(self.frames) + len(new_frames),
            "strings": len(self.strings) + len(new_strings),
        }
        parts: list[tuple[bytes, bytes]] = [(fmt.K_SNAPINFO, fmt.json_block(fmt.K_SNAPINFO, info))]
        if new_strings:
            parts.append((fmt.K_STRINGS, fmt.strings_block(list(new_strings))))
        if frame_rows:
            for kind, col in zip(fmt.FRAME_COLUMNS, frame_cols, strict=True):
                parts.append((kind, fmt.column_block(kind, np.array(col, dtype=np.int64))))
        if stacks:
            parts.append((fmt.K_STK_LEN, fmt.column_block(fmt.K_STK_LEN, np.array(stk_len, dtype=np.int64))))
            parts.append((fmt.K_STK_FRM, fmt.column_block(fmt.K_STK_FRM, np.array(stk_frm, dtype=np.int64))))
        if len(hinted):
            gaps = np.diff(hinted, prepend=-1) - 1
            if gaps.any():
                parts.append((fmt.K_HINT_GAP, fmt.column_block(fmt.K_HINT_GAP, gaps)))
            parts.append((fmt.K_HINT_SIZE, fmt.column_block(fmt.K_HINT_SIZE, size[hinted])))
            parts.append((fmt.K_HINT_XPB, fmt.column_block(fmt.K_HINT_XPB, xpb[hinted])))
            if (unit[hinted] > 1).any():
                parts.append((fmt.K_HINT_UNIT, fmt.column_block(fmt.K_HINT_UNIT, unit[hinted])))
        if len(listed):
            gaps = np.diff(listed, prepend=-1) - 1
            if gaps.any():
                parts.append((fmt.K_SITE_GAP, fmt.column_block(fmt.K_SITE_GAP, gaps)))
            # a checkpoint has no previous peak to go by: its peak counters are predicted by the live ones
            from_live = peak_moved or checkpoint
            if len(listed) == n:  # every site: no gather needed
                res = fmt.encode_counters(prev, state, size, xpb, from_live, unit)
            else:
                res = fmt.encode_counters(
                    prev[:, listed], state[:, listed], size[listed], xpb[listed], from_live, unit[listed]
                )
            for kind, col in zip(fmt.COUNTER_COLUMNS, res, strict=True):
                if col.any():  # an all-zero column is left out
                    parts.append((kind, fmt.column_block(kind, col)))
        out = bytearray()
        entries = []
        at = self.offset
        for kind, data in parts:
            entries.append(fmt.TocEntry(kind, at + len(out), at + len(out) + len(data)))
            out += data
        toc_start = at + len(out)
        out += fmt.toc_block(fmt.K_SNAPTOC, entries)
        snaptoc = fmt.TocEntry(fmt.K_SNAPTOC, toc_start, at + len(out), int(info["wall_ns"]))  # type: ignore[call-overload]
        tables = [fmt.TocEntry(e.kind, e.start, e.end, seq) for e in entries if e.kind in fmt.TABLE_KINDS]
        k = seq + 1
        first = k - fmt.lowbit(k) + 1  # this outer TOC covers snapshots first..k
        outer_entries = [self.filemeta_entry]
        if first > 1:
            ps, pe = self.outer[first - 2]
            outer_entries.append(fmt.TocEntry(fmt.K_PREVTOC, ps, pe, first - 1))
        outer_entries += [*self.snaptocs[first - 1 :], snaptoc]
        for covered in [*self.tables[first - 1 :], tables]:
            outer_entries += covered
        outer_start = at + len(out)
        out += fmt.toc_block(fmt.K_OUTERTOC, outer_entries)
        outer_end = at + len(out)
        out += fmt.U64.pack(outer_start)
        pending = _Pending(new_strings, new_frames, n, state, size, xpb, unit, quantum, snaptoc, tables,
                           info.get("peak"), (outer_start, outer_end))
        return bytes(out), pending

    def commit(self, written: int, pending: _Pending) -> None:
        if not self.n_snapshots:
            self.first_wall_ns = int(pending.snaptoc.key)
        self.strings.update(pending.strings)
        self.frames.update(pending.frames)
        self.n_sites = pending.n_sites
        self.prev = pending.state
        self.size_hint = pending.size
        self.xpb_hint = pending.xpb
        self.unit_hint = pending.unit
        self.quantum = pending.quantum
        self.snaptocs.append(pending.snaptoc)
        self.tables.append(pending.tables)
        self.last_peak = pending.peak
        self.outer.append(pending.outer)
        self.n_snapshots += 1
        self.offset += written

    def write(self, info: dict[str, object], state: np.ndarray, stacks: Sequence[Stack], held: bool = False) -> int:
        """Encode and write one snapshot; on an OSError the file is cut back to its last whole snapshot and
        nothing is committed. Returns the bytes written. `held`: written but not committed, so the next write
        goes over it (StoreWriter.hold)."""
        data, pending = self.encode(info, state, stacks)
        end = self.offset + len(data)
        try:
            _pwrite_all(self.fd, data, self.offset)
            if self.torn or self.held_end > end:  # no bytes of an earlier, longer tail after this one
                os.ftruncate(self.fd, end)
                self.torn = False
        except OSError:
            self.held_end = 0
            try:
                os.ftruncate(self.fd, self.offset)
            except OSError:
                self.torn = True  # the next write overwrites the tail from the same offset
            raise
        if held:
            self.held_end = end
            return len(data)
        self.held_end = 0
        self.commit(len(data), pending)
        return len(data)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self, sync: bool) -> None:
        if self.fd < 0:
            return
        try:
            if self.held_end:  # a segment closed in order ends at its last appended snapshot
                os.ftruncate(self.fd, self.offset)
                self.held_end = 0
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1


def _quantum(before: np.ndarray, state: np.ndarray) -> np.ndarray:
    """Each site's greatest common divisor of every allocated and freed byte total it has had: `before` (0 for
    none yet, and for sites new in `state`) taken with `state`'s. A gcd only where a total is no multiple of the
    divisor so far: most sites have found theirs after a few samples."""
    n = state.shape[1]
    q = np.zeros(n, dtype=np.int64)
    q[: len(before)] = before
    tot_b, frd_b = state[1], state[3]
    qm = np.maximum(q, 1)
    redo = np.flatnonzero((q == 0) | (tot_b % qm != 0) | (frd_b % qm != 0))
    if len(redo):
        q[redo] = np.gcd(np.gcd(q[redo], tot_b[redo]), frd_b[redo])
    return q


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Sweep:
    """What a sweep of the store's ended histories deleted, and what it could not."""

    segments_deleted: int = 0
    directories_removed: int = 0
    errors: list[str] = field(default_factory=list)


def sweep_ended(root: Path, max_age_s: float | None, busy: Container[str], now: float | None = None) -> Sweep:
    """Delete the segments older than `max_age_s` in the directories under root that no writer holds (`busy`
    names the held ones), and each such directory once it holds nothing. A writer applies the store's retention
    to its own directory only, so without this an ended process's history stayed for good and a fleet's store
    grew with every process it saw. Age is a segment's modification time, as for a writer."""
    done = Sweep()
    if max_age_s is None:
        return done
    now = time.time() if now is None else now
    try:
        names = sorted(n for n in os.listdir(root) if n.isdigit() and n not in busy)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            done.errors.append(f"store: cannot list {root}: {exc.strerror}")
        return done

    def old(path: Path) -> bool:
        return now - path.stat().st_mtime > max_age_s

    for name in names:
        directory = root / name
        deleted = 0
        for seg in segment_paths(directory):
            try:
                if old(seg):
                    seg.unlink()
                    deleted += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                done.errors.append(f"store: cannot delete {seg}: {exc.strerror}")
        done.segments_deleted += deleted
        try:
            # Only when empty, and emptied here or long unchanged: a writer may have just made it.
            if deleted or old(directory):
                directory.rmdir()
                done.directories_removed += 1
        except OSError:
            pass
    return done


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
        existing = segment_paths(self.directory)
        self._next_seq = int(SEGMENT_RE.match(existing[-1].name).group(1)) + 1 if existing else 1  # type: ignore[union-attr]
        self._segment: SegmentFile | None = None
        self._number: dict[int, int] = {}  # site id -> site number (the order sites were first seen)
        self._lookup = np.full(1024, -1, dtype=np.int64)  # the same for ids below _LOOKUP_LIMIT
        self._stacks: list[Stack] = []  # by site number
        self._state = np.zeros((N_FIELDS, 0), dtype=np.int64)  # counters last written, by site number
        self._lock = threading.Lock()
        self._dirty_since: float | None = None  # monotonic time of the oldest write not yet synced
        self._last_sync = time.monotonic()
        self._syncer: threading.Thread | None = None
        self._closing = threading.Event()
        self._wake = threading.Condition(self._lock)

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
            self._maintain()
        if seg is None:
            path = self.directory / f"seg-{self._next_seq:08d}.hss"
            seg = SegmentFile(path, self.meta, seq=self._next_seq, checkpoint_every=self.checkpoint_every, extra={})
            self._next_seq += 1
            self._segment = seg
            if self.sync_policy.mode != "never":
                _fsync_dir(self.directory)  # the new file's name survives a power loss
            self._maintain()
        return seg

    def _after_write(self, seg: SegmentFile) -> None:
        policy = self.sync_policy
        now = time.monotonic()
        if policy.mode == "always":
            self._sync(seg, now)
        elif policy.mode == "interval" and self._dirty_since is None:
            # Never in the caller's way: a thread syncs at most `interval` after the oldest unsynced write.
            self._dirty_since = now
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._sync_loop, name="store-sync", daemon=True)
                self._syncer.start()
            else:
                self._wake.notify()

    def _sync(self, seg: SegmentFile, now: float) -> None:
        try:
            seg.sync()
        except OSError as exc:
            self.stats.write_errors += 1
            self.stats.last_error = f"store: cannot sync {seg.path}: {exc.strerror}"
            return
        self.stats.syncs += 1
        self._last_sync = now
        self._dirty_since = None

    def _sync_loop(self) -> None:
        """Syncs what appends left unsynced at most `interval` after it was written, when no later append
        does it first (samples may come less often than the interval, or stop)."""
        interval = self.sync_policy.interval
        with self._lock:
            while not self._closing.is_set():
                if self._dirty_since is None:
                    self._wake.wait()
                    continue
                left = self._dirty_since + interval - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                seg = self._segment
                self._dirty_since = None
                if seg is None:
                    continue
                # The sync runs without the lock (appends go on meanwhile), on a duplicate of the descriptor,
                # which a rotation closing the segment cannot pull away.
                started = time.monotonic()
                fd = os.dup(seg.fd)
                self._lock.release()
                try:
                    os.fdatasync(fd)
                    error = None
                except OSError as exc:
                    error = exc
                finally:
                    os.close(fd)
                    self._lock.acquire()
                if error is not None:
                    self.stats.write_errors += 1
                    self.stats.last_error = f"store: cannot sync {seg.path}: {error.strerror}"
                else:
                    self.stats.syncs += 1
                    self._last_sync = max(self._last_sync, started)

    def close(self) -> None:
        with self._lock:
            self._closing.set()
            self._wake.notify_all()
            if self._segment is not None:
                self._segment.close(sync=self.sync_policy.mode != "never")
                self._segment = None
        if self._syncer is not None:
            self._syncer.join()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- retention ----------------------------------------------------------------------------------

    def _maintain(self) -> None:
        """Thin, then delete closed segments by age and size. Problems are counted, never raised: the
        profile matters more than its old history."""
        current = self._segment.path if self._segment is not None else None
        closed = [p for p in segment_paths(self.directory) if p != current]
        now = self.clock()
        r = self.retention
        for p in closed:
            try:
                st = p.stat()
            except OSError:
                continue
            age = now - st.st_mtime
            if r.max_age_s is not None and age > r.max_age_s:
                self._delete(p)
                continue
            rules = [t for t in r.thin if age >= t.older_than_s]
            if rules:
                rule = max(rules, key=lambda t: t.older_than_s)
                self._thin(p, rule.keep_every_s)
        if r.max_bytes is not None:
            closed = [p for p in segment_paths(self.directory) if p != current]
            sizes = {}
            for p in [*closed, *([current] if current else [])]:
                try:
                    sizes[p] = p.stat().st_size
                except OSError:
                    sizes[p] = 0
            total = sum(sizes.values())
            for p in closed:
                if total <= r.max_bytes:
                    break
                total -= sizes[p]
                self._delete(p)

    def _delete(self, path: Path) -> None:
        try:
            path.unlink()
            self.stats.segments_deleted += 1
        except OSError as exc:
            self.stats.last_error = f"store: cannot delete {path}: {exc.strerror}"

    def _thin(self, path: Path, keep_every_s: float) -> None:
        try:
            dropped = thin_segment(path, keep_every_s)
        except (OSError, ValueError, fmt.FormatError, fmt.SnapshotUnavailable) as exc:
            self.stats.last_error = f"store: cannot thin {path}: {exc}"
            return
        if dropped is not None:
            self.stats.segments_thinned += 1
            self.stats.snapshots_thinned += dropped


_INFO_KEYS = ("wall_ns", "time", "heap", "extra", "stacks", "mapped", "rss", "peak")


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


def thin_segment(path: Path, keep_every_s: float) -> int | None:
    """Rewrite a closed segment keeping its first and last snapshots and, between them, one at least every
    `keep_every_s` seconds. Counters are cumulative, so totals stay exact; what goes is resolution.
    Returns the snapshots dropped, or None when the segment was already that thin. The rewrite goes to a
    temporary file renamed over the old one, so a crash leaves one or the other."""
    from agent.store.reader import SegmentReader  # the reader builds on this module's format only

    reader = SegmentReader(path)
    meta_json = reader.filemeta
    if float(meta_json.get("thinned_every_s", 0)) >= keep_every_s:  # type: ignore[arg-type]
        return None
    refs = reader.snapshots()
    if not refs:
        return None
    step_ns = int(keep_every_s * 1e9)
    keep = [refs[0]]
    for ref in refs[1:-1]:
        if ref.wall_ns - keep[-1].wall_ns >= step_ns:
            keep.append(ref)
    if len(refs) > 1:
        keep.append(refs[-1])
    tmp = path.with_name(path.name + ".thin")
    tmp.unlink(missing_ok=True)
    seg = SegmentFile(
        tmp,
        reader.meta,
        seq=int(meta_json.get("segment", 0)),  # type: ignore[call-overload]
        checkpoint_every=int(meta_json.get("checkpoint_every", 100)),  # type: ignore[call-overload]
        extra={"thinned_every_s": keep_every_s},
    )
    try:
        for ref in keep:
            snap = reader.load(ref)
            info = {key: snap.info.get(key) for key in _INFO_KEYS}
            seg.write(info, snap.counters, reader.site_stacks[seg.n_sites : snap.counters.shape[1]])
        seg.close(sync=True)
        st = path.stat()
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))  # its age is that of its history, not of the rewrite
        os.replace(tmp, path)
    except BaseException:
        seg.close(sync=False)
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return len(refs) - len(keep)
