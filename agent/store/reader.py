"""The store's reader: snapshots by time, back as model objects, from files that may have been cut short or
damaged. Whatever cannot be read is skipped and reported (`StoreReader.skipped`), never raised.

    reader = StoreReader(directory)            # a target's directory (or one segment file)
    for ref in reader.snapshots(start_ns, end_ns):
        snap = reader.load(ref)
        snap.sites()                           # dict[Stack, SiteCounts]
"""

from __future__ import annotations

import bisect
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np

from agent.model.stack import Frame, SiteCounts, Stack
from agent.store import format as fmt
from agent.store.files import segment_paths
from agent.store.format import FormatError, SnapshotUnavailable
from agent.store.sample import PeakState, StoreMeta
from agent.store.tables import FAST_HASH, frame_hashes, make_frames, make_stacks, no_gc, tuple_hashes

# SiteCounts' own field order, and where each field is among the stored counters
_SITECOUNTS_FIELDS = tuple(f.name for f in fields(SiteCounts))
_TO_SITECOUNTS = [fmt.COUNTER_FIELDS.index(name) for name in _SITECOUNTS_FIELDS]


@dataclass(frozen=True)
class Skipped:
    """Something the reader could not use: where, how much, and why."""

    path: str
    what: str  # "3 snapshots (12..14)", "517 bytes at the end"
    reason: str
    snapshots: int = 0  # complete-looking snapshots lost (0 for a torn tail: it never was complete)

    def __str__(self) -> str:
        return f"{self.path}: skipped {self.what}: {self.reason}"


class SnapshotRef(NamedTuple):
    """Where one snapshot is: its segment, its number there, its wall clock and its table of contents. (A named
    tuple: an index makes one per snapshot, a frozen dataclass costs three times as much to make.)"""

    segment: SegmentReader
    seq: int
    wall_ns: int
    toc: fmt.TocEntry

    @property
    def info(self) -> dict:  # type: ignore[type-arg]
        return self.segment.info(self)

    @property
    def time(self) -> int:
        return int(self.info["time"])

    @property
    def total_B(self) -> int:
        i = self.info
        return int(i["heap"]) + int(i["extra"]) + int(i["stacks"])

    @property
    def peak(self) -> PeakState | None:
        return _peak(self.info.get("peak"))


def _peak(obj: object) -> PeakState | None:
    if not isinstance(obj, dict):
        return None
    wall = obj.get("wall_ns")
    return PeakState(int(obj["time"]), int(obj["heap"]), int(obj["extra"]), int(obj.get("stacks", 0)), wall)


class StoredSnapshot:
    """One snapshot read back: totals, and counters per site (numbers of the segment's site table)."""

    def __init__(self, ref: SnapshotRef, info: dict, counters: np.ndarray, stacks: list[Stack]) -> None:  # type: ignore[type-arg]
        self.ref = ref
        self.info = info
        self.counters = counters  # (9, n_sites) in format.COUNTER_FIELDS order
        self.site_stacks = stacks  # by site number (the segment's, shared)

    @property
    def wall_ns(self) -> int:
        return int(self.info["wall_ns"])

    @property
    def time(self) -> int:
        return int(self.info["time"])

    @property
    def heap_B(self) -> int:
        return int(self.info["heap"])

    @property
    def extra_B(self) -> int:
        return int(self.info["extra"])

    @property
    def stacks_B(self) -> int:
        return int(self.info["stacks"])

    @property
    def mapped_B(self) -> int | None:
        v = self.info.get("mapped")
        return None if v is None else int(v)

    @property
    def rss_B(self) -> int | None:
        v = self.info.get("rss")
        return None if v is None else int(v)

    @property
    def rate(self) -> int | None:
        """Sampled mode: the rate in force when it was taken (the sampling budget may raise it above the asked
        rate); None in exact mode, and in a history written before it was stored."""
        v = self.info.get("rate")
        return None if v is None else int(v)

    @property
    def peak(self) -> PeakState | None:
        return _peak(self.info.get("peak"))

    def column(self, name: str) -> np.ndarray:
        return self.counters[fmt.COUNTER_FIELDS.index(name)]

    def sites(self) -> dict[Stack, SiteCounts]:
        """Counters per stack; sites with equal stacks add up."""
        cols = self.counters[_TO_SITECOUNTS].tolist()  # SiteCounts' fields in its order, a list each
        n = self.counters.shape[1]
        stacks = self.site_stacks[:n]
        # Mostly one site per stack: one hash per stack; the merging loop only when some stacks repeat.
        with no_gc():
            out = dict(zip(stacks, map(SiteCounts, *cols), strict=True))
        if len(out) == n:
            return out
        out = {}
        for stack, row in zip(stacks, zip(*cols, strict=True), strict=True):
            have = out.get(stack)
            if have is None:
                out[stack] = SiteCounts(*row)
            else:
                for name, v in zip(_SITECOUNTS_FIELDS, row, strict=True):
                    setattr(have, name, getattr(have, name) + v)
        return out


