"""agent/store/tables.py: frames filled in directly and stacks that carry their hash are the same dict keys as
frames and tuples built the plain way."""

from __future__ import annotations

import pickle

import numpy as np

from agent.model.stack import Frame
from agent.store import tables


def _columns(n: int) -> tuple[list[list[int]], list[str]]:
    strings = [f"fn_{i}" for i in range(n)] + ["a.c", "/bin/app", "/src/a.c", "\udcff-not-utf8"]
    s = len(strings) - 4
    cols = [
        [0x401000 + 16 * i for i in range(n - 1)] + [-(1 << 60)],  # the last: an address above 2^63, as stored
        [i + 1 for i in range(n)],
        [s + 1 if i % 3 else 0 for i in range(n)],
        [i % 7 for i in range(n)],  # line 0: unknown
        [s + 2] * n,
        [s + 3 if i % 2 else s + 4 for i in range(n)],
        [i % 2 for i in range(n)],
    ]
    return cols, strings


def test_frames_filled_in_directly_equal_constructed_frames() -> None:
    cols, strings = _columns(50)
    got = tables.make_frames(*cols, strings)
    strs: list[str | None] = [None, *strings]
    for f, (a, fn, fl, ln, ob, pa, inl) in zip(got, zip(*cols, strict=True), strict=True):
        want = Frame(a & 0xFFFF_FFFF_FFFF_FFFF, strs[fn], strs[fl], ln or None, strs[ob], strs[pa], inlined=bool(inl))
        assert f == want and hash(f) == hash(want) and repr(f) == repr(want) and f.label == want.label
        assert (f.path, f.inlined) == (want.path, want.inlined)
    assert got[-1].address == (1 << 64) - (1 << 60)


def test_tuple_hashes_are_the_interpreters() -> None:
    rng = np.random.default_rng(2)
    items = [Frame(0x1000 + i, f"f{i}", "x.c", i) for i in range(40)] + [None, "s", 2**80, -1]
    lens = rng.integers(0, 30, 200)
    flat = rng.integers(0, len(items), int(lens.sum()))
    hashes = np.array([hash(x) for x in items], dtype=np.int64)
    got = tables.tuple_hashes(hashes, flat, lens).tolist()
    at = 0
    for n, h in zip(lens.tolist(), got, strict=True):
        assert h == hash(tuple(items[i] for i in flat[at : at + n]))
        at += n


def test_stored_stacks_are_the_same_dict_keys_as_plain_tuples() -> None:
    cols, strings = _columns(30)
    frames = tables.make_frames(*cols, strings)
    fh = np.array([hash(f) for f in frames], dtype=np.int64)
    for lens in (np.full(20, 6), np.array([3, 0, 7, 1, 3, 12, 7, 2])):  # one depth for all, and mixed
        frm = (np.arange(int(lens.sum())) * 7) % len(frames)
        stacks = tables.make_stacks(frames, fh, lens, frm)
        plain = []
        at = 0
        for n in lens.tolist():
            plain.append(tuple(frames[i] for i in frm[at : at + n]))
            at += n
        assert stacks == plain
        d = {s: k for k, s in enumerate(stacks)}
        last = {p: k for k, p in enumerate(plain)}
        assert all(d[p] == last[p] for p in plain) and d == last  # found by the plain tuple, and the other way
        assert len(d) == len(set(plain))
        assert {p: 1 for p in plain}.keys() == {s: 1 for s in stacks}.keys()
        assert all(isinstance(s, tables.StoredStack) for s in stacks)
        # pickled (between processes str hashes differ): a plain tuple, hashed afresh
        back = pickle.loads(pickle.dumps(stacks[2]))
        assert type(back) is tuple and back == plain[2] and hash(back) == hash(plain[2])


def test_frame_hashes_are_the_frames_hashes() -> None:
    """frame_hashes (numpy, for matching sites across segments without making frames) gives what hash() gives
    for the frame make_frames makes: addresses up to 2**64 - 1 (stored as negative i64), lines of 0 (none),
    missing strings."""
    rng = np.random.default_rng(5)
    strings = [f"fn_{i}" for i in range(50)] + ["é", "", "a.c", "/lib/x86_64-linux-gnu/libc.so.6"]
    n = 500
    addr = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    addr[:4] = [0, 1, -1, 0x401000]
    cols = [rng.integers(0, len(strings) + 1, n) for _ in range(3)]
    line = rng.integers(0, 3000, n)
    line[:3] = 0
    got = tables.frame_hashes(addr, cols[0], cols[1], line, cols[2], strings)
    frames = tables.make_frames(addr.tolist(), cols[0].tolist(), cols[1].tolist(), line.tolist(),
                                cols[2].tolist(), [0] * n, [0] * n, strings)
    assert got.tolist() == [hash(f) for f in frames]
