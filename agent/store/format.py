"""The byte layout of a store segment (docs/store-format.md is its specification; this module is the one
place that encodes and decodes it).

Modelled on MoarVM's heap-snapshot format v3: a 16-byte identification, then blocks that start with an
8-byte kind name; columns of fixed-width integers compressed with zstd; string, frame and stack tables written
as deltas; a table of contents per snapshot, and an outer table of contents written again after every snapshot
and followed by its own offset, so that a reader finds the last complete snapshot from the end of the file.
Differences from MoarVM's, and why:
- every block ends with a CRC-32, so that a torn or corrupted block is recognised, not decoded;
- the outer TOC written after snapshot k lists only the last lowbit(k) snapshots and points to the outer TOC
  of snapshot k - lowbit(k): rewriting the whole list after each of 86,400 snapshots a day would make the file
  grow quadratically, and a chain of single entries would take 86,400 reads to walk. This way each outer TOC
  holds two entries on average and any file is indexed in at most log2(snapshots) reads.
- the per-site counters of a snapshot are residuals against a prediction from the previous snapshot (see
  `encode_counters`), which are zero for most fields of most sites.
"""

from __future__ import annotations

import json
import mmap
import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import zstandard

MAGIC = b"HeapscopeStore01"  # 16 bytes
assert len(MAGIC) == 16
FORMAT_SUBVERSION = 3

BLOCK_HEADER = struct.Struct("<8sHQ")  # kind, entry size, payload size
BLOCK_TRAILER = struct.Struct("<I")  # CRC-32 of header and payload
TOC_ENTRY = struct.Struct("<8sQQq")  # kind, start, end, key
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
BLOCK_OVERHEAD = BLOCK_HEADER.size + BLOCK_TRAILER.size

# Block kinds.
K_FILEMETA = b"filemeta"
K_SNAPINFO = b"snapinfo"
K_STRINGS = b"strings"
K_SNAPTOC = b"snaptoc"
K_OUTERTOC = b"outertoc"
K_PREVTOC = b"prevtoc"  # an outer TOC entry pointing to the previous outer TOC of the chain
# Frame table columns: one row per new frame. frm_inl (subversion 2 on): 1 for an inlined call, shown above the
# function it was inlined into at the same address (Frame.inlined); older segments lack it.
K_FRM_INLINED = b"frm_inl"
FRAME_COLUMNS = (b"frm_addr", b"frm_func", b"frm_file", b"frm_line", b"frm_obj", b"frm_path", K_FRM_INLINED)
# Site (stack) table: frames per new site, then their frame numbers, innermost first.
K_STK_LEN = b"stk_len"
K_STK_FRM = b"stk_frm"
# Per-snapshot counter columns: one row per site listed in the snapshot.
K_SITE_GAP = b"site_gap"
# Per-snapshot hint columns: sites whose hints are set by this snapshot (gaps as site_gap), and the hints.
K_HINT_GAP = b"h_gap"
K_HINT_SIZE = b"h_size"
K_HINT_XPB = b"h_xpb"
# subversion 3 on: the byte unit of a site's byte residuals (older segments lack it: unit 1)
K_HINT_UNIT = b"h_unit"
COUNTER_FIELDS = (
    "tot_blocks",
    "tot_bytes",
    "freed_blocks",
    "freed_bytes",
    "cur_blocks",
    "cur_bytes",
    "cur_extra",
    "peak_bytes",
    "peak_extra",
)
COUNTER_COLUMNS = (b"c_totbk", b"c_totb", b"c_frdbk", b"c_frdb", b"c_curbk", b"c_curb", b"c_curx", b"c_pkb", b"c_pkx")
# Blocks that add to a segment's tables: the outer TOC lists them too, so a reader finds them without
# reading every snapshot's TOC.
TABLE_KINDS = (K_STRINGS, *FRAME_COLUMNS, K_STK_LEN, K_STK_FRM)
COLUMN_KINDS = frozenset(
    (*FRAME_COLUMNS, K_STK_LEN, K_STK_FRM, K_SITE_GAP, K_HINT_GAP, K_HINT_SIZE, K_HINT_XPB, K_HINT_UNIT,
     *COUNTER_COLUMNS)
)
KNOWN_KINDS = frozenset((K_FILEMETA, K_SNAPINFO, K_STRINGS, K_SNAPTOC, K_OUTERTOC, *COLUMN_KINDS))