_State = tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (seq, counters, size, extra, unit hints)


class _Run:
    """Residuals of consecutive snapshots with the same hints, summed. Where a site's peak moved, the peak is
    its live counters at that (last) move plus the peak residuals since: kept as the sum at the move."""

    def __init__(self, n: int) -> None:
        self.acc = np.zeros((len(fmt.COUNTER_FIELDS), n), dtype=np.int64)
        self.moved: np.ndarray | None = None  # sites whose peak moved in the run
        self.at_move: np.ndarray | None = None  # acc at each site's last move
        self.peak_since: np.ndarray | None = None  # peak residuals from that move on
        # rows of acc changed since at_move was last copied for every site (a move of all sites, the usual
        # case, then copies only those)
        self.dirty: set[int] = set()

    def add(self, idx: np.ndarray | None, res: dict[int, np.ndarray], peak_moved: bool) -> None:
        """Add one snapshot's residuals: `res` maps a counter's number to its column (absent: zeros)."""
        acc = self.acc
        for i, col in res.items():
            if idx is None:
                acc[i] += col
            else:
                acc[i, idx] += col
        self.dirty.update(res)
        if peak_moved:
            if self.moved is None:
                n = acc.shape[1]
                self.moved = np.zeros(n, dtype=bool)
                self.at_move = np.zeros_like(acc)
                self.peak_since = np.zeros((2, n), dtype=np.int64)
                self.dirty = set(range(len(acc)))
            assert self.at_move is not None and self.peak_since is not None
            if idx is None:
                self.moved[:] = True
                for i in self.dirty:
                    self.at_move[i] = acc[i]
                self.dirty = set()
                for j, peak_res in enumerate((res.get(7), res.get(8))):
                    self.peak_since[j] = 0 if peak_res is None else peak_res
            else:
                self.moved[idx] = True
                self.at_move[:, idx] = acc[:, idx]
                for j, peak_res in enumerate((res.get(7), res.get(8))):
                    self.peak_since[j, idx] = 0 if peak_res is None else peak_res
        elif self.peak_since is not None:
            for j, peak_res in enumerate((res.get(7), res.get(8))):
                if peak_res is None:
                    continue
                if idx is None:
                    self.peak_since[j] += peak_res
                else:
                    self.peak_since[j, idx] += peak_res

    def apply(self, prev: np.ndarray, size: np.ndarray, xpb: np.ndarray, unit: np.ndarray) -> np.ndarray:
        new = fmt.advance(prev, self.acc, size, xpb, unit)
        if self.moved is not None:
            assert self.at_move is not None and self.peak_since is not None
            at = fmt.advance(prev, self.at_move, size, xpb, unit)
            m = self.moved
            new[7, m] = at[5, m] + self.peak_since[0, m]
            new[8, m] = at[6, m] + self.peak_since[1, m]
        return new


