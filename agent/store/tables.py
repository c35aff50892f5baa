"""A segment's frame and stack tables turned into model objects quickly.

Reading a snapshot back as dict[Stack, SiteCounts] makes ten thousand Frames and stacks, and hashes every
stack as a dict key. Done plainly, the frozen dataclass's __init__ (one object.__setattr__ per field) and the
hashing (a tuple's hash calls each Frame's __hash__, a Python method: a dozen calls a stack, at every dict the
stack goes into) were two thirds of that read. Here frames are filled in directly, and stacks are tuples that
carry their hash, computed for all of them at once with numpy by the same arithmetic as CPython's tuple hash,
so that a stack read from the store and an equal plain tuple are the same dict key. Both are checked when
this module is loaded and on samples of every table built; on any mismatch the plain ways are used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from agent.model.stack import Frame, Stack

_MASK = 0xFFFF_FFFF_FFFF_FFFF


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused while tens of thousands of objects without cycles (frames,
    stacks, counters) are made: else it runs every 700 of them, each time over the young objects and now and
    then over the whole heap (a fifth of a 10,000-site read in a process holding 300,000 objects). Resumed
    after, unless it was already paused."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
_FRAME_FIELDS = ("address", "function", "file", "line", "obj", "path", "inlined")
_new = object.__new__


class StoredStack(tuple):  # type: ignore[type-arg]
    """A stack (a tuple of Frames) whose hash was computed when it was read: equal to, and hashed as, the plain
    tuple of the same frames."""

    _h: int

    def __hash__(self) -> int:
        return self._h

    def __reduce__(self) -> tuple[type, tuple[tuple[Frame, ...]]]:
        # str hashes differ between processes: a pickled stack is a plain tuple
        return (tuple, (tuple(self),))


def _plain_frame(a: int, fn: str | None, fl: str | None, ln: int | None, ob: str | None, pa: str | None,
                 inl: bool) -> Frame:
    return Frame(a, fn, fl, ln, ob, pa, inlined=inl)


def frame_hash(a: int, fn: str | None, fl: str | None, ln: int, ob: str | None) -> int:
    """hash() of the frame make_frames makes from these columns (string references resolved; a line of 0 is
    none), without making it."""
    return hash((a & _MASK, fn, fl, ln or None, ob))


def _direct_frame(a: int, fn: str | None, fl: str | None, ln: int | None, ob: str | None, pa: str | None,
                  inl: bool) -> Frame:
    # _hash: what Frame.__hash__ computes and keeps on first use (checked below), computed here in the same call
    f = _new(Frame)
    object.__setattr__(f, "__dict__", {"address": a, "function": fn, "file": fl, "line": ln, "obj": ob, "path": pa,
                                       "inlined": inl, "_hash": hash((a, fn, fl, ln, ob))})
    return f


def _direct_frames_work() -> bool:
    """Frame has exactly the fields filled in here and no __post_init__, and a frame filled in directly equals
    and hashes as one built by its constructor."""
    names = tuple(f.name for f in dataclasses.fields(Frame))
    if names != _FRAME_FIELDS or hasattr(Frame, "__post_init__"):
        return False
    args = (0x401000, "f", "f.c", 3, "/bin/x", "/src/f.c", True)
    a, b = _direct_frame(*args), _plain_frame(*args)
    return a == b and hash(a) == hash(b) and repr(a) == repr(b) and a.label == b.label and vars(a) == vars(b)


_make_frame = _direct_frame if _direct_frames_work() else _plain_frame


def make_frames(addr: list[int], func: list[int], file: list[int], line: list[int], obj: list[int],
                path: list[int], inlined: list[int], strings: Sequence[str]) -> list[Frame]:
    """Frames from the frame table's columns (string references are index + 1, 0 for none)."""
    strs: list[str | None] = [None, *strings]
    rows = zip(addr, func, file, line, obj, path, inlined, strict=True)
    if _make_frame is _plain_frame:
        return [_plain_frame(a & _MASK, strs[fn], strs[fl], ln or None, strs[ob], strs[pa], bool(i))
                for a, fn, fl, ln, ob, pa, i in rows]
    # _direct_frame, inlined: the loop is most of reading a segment's tables
    out: list[Frame] = []
    append = out.append
    new = _new
    setattr_ = object.__setattr__
    for a, fn, fl, ln, ob, pa, i in rows:
        a &= _MASK
        fn, fl, ob = strs[fn], strs[fl], strs[ob]
        ln = ln or None
        f = new(Frame)
        setattr_(f, "__dict__", {"address": a, "function": fn, "file": fl, "line": ln, "obj": ob,
                                 "path": strs[pa], "inlined": bool(i), "_hash": hash((a, fn, fl, ln, ob))})
        append(f)
    return out


# CPython's tuple hash (Objects/tupleobject.c, xxHash's round): the same arithmetic on uint64 arrays.
_P1 = np.uint64(11400714785074694791)
_P2 = np.uint64(14029467366897019727)
_P5 = np.uint64(2870177450012600261)
_LEN_XOR = np.uint64(2870177450012600261 ^ 3527539)


