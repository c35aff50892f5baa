"""One segment file being written: its tables (strings, frames, sites), its snapshots and tables of contents, each
snapshot with a single write at the file's logical end (docs/store-format.md). The writer (agent.store.writer)
appends through it; thinning (agent.store.retention) rewrites a closed segment with it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.model.stack import Frame, Stack
from agent.store import format as fmt
from agent.store.sample import StoreMeta

N_FIELDS = len(fmt.COUNTER_FIELDS)
# A snapshot's info, as written: what a thinned copy keeps of each (agent.store.retention)
INFO_KEYS = ("wall_ns", "time", "heap", "extra", "stacks", "mapped", "rss", "peak")


def _frame_strings(f: Frame) -> tuple[str | None, ...]:
    return (f.function, f.file, f.obj, f.path)


@dataclass
class _Body:
    """A snapshot's blocks but its info (SegmentFile._body): `counts` go into its info; the rest is what it adds
    to the segment's state once committed."""

    counts: dict[str, object]
    parts: list[tuple[bytes, bytes]]
    strings: dict[str, int]
    frames: dict[Frame, int]
    state: np.ndarray
    size: np.ndarray
    xpb: np.ndarray
    unit: np.ndarray
    quantum: np.ndarray


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
        self._held: tuple[np.ndarray, bool, _Body] | None = None  # _held_body's last (state, peak moved, body)
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
        return self._assemble(info, self._body(state, stacks, info.get("peak") != self.last_peak))

    def _held_body(self, info: dict[str, object], state: np.ndarray) -> _Body:
        """A held snapshot's body: the last one held when nothing was committed since and the counters are the
        same array (a quiet target's looks differ only in their info), so that a quiet look costs the daemon
        its write, not the counters' encoding again (postgres's quiet processes under pgbench: 0.34 -> 0.15 ms)."""
        peak_moved = info.get("peak") != self.last_peak
        cached = self._held  # dropped by each commit: what a body depends on besides these two changes only there
        if cached is not None and cached[0] is state and cached[1] == peak_moved:
            return cached[2]
        body = self._body(state, [], peak_moved)
        self._held = (state, peak_moved, body)
        return body

    def _body(self, state: np.ndarray, stacks: Sequence[Stack], peak_moved: bool) -> _Body:
        """Everything of a snapshot but its info and tables of contents: the blocks of its tables and counters."""
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

        counts = {
            "peak_moved": peak_moved,
            "seq": seq,
            "checkpoint": checkpoint,
            "listed": len(listed),
            "hinted": len(hinted),
            "sites": n,
            "frames": len(self.frames) + len(new_frames),
            "strings": len(self.strings) + len(new_strings),
        }
        parts: list[tuple[bytes, bytes]] = []
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
        return _Body(counts, parts, new_strings, new_frames, state, size, xpb, unit, quantum)

    def _assemble(self, info: dict[str, object], body: _Body) -> tuple[bytes, _Pending]:
        """The snapshot's bytes: its info, the body's blocks, its inner and outer tables of contents."""
        info = {**info, **body.counts}
        seq = self.n_snapshots
        parts = [(fmt.K_SNAPINFO, fmt.json_block(fmt.K_SNAPINFO, info)), *body.parts]
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
        pending = _Pending(body.strings, body.frames, body.state.shape[1], body.state, body.size, body.xpb, body.unit,
                           body.quantum, snaptoc, tables, info.get("peak"), (outer_start, outer_end))
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
        self._held = None

    def write(self, info: dict[str, object], state: np.ndarray, stacks: Sequence[Stack], held: bool = False) -> int:
        """Encode and write one snapshot; on an OSError the file is cut back to its last whole snapshot and
        nothing is committed. Returns the bytes written. `held`: written but not committed, so the next write
        goes over it (StoreWriter.hold)."""
        if held and not stacks:
            data, pending = self._assemble(info, self._held_body(info, state))
        else:
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