class SegmentReader:
    """One segment file: its index from the outer TOC chain (or, when the tail is torn, a forward scan), and
    snapshots decoded on demand, rolled forward from the nearest checkpoint."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.skipped: list[Skipped] = []
        self._refs: list[SnapshotRef] = []
        self._indexed = False
        self._body = 0
        self._by_seq: dict[int, SnapshotRef] = {}
        self._table_blocks: dict[int, dict[bytes, fmt.TocEntry]] = {}  # seq -> its table blocks
        self._infos: dict[int, dict] = {}  # type: ignore[type-arg]
        self.filemeta: dict = {}  # type: ignore[type-arg]
        self.meta = StoreMeta(pid=0, cmd="")
        # Tables, decoded up to snapshot _tables_upto (inclusive)
        self.strings: list[str] = []
        self.frames: list[Frame] = []
        self.site_stacks: list[Stack] = []
        self._frame_hashes = np.zeros(0, dtype=np.int64)  # hash of each frame, for the stacks' hashes
        self._tables_upto = -1
        self._tables_broken: int | None = None  # first snapshot whose tables could not be read
        self._state: _State | None = None  # the last decoded snapshot
        # stack_hashes' tables as of a snapshot: (its seq, strings, frame hashes, stack hashes)
        self._hashed: tuple[int, list[str], np.ndarray, np.ndarray] | None = None
        self._rolling = 0  # the snapshot _roll is at
        self._bad: dict[int, str] = {}  # seq -> why it cannot be decoded
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._data: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as exc:
            self._data = b""
            self._skip("the file", f"cannot read it: {exc.strerror}")
            return
        self._open()

    def _skip(self, what: str, reason: str, snapshots: int = 0) -> None:
        self.skipped.append(Skipped(str(self.path), what, reason, snapshots))

    # ---- index ----------------------------------------------------------------------------------------

    def _open(self) -> None:
        data = self._data
        if len(data) < len(fmt.MAGIC) or data[: len(fmt.MAGIC)] != fmt.MAGIC:
            self._skip("the file", "no heapscope store identification at its start")
            return
        try:
            b = fmt.read_block(data, len(fmt.MAGIC))
            if b.kind != fmt.K_FILEMETA:
                raise FormatError(f"first block is {b.kind.decode()}, not filemeta")
            self.filemeta = fmt.parse_json(b)
        except FormatError as exc:
            self._skip("the file", f"its filemeta block is unreadable ({exc})")
            return
        self.meta = StoreMeta.from_json(self.filemeta)
        self.checkpoint_every = max(1, int(self.filemeta.get("checkpoint_every", 1)))
        self._body = b.end
        self._indexed = False  # the index is read when first needed: a read by time opens one segment

    def _ensure_index(self) -> None:
        if self._indexed or not self.filemeta:
            return
        self._indexed = True
        with no_gc():  # a TOC entry and a reference per snapshot, thousands of tuples
            refs = self._index_from_tail()
            if refs is None:
                refs = self._index_by_scan()
        self._refs = refs
        self._by_seq = {r.seq: r for r in refs}

    def last_wall_ns(self) -> int | None:
        """The wall clock of the segment's last snapshot, from its last outer TOC alone when the file ends
        whole (one block read), else from its index. None when it has no snapshot."""
        if not self.filemeta:
            return None
        if not self._indexed and len(self._data) >= self._body + 8:
            try:
                (at,) = fmt.U64.unpack_from(self._data, len(self._data) - 8)
                b = fmt.read_block(self._data, at)
                if b.kind == fmt.K_OUTERTOC and b.end == len(self._data) - 8:
                    tocs = [e for e in fmt.decode_toc(b) if e.kind == fmt.K_SNAPTOC]
                    if tocs:
                        return tocs[-1].key
            except FormatError:
                pass
        self._ensure_index()
        return self._refs[-1].wall_ns if self._refs else None

    def extent(self) -> tuple[int, int | None, int | None]:
        """(snapshots, wall clock of the first, of the last) without indexing the segment when the file ends
        whole: the last outer TOC gives the count (its prevtoc's key plus its snaptoc entries) and the last
        wall clock, the snapinfo right after filemeta the first. Else from the index."""
        data = self._data
        if self.filemeta and not self._indexed and len(data) >= self._body + 8:
            try:
                (at,) = fmt.U64.unpack_from(data, len(data) - 8)
                b = fmt.read_block(data, at)
                if b.kind == fmt.K_OUTERTOC and b.end == len(data) - 8:
                    toc = fmt.decode_toc(b)
                    tocs = [e for e in toc if e.kind == fmt.K_SNAPTOC]
                    before = max((e.key for e in toc if e.kind == fmt.K_PREVTOC), default=0)
                    first = fmt.parse_json(fmt.read_block(data, self._body))
                    if tocs and first.get("seq") == 0:
                        return before + len(tocs), int(first["wall_ns"]), tocs[-1].key
            except (FormatError, KeyError, ValueError, TypeError):
                pass
        self._ensure_index()
        refs = self._refs
        return len(refs), refs[0].wall_ns if refs else None, refs[-1].wall_ns if refs else None

    def _index_from_tail(self) -> list[SnapshotRef] | None:
        """The index from the outer TOC chain, when the file ends with a whole outer TOC and its offset."""
        data = self._data
        if len(data) < self._body + 8:
            return None if len(data) > self._body else []
        (at,) = fmt.U64.unpack_from(data, len(data) - 8)
        entries: list[fmt.TocEntry] = []
        tables: list[fmt.TocEntry] = []
        expect_end = len(data) - 8
        try:
            while True:
                b = fmt.read_block(data, at)
                if b.kind != fmt.K_OUTERTOC or b.end != expect_end:
                    return None
                toc = fmt.decode_toc(b)
                entries[:0] = [e for e in toc if e.kind == fmt.K_SNAPTOC]
                tables[:0] = [e for e in toc if e.kind in fmt.TABLE_KINDS]
                prev = [e for e in toc if e.kind == fmt.K_PREVTOC]
                if not prev:
                    break
                at, expect_end = prev[0].start, prev[0].end
        except FormatError:
            return None
        for e in tables:
            self._table_blocks.setdefault(e.key, {})[e.kind] = e
        return [SnapshotRef(self, i, e.key, e) for i, e in enumerate(entries)]

    def _index_by_scan(self) -> list[SnapshotRef]:
        """Read the blocks from the start, as MoarVM's readers do when the end does not point at a TOC. A damaged
        block is stepped over when its header is sound, else the scan resumes at the next snapinfo block."""
        data = self._data
        at = self._body
        refs: list[SnapshotRef] = []
        pending_since: int | None = None  # start of the current snapshot's blocks
        pending_tables: dict[bytes, fmt.TocEntry] = {}
        self._table_blocks = {}
        while at < len(data):
            try:
                b = fmt.read_block(data, at)
            except FormatError as exc:
                nxt = data.find(fmt.kind_bytes(fmt.K_SNAPINFO), at + 1)
                if nxt < 0:
                    self._skip(f"{len(data) - at} bytes at the end", f"an incomplete snapshot ({exc})")
                    break
                lost = self._lost_between(at, nxt)
                self._skip(f"{nxt - at} bytes at offset {at}", str(exc), lost)
                at, pending_since, pending_tables = nxt, None, {}
                continue
            if b.kind == fmt.K_SNAPINFO:
                pending_since = b.start
                pending_tables = {}
            elif b.kind in fmt.TABLE_KINDS:
                pending_tables[b.kind] = fmt.TocEntry(b.kind, b.start, b.end)
            elif b.kind == fmt.K_SNAPTOC and pending_since is not None:
                try:
                    first = fmt.decode_toc(b)[0]
                    info = fmt.parse_json(fmt.read_block(data, first.start))
                    wall, seq = int(info["wall_ns"]), int(info["seq"])
                except (FormatError, IndexError, KeyError, ValueError, TypeError) as exc:
                    self._skip(f"the snapshot at offset {pending_since}", f"its snapinfo is unreadable ({exc})", 1)
                else:
                    if not refs or seq > refs[-1].seq:
                        refs.append(SnapshotRef(self, seq, wall, fmt.TocEntry(fmt.K_SNAPTOC, b.start, b.end, wall)))
                        if pending_tables:
                            self._table_blocks[seq] = pending_tables
                pending_since = None
            at = b.end
            if b.kind == fmt.K_OUTERTOC:
                at += 8
        else:
            if pending_since is not None:  # whole blocks, but the snapshot's TOC never came
                self._skip(f"{len(data) - pending_since} bytes at the end", "an incomplete snapshot (no snaptoc)")
            elif at > len(data):  # an outer TOC without its offset
                self._skip(f"{len(data) - (at - 8)} bytes at the end", "an outer TOC's offset cut short")
        return refs

    def _lost_between(self, start: int, end: int) -> int:
        """Snapshots whose snapinfo started in a damaged region (each begins with one)."""
        n = 0
        at = start
        mark = fmt.kind_bytes(fmt.K_SNAPINFO)
        while True:
            at = self._data.find(mark, at, end)
            if at < 0:
                return n
            n += 1
            at += 1

    def snapshots(self) -> list[SnapshotRef]:
        self._ensure_index()
        return list(self._refs)

    def close(self) -> None:
        """Release the file's mapping (loads after this fail)."""
        if isinstance(self._data, mmap.mmap):
            self._data.close()
        self._data = b""

    def info(self, ref: SnapshotRef) -> dict:  # type: ignore[type-arg]
        info = self._infos.get(ref.seq)
        if info is None:
            info = self._infos[ref.seq] = self._read_info(ref)
        return info

    def _toc(self, ref: SnapshotRef) -> list[fmt.TocEntry]:
        b = fmt.read_block(self._data, ref.toc.start)
        if b.kind != fmt.K_SNAPTOC:
            raise FormatError(f"no snaptoc at {ref.toc.start}")
        return fmt.decode_toc(b)

    def _read_info(self, ref: SnapshotRef, toc: list[fmt.TocEntry] | None = None) -> dict:  # type: ignore[type-arg]
        try:
            if toc is None:
                toc = self._toc(ref)
            info = fmt.parse_json(fmt.read_block(self._data, toc[0].start))
            for key in ("wall_ns", "time", "heap", "extra", "stacks", "sites", "listed"):
                int(info[key])
        except (FormatError, IndexError, KeyError, ValueError, TypeError) as exc:
            return {"error": f"snapshot {ref.seq}: {exc}"}
        return info

    # ---- decoding -------------------------------------------------------------------------------------

    def _blocks(self, ref: SnapshotRef) -> tuple[dict, dict[bytes, fmt.Block]]:  # type: ignore[type-arg]
        toc = self._toc(ref)  # read once: for the snapinfo too when it is not known yet
        info = self._infos.get(ref.seq)
        if info is None:
            info = self._infos[ref.seq] = self._read_info(ref, toc)
        if "error" in info:
            raise FormatError(info["error"])
        blocks = {}
        for e in toc[1:]:
            b = fmt.read_block(self._data, e.start)
            if b.kind != e.kind:
                raise FormatError(f"snapshot {ref.seq}: {e.kind.decode()} expected at {e.start}")
            blocks[b.kind] = b
        return info, blocks

    def _extend_tables(self, upto: int) -> None:
        """Apply the table blocks (strings, frames, sites) of snapshots up to `upto`, found through the outer
        TOCs (or the scan), then check the tables against snapshot `upto`'s counts."""
        if self._tables_broken is not None:
            return
        seq = self._tables_upto
        try:
            for seq in sorted(k for k in self._table_blocks if self._tables_upto < k <= upto):
                self._apply_tables(self._table_blocks[seq])
            seq = upto
            ref = self._by_seq.get(upto)
            if ref is not None:
                info = self.info(ref)
                if "error" in info:
                    raise FormatError(info["error"])
                if len(self.site_stacks) < int(info["sites"]) or len(self.frames) < int(info["frames"]):
                    raise FormatError(f"snapshot {upto}: its tables are incomplete (a snapshot before it was lost)")
        except (FormatError, IndexError, KeyError, ValueError) as exc:
            self._tables_broken = seq
            later = [r.seq for r in self._refs if r.seq >= seq]
            self._skip(
                f"{len(later)} snapshots ({seq}..{later[-1] if later else seq})",
                f"the stack tables are unreadable from snapshot {seq} on ({exc})",
                len(later),
            )
            for s in later:
                self._bad[s] = f"stack tables unreadable from snapshot {seq}"
            return
        self._tables_upto = max(self._tables_upto, upto)

    def _apply_tables(self, kinds: dict[bytes, fmt.TocEntry]) -> None:
        with no_gc():
            self._apply_table_blocks(kinds)

    def _apply_table_blocks(self, kinds: dict[bytes, fmt.TocEntry]) -> None:
        if fmt.K_STRINGS in kinds:
            self.strings += fmt.decode_strings(self._checked(kinds[fmt.K_STRINGS]))
        if fmt.FRAME_COLUMNS[0] in kinds:
            addr, func, file, line, obj, path = (
                fmt.decode_column(self._checked(kinds[k])).tolist() for k in fmt.FRAME_COLUMNS[:6]
            )
            # Segments before subversion 2 do not say which frames are inlined calls: none is taken for one.
            inl = kinds.get(fmt.K_FRM_INLINED)
            inlined = fmt.decode_column(self._checked(inl)).tolist() if inl is not None else [0] * len(addr)
            try:
                new = make_frames(addr, func, file, line, obj, path, inlined, self.strings)
            except IndexError:
                raise FormatError("a frame refers to a string beyond the string table") from None
            self.frames += new
            self._frame_hashes = np.concatenate(
                [self._frame_hashes, np.fromiter(map(hash, new), dtype=np.int64, count=len(new))]
            )
        if fmt.K_STK_LEN in kinds:
            lens, frm = self._stack_columns(kinds, len(self.frames))
            self.site_stacks += make_stacks(self.frames, self._frame_hashes, lens, frm)

    def _stack_columns(self, kinds: dict[bytes, fmt.TocEntry], n_frames: int) -> tuple[np.ndarray, np.ndarray]:
        """A table block's stacks: their lengths, and their frame numbers concatenated (checked: in the table)."""
        lens = fmt.decode_column(self._checked(kinds[fmt.K_STK_LEN]))
        frm = fmt.decode_column(fmt.read_block(self._data, kinds[fmt.K_STK_FRM].start), int(lens.sum()))
        if (len(lens) and int(lens.min()) < 0) or (len(frm) and not 0 <= frm.min() <= frm.max() < n_frames):
            raise FormatError("a stack refers to a frame beyond the frame table")
        return lens, frm

    def stack_hashes(self, upto: int) -> np.ndarray | None:
        """hash(stack) of each site of the tables as of snapshot `upto` (at least its sites; more once a later
        snapshot was asked for), equal to the hashes of the stacks load() makes, but computed from the table
        columns alone: no frame or stack is made (a few ms for 10,000 sites, where making them takes tens), so
        sites can be matched across segments cheaply. None where the interpreter's tuple hash cannot be
        computed so, or the tables cannot be read: then load the stacks."""
        self._ensure_index()
        if not FAST_HASH or self._tables_broken is not None:
            return None
        have = self._hashed
        if have is not None and have[0] >= upto:
            return have[3]
        done, strings, frames, stacks = have if have is not None else (-1, [], np.zeros(0, np.int64),
                                                                       np.zeros(0, np.int64))
        try:
            for seq in sorted(k for k in self._table_blocks if done < k <= upto):
                kinds = self._table_blocks[seq]
                if fmt.K_STRINGS in kinds:
                    strings = strings + fmt.decode_strings(self._checked(kinds[fmt.K_STRINGS]))
                if fmt.FRAME_COLUMNS[0] in kinds:
                    addr, func, file, line, obj = (fmt.decode_column(self._checked(kinds[k]))
                                                    for k in fmt.FRAME_COLUMNS[:5])
                    frames = np.concatenate([frames, frame_hashes(addr, func, file, line, obj, strings)])
                if fmt.K_STK_LEN in kinds:
                    lens, frm = self._stack_columns(kinds, len(frames))
                    stacks = np.concatenate([stacks, tuple_hashes(frames, frm, lens)])
        except (FormatError, IndexError, KeyError, ValueError):
            return None
        self._hashed = (upto, strings, frames, stacks)
        return stacks

    def _checked(self, e: fmt.TocEntry) -> fmt.Block:
        b = fmt.read_block(self._data, e.start)
        if b.kind != e.kind or b.end != e.end:
            raise FormatError(f"{e.kind.decode()} expected at {e.start}")
        return b

    def _residuals(self, ref: SnapshotRef, blocks: dict[bytes, fmt.Block], info: dict, n: int):  # type: ignore[no-untyped-def,type-arg]
        """(site numbers or None for all, {counter number: its residuals}) of a snapshot's counter columns: a
        column left out (all zeros) is not in the dict."""
        listed = int(info["listed"])
        res = {}
        for i, kind in enumerate(fmt.COUNTER_COLUMNS):
            b = blocks.get(kind)
            if b is not None:
                res[i] = fmt.decode_column(b, listed, widen=False)
        gap = blocks.get(fmt.K_SITE_GAP)
        if gap is None and listed == n:  # every site, in order
            return None, res
        return self._sites_of(gap, listed, n, ref), res

    @staticmethod
    def _sites_of(gap: fmt.Block | None, rows: int, n: int, ref: SnapshotRef) -> np.ndarray:
        gaps = fmt.decode_column(gap, rows) if gap is not None else np.zeros(rows, dtype=np.int64)
        idx = np.cumsum(gaps + 1) - 1
        if rows and (idx[-1] >= n or int(gaps.min()) < 0):
            raise FormatError(f"snapshot {ref.seq}: a listed site is beyond its {n} sites")
        return idx

    def _roll(self, refs: list[SnapshotRef], state: _State | None) -> _State:
        """Apply snapshots in order to `state` (None before a checkpoint). Residuals of consecutive snapshots
        that set no hint are summed and applied once: every prediction is linear in them, the peak's too once
        the counters at its last move are known (docs/store-format.md, "Reading fast")."""
        nf = len(fmt.COUNTER_FIELDS)
        prev = size = xpb = unit = None
        if state is not None:
            _, prev, size, xpb, unit = state
        run: _Run | None = None  # residuals summed since prev
        seq = -1
        for ref in refs:
            seq = self._rolling = ref.seq
            info, blocks = self._blocks(ref)
            n = int(info["sites"])
            checkpoint = bool(info.get("checkpoint"))
            hinted = int(info.get("hinted", 0))
            if checkpoint:
                prev = np.zeros((nf, n), dtype=np.int64)
                size = np.zeros(n, dtype=np.int64)
                xpb = np.zeros(n, dtype=np.int64)
                unit = np.zeros(n, dtype=np.int64)
                run = None
            elif prev is None or size is None or xpb is None or unit is None:
                raise FormatError(f"snapshot {seq}: a delta without its previous snapshot")
            elif prev.shape[1] != n:
                if prev.shape[1] > n:
                    raise FormatError(f"snapshot {seq}: {n} sites, fewer than before")
                if run is not None:
                    prev, run = run.apply(prev, size, xpb, unit), None
                grow = n - prev.shape[1]
                prev = np.concatenate([prev, np.zeros((nf, grow), dtype=np.int64)], axis=1)
                size = np.concatenate([size, np.zeros(grow, dtype=np.int64)])
                xpb = np.concatenate([xpb, np.zeros(grow, dtype=np.int64)])
                unit = np.concatenate([unit, np.zeros(grow, dtype=np.int64)])
            idx, res = self._residuals(ref, blocks, info, n)
            if hinted:  # hints change the predictions: what was summed so far goes in first
                if run is not None:
                    prev, run = run.apply(prev, size, xpb, unit), None
                rows = self._sites_of(blocks.get(fmt.K_HINT_GAP), hinted, n, ref)
                for kind, target in ((fmt.K_HINT_SIZE, size), (fmt.K_HINT_XPB, xpb), (fmt.K_HINT_UNIT, unit)):
                    b = blocks.get(kind)
                    target[rows] = fmt.decode_column(b, hinted) if b is not None else 0
            if run is None:
                run = _Run(n)
            run.add(idx, res, checkpoint or bool(info.get("peak_moved")))
        assert prev is not None and size is not None and xpb is not None and unit is not None
        if run is not None:
            prev = run.apply(prev, size, xpb, unit)
        return seq, prev, size, xpb, unit

    def load(self, ref: SnapshotRef, stacks: bool = True) -> StoredSnapshot:
        """Decode one snapshot: from the last decoded one when it is on the way, else from its checkpoint.
        stacks=False leaves the stack tables alone (their Frame objects are most of a first read's cost), for
        callers that read the counter columns only: the snapshot's site_stacks is then not filled."""
        seq = ref.seq
        if seq in self._bad:
            raise SnapshotUnavailable(self._bad[seq])
        if stacks:
            self._extend_tables(seq)
            if seq in self._bad:
                raise SnapshotUnavailable(self._bad[seq])
        start = seq - seq % self.checkpoint_every
        state: _State | None = None
        at = start
        if self._state is not None and start <= self._state[0] <= seq:
            state = self._state
            at = state[0] + 1
        try:
            todo = []
            for s in range(at, seq + 1):
                here = self._by_seq.get(s)
                if here is None:
                    self._rolling = s
                    raise FormatError(f"snapshot {s} is missing")
                todo.append(here)
            if todo:
                state = self._roll(todo, state)
        except FormatError as exc:
            end = start + self.checkpoint_every
            first = self._rolling  # the snapshot that failed: from it to the next checkpoint, nothing decodes
            hit = [r.seq for r in self._refs if first <= r.seq < end]
            for b in hit:
                self._bad[b] = str(exc)
            self._skip(
                f"{len(hit)} snapshots ({first}..{end - 1})", f"{exc}; the next checkpoint is snapshot {end}", len(hit)
            )
            self._state = None
            raise SnapshotUnavailable(str(exc)) from None
        assert state is not None
        self._state = state
        return StoredSnapshot(ref, self.info(ref), state[1], self.site_stacks if stacks else [])

    def verify(self) -> int:
        """Decode every snapshot (what load() would report, found now). Returns how many decode."""
        good = 0
        for ref in self.snapshots():
            try:
                self.load(ref)
                good += 1
            except SnapshotUnavailable:
                pass
        return good


class StoreReader:
    """A target's history: its segments in order, read as one series of snapshots."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        files = [p] if p.is_file() else segment_paths(p)
        self.path = p
        self.segments = [SegmentReader(f) for f in files]

    @property
    def skipped(self) -> list[Skipped]:
        return [s for seg in self.segments for s in seg.skipped]

    @property
    def meta(self) -> StoreMeta:
        for seg in reversed(self.segments):
            if seg.filemeta:
                return seg.meta
        return StoreMeta(pid=0, cmd="")

    def _overlapping(self, start_ns: int | None, end_ns: int | None) -> list[SegmentReader]:
        """The segments that may hold snapshots in [start_ns, end_ns]: segment i holds the wall clocks after
        segment i-1's last one, up to its own last one (so only their last outer TOCs are read here)."""
        if start_ns is None and end_ns is None:
            return list(self.segments)
        out = []
        prev_last: int | None = None
        for seg in self.segments:
            last = seg.last_wall_ns()
            if last is None:
                out.append(seg)  # empty or unreadable: indexing it says which
                continue
            if (start_ns is None or last >= start_ns) and (end_ns is None or prev_last is None or prev_last <= end_ns):
                out.append(seg)
            prev_last = last if prev_last is None else max(prev_last, last)
        return out

    def snapshots(self, start_ns: int | None = None, end_ns: int | None = None) -> list[SnapshotRef]:
        """The snapshots whose wall clock is within [start_ns, end_ns], in time order."""
        out = []
        for seg in self._overlapping(start_ns, end_ns):
            for ref in seg.snapshots():
                if (start_ns is None or ref.wall_ns >= start_ns) and (end_ns is None or ref.wall_ns <= end_ns):
                    out.append(ref)
        return out

    def before(self, wall_ns: int) -> SnapshotRef | None:
        """The last snapshot taken at or before `wall_ns`: the state the target was in then (a quiet target is
        stored rarely, and its state holds until the next snapshot)."""
        for seg in reversed(self._overlapping(None, wall_ns)):
            refs = [r for r in seg.snapshots() if r.wall_ns <= wall_ns]
            if refs:
                return refs[-1]
        return None

    def __iter__(self) -> Iterator[SnapshotRef]:
        return iter(self.snapshots())

    def load(self, ref: SnapshotRef, stacks: bool = True) -> StoredSnapshot:
        return ref.segment.load(ref, stacks)

    def at(self, wall_ns: int, stacks: bool = True) -> StoredSnapshot | None:
        """The last snapshot taken at or before `wall_ns` that can be decoded (the segments after it are not
        opened, nor those before it unless it cannot be read)."""
        segs = self._overlapping(None, wall_ns)
        for seg in reversed(segs):
            refs = seg.snapshots()
            k = bisect.bisect_right([r.wall_ns for r in refs], wall_ns)
            for ref in reversed(refs[:k]):
                try:
                    return self.load(ref, stacks)
                except SnapshotUnavailable:
                    continue
        return None

    def verify(self) -> int:
        return sum(seg.verify() for seg in self.segments)

    def extent(self) -> tuple[int, int | None, int | None]:
        """(snapshots, wall clock of the first, of the last), from each segment's tail (SegmentReader.extent)."""
        count, first, last = 0, None, None
        for seg in self.segments:
            n, f, la = seg.extent()
            count += n
            if f is not None and (first is None or f < first):
                first = f
            if la is not None and (last is None or la > last):
                last = la
        return count, first, last

    def close(self) -> None:
        for seg in self.segments:
            seg.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