def tuple_hashes(item_hashes: np.ndarray, flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """hash(tuple(items)) of each tuple, without calling the items' __hash__: `item_hashes` are the items'
    hashes (int64), `flat` the items of every tuple concatenated (indices into item_hashes), `lens` the tuples'
    lengths. Only meaningful where the interpreter's tuple hash is that arithmetic (checked by the caller)."""
    n = len(lens)
    lanes = item_hashes.astype(np.int64).view(np.uint64)
    starts = np.cumsum(lens) - lens
    acc = np.full(n, _P5, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(int(lens.max()) if n else 0):
            live = np.flatnonzero(lens > j)
            a = acc[live] + lanes[flat[starts[live] + j]] * _P2
            a = (a << np.uint64(31)) | (a >> np.uint64(33))
            acc[live] = a * _P1
        acc += lens.astype(np.uint64) ^ _LEN_XOR
    acc[acc == np.uint64(_MASK)] = np.uint64(1546275796)
    return acc.view(np.int64)


def _tuple_hash_matches() -> bool:
    if sys.implementation.name != "cpython":
        return False
    items = [("a", 1), 2**70, -1, "x", None, 3.5]
    hashes = np.array([hash(x) for x in items], dtype=np.int64)
    cases = [(0, 1, 2), (3,), (), (4, 5, 0, 1, 2, 3), (1, 1)]
    flat = np.array([i for c in cases for i in c], dtype=np.int64)
    lens = np.array([len(c) for c in cases], dtype=np.int64)
    got = tuple_hashes(hashes, flat, lens).tolist()
    return got == [hash(tuple(items[i] for i in c)) for c in cases]


FAST_HASH = _tuple_hash_matches()  # stack hashes can be computed with numpy (tuple_hashes)
_MODULUS = (1 << 61) - 1  # an int's hash is itself modulo this (sys.hash_info.modulus, on 64-bit CPython)
_INT_HASH = FAST_HASH and sys.hash_info.modulus == _MODULUS and sys.hash_info.width == 64


def frame_hashes(addr: np.ndarray, func: np.ndarray, file: np.ndarray, line: np.ndarray, obj: np.ndarray,
                 strings: Sequence[str]) -> np.ndarray:
    """frame_hash of every row of a frame table's columns (string references are index + 1, 0 for none), with
    numpy: the tuple hash of (address, function, file, line, obj) from its items' hashes, a non-negative int's
    being itself modulo 2**61 - 1. Checked against frame_hash on a few rows; frame_hash row by row where the
    arithmetic is not the interpreter's."""
    n = len(addr)
    strs: list[str | None] = [None, *strings]
    if not _INT_HASH or not n:
        return frame_hashes_plain(addr, func, file, line, obj, strs)
    text = np.array([hash(x) for x in strs], dtype=np.int64)
    none = hash(None)
    mod = np.uint64(_MODULUS)
    items = np.empty((n, 5), dtype=np.int64)
    items[:, 0] = (addr.astype(np.int64).view(np.uint64) % mod).view(np.int64)  # the address as u64
    items[:, 1] = text[func]
    items[:, 2] = text[file]
    items[:, 3] = np.where(line == 0, none, line.astype(np.int64) % _MODULUS)
    items[:, 4] = text[obj]
    out = tuple_hashes(items.ravel(), np.arange(5 * n), np.full(n, 5, dtype=np.int64))
    for k in {0, n // 2, n - 1}:
        row = int(addr[k]), strs[func[k]], strs[file[k]], int(line[k]), strs[obj[k]]
        if frame_hash(*row) != int(out[k]):
            return frame_hashes_plain(addr, func, file, line, obj, strs)
    return out


def frame_hashes_plain(addr: np.ndarray, func: np.ndarray, file: np.ndarray, line: np.ndarray, obj: np.ndarray,
                       strs: Sequence[str | None]) -> np.ndarray:
    return np.array([frame_hash(a, strs[fn], strs[fl], ln, strs[ob])
                     for a, fn, fl, ln, ob in zip(addr.tolist(), func.tolist(), file.tolist(), line.tolist(),
                                                  obj.tolist(), strict=True)], dtype=np.int64)


def make_stacks(
    frames: Sequence[Frame], frame_hashes: np.ndarray, lens_a: np.ndarray, frm_a: np.ndarray
) -> list[Stack]:
    """Stacks of `lens_a[i]` frames each, their frame numbers (valid indices of `frames`) concatenated in
    `frm_a`, innermost first, as StoredStacks that carry their hash (plain tuples where the hash cannot be
    computed so)."""
    n = len(lens_a)
    if not n:
        return []
    objs = np.fromiter(frames, dtype=object, count=len(frames))
    starts = np.cumsum(lens_a) - lens_a
    lengths = np.unique(lens_a).tolist()
    rows: list[list[Frame]]
    if len(lengths) == 1 and lengths[0]:  # one depth for all (as --depth often makes it): one gather
        rows = objs[frm_a].reshape(n, lengths[0]).tolist()
    else:
        rows = [[]] * n
        # stacks of one length at a time: one gather for all of them
        for length in lengths:
            which = np.flatnonzero(lens_a == length)
            if length:
                got = objs[frm_a[starts[which][:, None] + np.arange(length)]].tolist()
                for i, row in zip(which.tolist(), got, strict=True):
                    rows[i] = row
    if not FAST_HASH:
        return [tuple(r) for r in rows]
    hashes = tuple_hashes(frame_hashes, frm_a, lens_a).tolist()
    out: list[Stack] = list(map(StoredStack, rows))
    for s, h in zip(out, hashes, strict=True):
        s._h = h  # type: ignore[attr-defined]
    # a sample checked against the interpreter's own hash: a wrong hash would lose dict lookups silently
    for k in {0, n // 2, n - 1}:
        if hash(tuple(out[k])) != hashes[k]:
            return [tuple(r) for r in rows]
    return out