ZSTD_LEVEL = 3
_WIDTHS = (1, 2, 4, 8)
_DTYPES: dict[int, np.dtype] = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


class FormatError(Exception):
    """A block or file that does not follow the format (the reader turns these into skipped-data reports)."""


class SnapshotUnavailable(Exception):
    """A snapshot the reader had to skip (see StoreReader.skipped)."""


def kind_bytes(kind: bytes) -> bytes:
    return kind.ljust(8, b"\0")


def kind_name(raw: bytes) -> bytes:
    return raw.rstrip(b"\0")


# ---- blocks ---------------------------------------------------------------------------------------------


def block(kind: bytes, payload: bytes, entry_size: int = 0) -> bytes:
    head = BLOCK_HEADER.pack(kind_bytes(kind), entry_size, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + payload + BLOCK_TRAILER.pack(crc)


class Block(NamedTuple):  # a tuple: made for every block read, ten times faster than a frozen dataclass
    kind: bytes
    entry_size: int
    payload: bytes
    start: int
    end: int  # offset after the CRC


def read_block(data: bytes | mmap.mmap, at: int) -> Block:
    """The block at offset `at` of `data`, checked. FormatError when it is cut short or its CRC is wrong."""
    if at + BLOCK_HEADER.size > len(data):
        raise FormatError(f"block header at {at} cut short")
    raw_kind, entry_size, size = BLOCK_HEADER.unpack_from(data, at)
    kind = kind_name(raw_kind)
    if kind not in KNOWN_KINDS:
        raise FormatError(f"unknown block kind {raw_kind!r} at {at}")
    end = at + BLOCK_HEADER.size + size + BLOCK_TRAILER.size
    if end > len(data):
        raise FormatError(f"{kind.decode()} block at {at} cut short ({len(data) - at} of {end - at} bytes)")
    payload = bytes(data[at + BLOCK_HEADER.size : end - BLOCK_TRAILER.size])
    (crc,) = BLOCK_TRAILER.unpack_from(data, end - BLOCK_TRAILER.size)
    if zlib.crc32(payload, zlib.crc32(bytes(data[at : at + BLOCK_HEADER.size]))) != crc:
        raise FormatError(f"{kind.decode()} block at {at}: checksum mismatch")
    return Block(kind, entry_size, payload, at, end)


def json_block(kind: bytes, obj: object) -> bytes:
    return block(kind, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def parse_json(b: Block) -> dict:  # type: ignore[type-arg]
    try:
        obj = json.loads(b.payload)
    except ValueError as exc:
        raise FormatError(f"{b.kind.decode()} block at {b.start}: bad JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{b.kind.decode()} block at {b.start}: not a JSON object")
    return obj


# ---- columns --------------------------------------------------------------------------------------------

# Columns are mostly small counts that repeat little: Huffman-coded literals do better than short matches.
# Measured on the bench's delta columns: level 3 gives 13.6 KB, the fast strategy without matches shorter
# than 7 bytes 11.4 KB, in half the time. Any zstd decoder reads either.
_PARAMS = zstandard.ZstdCompressionParameters.from_level(ZSTD_LEVEL, strategy=zstandard.STRATEGY_FAST, min_match=7)


class _Codecs(threading.local):
    """One compressor and one decompressor per thread: python-zstandard's objects are not thread-safe (they
    let go of the GIL while they work), and a daemon's targets store, and its requests read, from threads of
    their own. Sharing one crashed a daemon with three targets storing at once."""

    def __init__(self) -> None:
        self.compressor = zstandard.ZstdCompressor(compression_params=_PARAMS)
        self.decompressor = zstandard.ZstdDecompressor()


_codecs = _Codecs()


def _compress(data: bytes) -> bytes:
    return _codecs.compressor.compress(data)


def _decompress(data: bytes) -> bytes:
    return _codecs.decompressor.decompress(data, max_output_size=1 << 31)


def column_width(values: np.ndarray) -> int:
    """The smallest entry size (1, 2, 4 or 8 bytes) holding every value as a signed integer."""
    if not len(values):
        return 1
    lo, hi = int(values.min()), int(values.max())
    for w in _WIDTHS:
        bound = 1 << (8 * w - 1)
        if -bound <= lo and hi < bound:
            return w
    return 8


def column_block(kind: bytes, values: np.ndarray) -> bytes:
    w = column_width(values)
    raw = values.astype(_DTYPES[w], copy=False).tobytes()
    return block(kind, _compress(raw), w)


def decode_column(b: Block, rows: int | None = None, widen: bool = True) -> np.ndarray:
    """A column block's values as int64 (widen=False: as stored, for callers that only add them to int64
    arrays). `rows`: how many the caller expects (FormatError otherwise)."""
    if b.entry_size not in _DTYPES:
        raise FormatError(f"{b.kind.decode()} block at {b.start}: entry size {b.entry_size}")
    try:
        raw = _decompress(b.payload)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{b.kind.decode()} block at {b.start}: {exc}") from None
    if len(raw) % b.entry_size:
        raise FormatError(f"{b.kind.decode()} block at {b.start}: {len(raw)} bytes is no whole number of entries")
    values: np.ndarray = np.frombuffer(raw, dtype=_DTYPES[b.entry_size])
    if widen:
        values = values.astype(np.int64)
    if rows is not None and len(values) != rows:
        raise FormatError(f"{b.kind.decode()} block at {b.start}: {len(values)} rows, expected {rows}")
    return values


# ---- strings --------------------------------------------------------------------------------------------


def strings_block(strings: Sequence[str]) -> bytes:
    parts = []
    for s in strings:
        raw = s.encode("utf-8", "surrogateescape")
        parts.append(U32.pack(len(raw)) + raw)
    return block(K_STRINGS, _compress(b"".join(parts)))


def decode_strings(b: Block) -> list[str]:
    try:
        raw = _decompress(b.payload)
    except zstandard.ZstdError as exc:
        raise FormatError(f"strings block at {b.start}: {exc}") from None
    # A segment's first snapshot brings ten thousand names: one pass with the fewest calls per string. Names
    # are mostly ASCII (so are their small lengths' bytes): then one decode of the whole, sliced as text.
    out: list[str] = []
    at = 0
    end = len(raw)
    unpack = U32.unpack_from
    text = raw.decode("ascii") if raw.isascii() else None
    try:
        while at < end:
            (n,) = unpack(raw, at)
            at += 4
            out.append(text[at : at + n] if text is not None else raw[at : at + n].decode("utf-8", "surrogateescape"))
            at += n
    except struct.error:
        raise FormatError(f"strings block at {b.start}: length cut short") from None
    if at > end:
        raise FormatError(f"strings block at {b.start}: string cut short")
    return out


# ---- tables of contents ---------------------------------------------------------------------------------


class TocEntry(NamedTuple):  # a tuple, as Block
    kind: bytes
    start: int
    end: int
    key: int = 0


def toc_block(kind: bytes, entries: Iterable[TocEntry]) -> bytes:
    rows = [TOC_ENTRY.pack(kind_bytes(e.kind), e.start, e.end, e.key) for e in entries]
    return block(kind, U64.pack(len(rows)) + b"".join(rows))


def decode_toc(b: Block) -> list[TocEntry]:
    if len(b.payload) < 8:
        raise FormatError(f"{b.kind.decode()} block at {b.start}: no entry count")
    (n,) = U64.unpack_from(b.payload, 0)
    if len(b.payload) != 8 + n * TOC_ENTRY.size:
        raise FormatError(f"{b.kind.decode()} block at {b.start}: {n} entries do not fit its size")
    return [TocEntry(kind.rstrip(b"\0"), start, end, key) for kind, start, end, key in TOC_ENTRY.iter_unpack(
        memoryview(b.payload)[8:])]


def lowbit(k: int) -> int:
    return k & -k


# ---- counters -------------------------------------------------------------------------------------------


def _fdiv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a // b (floor) where b > 0, else 0."""
    out = np.floor_divide(a, np.maximum(b, 1))
    out *= b > 0
    return out


def hints_of(state: np.ndarray, quantum: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hints a writer derives from counters: block size, extra bytes per live block, and the byte unit.
    `quantum` is a common divisor of every byte count the site has had (0 for none known). A site whose blocks
    all have one size gets that size; a site with several gets its mean block size rounded to a multiple of the
    quantum, so that its byte residuals count whole quanta (a site allocating 48, 96 and 144 bytes has a
    residual of 48 * k). The unit is the greatest common divisor of the quantum and the size (0: no unit)."""
    mean = _fdiv(state[1], state[0])
    q = np.zeros_like(mean) if quantum is None else quantum
    one_size = mean * state[0] == state[1]
    rounded = (mean + q // 2) // np.maximum(q, 1) * q
    size = np.where(one_size | (q <= 0), mean, rounded)
    unit = np.gcd(q, size)
    return size, _fdiv(state[6], state[4]), unit


def byte_residuals(prev: np.ndarray, new: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the block size does not predict of the allocated and the freed bytes (before division by the
    unit)."""
    d0 = new[0] - prev[0]
    d2 = new[2] - prev[2]
    return new[1] - prev[1] - d0 * size, new[3] - prev[3] - d2 * size


def unit_of(unit: np.ndarray | None, like: np.ndarray) -> np.ndarray:
    """The effective byte unit: a unit hint of 0 (none, or a segment before subversion 3) counts as 1."""
    if unit is None:
        return np.ones(like.shape[-1], dtype=np.int64)
    return np.maximum(unit, 1)


def encode_counters(
    prev: np.ndarray,
    new: np.ndarray,
    size: np.ndarray,
    xpb: np.ndarray,
    peak_moved: bool = False,
    unit: np.ndarray | None = None,
) -> np.ndarray:
    """Residuals of the listed sites' counters: `prev` and `new` are (9, n) arrays in COUNTER_FIELDS order
    (prev is all zeros in a checkpoint), `size`, `xpb` and `unit` the sites' hints (block size, extra bytes per
    block, byte unit: the byte residuals must be multiples of it). Each field is predicted linearly from the
    previous state and the fields before it; the residual is what the prediction missed
    (docs/store-format.md, "Counters"). When the peak moved since the previous snapshot, the peak counters are
    predicted by the live ones (a growing heap peaks near the sample that sees it)."""
    u = unit_of(unit, new)
    d = new - prev
    res = np.empty_like(new)
    res[0] = d[0]
    r1, r3 = byte_residuals(prev, new, size)
    if (r1 % u).any() or (r3 % u).any():
        raise ValueError("a byte residual is not a multiple of its site's unit")
    res[1] = r1 // u
    res[2] = d[2]
    res[3] = r3 // u
    res[4] = d[4] - (d[0] - d[2])
    res[5] = d[5] - d[1] + d[3]
    res[6] = d[6] - d[4] * xpb
    res[7] = new[7] - (new[5] if peak_moved else prev[7])
    res[8] = new[8] - (new[6] if peak_moved else prev[8])
    return res


def advance(
    prev: np.ndarray, res: np.ndarray, size: np.ndarray, xpb: np.ndarray, unit: np.ndarray | None = None
) -> np.ndarray:
    """Counters from `prev` and residuals (of one snapshot, or the sum of several whose peak did not move and
    whose hints did not change: every prediction is linear in the residuals), peak fields as not moved."""
    u = unit_of(unit, prev)
    r0, r1, r2, r3, r4, r5, r6, r7, r8 = res
    new = np.empty_like(prev)
    live = r0 - r2
    b1 = r1 * u
    b3 = r3 * u
    np.add(prev[0], r0, out=new[0])
    new[1] = prev[1] + r0 * size + b1
    np.add(prev[2], r2, out=new[2])
    new[3] = prev[3] + r2 * size + b3
    new[5] = prev[5] + live * size + b1 - b3 + r5
    live += r4
    np.add(prev[4], live, out=new[4])
    new[6] = prev[6] + live * xpb + r6
    np.add(prev[7], r7, out=new[7])
    np.add(prev[8], r8, out=new[8])
    return new


def decode_counters(
    prev: np.ndarray,
    res: np.ndarray,
    size: np.ndarray,
    xpb: np.ndarray,
    peak_moved: bool = False,
    unit: np.ndarray | None = None,
) -> np.ndarray:
    """The inverse of encode_counters."""
    new = advance(prev, res, size, xpb, unit)
    if peak_moved:
        new[7] = new[5] + res[7]
        new[8] = new[6] + res[8]
    return new
