"""A reader of heapscope's store segments written from docs/store-format.md alone (it imports nothing of
agent.store), so that the tests check the spec page against the files the writer makes.

    read_segment(path) -> SpecSegment: filemeta, snapshots (info, {stack: counters}), skipped (reasons)

A stack is a tuple of frames, each (address, function, file, line, obj, path) with None for "unknown";
counters are the nine values in the spec's order.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field

import zstandard

IDENT = b"HeapscopeStore01"
COUNTERS = ("c_totbk", "c_totb", "c_frdbk", "c_frdb", "c_curbk", "c_curb", "c_curx", "c_pkb", "c_pkx")
FRAME_COLS = ("frm_addr", "frm_func", "frm_file", "frm_line", "frm_obj", "frm_path")
MASK = (1 << 64) - 1


def _wrap(v: int) -> int:
    """64-bit two's complement wrap-around, as the spec's arithmetic."""
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


class Damaged(Exception):
    pass


@dataclass
class SpecSegment:
    filemeta: dict
    snapshots: list[tuple[dict, dict[tuple, list[int]]]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _block(data: bytes, at: int) -> tuple[str, int, bytes, int]:
    """(kind, entry size, payload, end) of the block at `at`; Damaged when it cannot be trusted."""
    if at + 18 > len(data):
        raise Damaged(f"header at {at} cut short")
    kind_raw, entry, size = struct.unpack_from("<8sHQ", data, at)
    end = at + 18 + size + 4
    if end > len(data):
        raise Damaged(f"block at {at} cut short")
    (crc,) = struct.unpack_from("<I", data, end - 4)
    if zlib.crc32(data[at : end - 4]) != crc:
        raise Damaged(f"block at {at}: CRC mismatch")
    return kind_raw.rstrip(b"\0").decode("ascii"), entry, data[at + 18 : end - 4], end


def _toc(payload: bytes) -> list[tuple[str, int, int, int]]:
    (n,) = struct.unpack_from("<Q", payload, 0)
    out = []
    for i in range(n):
        kind, start, end, key = struct.unpack_from("<8sQQq", payload, 8 + 32 * i)
        out.append((kind.rstrip(b"\0").decode("ascii"), start, end, key))
    return out


def _column(entry: int, payload: bytes) -> list[int]:
    raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=1 << 30)
    code = {1: "b", 2: "h", 4: "i", 8: "q"}[entry]
    return list(struct.unpack(f"<{len(raw) // entry}{code}", raw))


def _strings(payload: bytes) -> list[str]:
    raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=1 << 30)
    out, at = [], 0
    while at < len(raw):
        (n,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4 : at + 4 + n].decode("utf-8", "surrogateescape"))
        at += 4 + n
    return out


def _index_fast(data: bytes) -> list[int] | None:
    """snaptoc offsets from the outer TOC chain, or None when the end is not a whole outer TOC."""
    if len(data) < 8:
        return None
    (at,) = struct.unpack_from("<Q", data, len(data) - 8)
    want_end = len(data) - 8
    found: list[int] = []
    try:
        while True:
            kind, _, payload, end = _block(data, at)
            if kind != "outertoc" or end != want_end:
                return None
            entries = _toc(payload)
            found[:0] = [start for k, start, _, _ in entries if k == "snaptoc"]
            prev = [(start, e) for k, start, e, _ in entries if k == "prevtoc"]
            if not prev:
                return found
            at, want_end = prev[0]
    except (Damaged, struct.error):
        return None


def _index_scan(data: bytes, at: int, skipped: list[str]) -> list[int]:
    found = []
    while at < len(data):
        try:
            kind, _, _, end = _block(data, at)
        except Damaged as exc:
            nxt = data.find(b"snapinfo", at + 1)
            skipped.append(f"{(nxt if nxt >= 0 else len(data)) - at} bytes at {at}: {exc}")
            if nxt < 0:
                break
            at = nxt
            continue
        if kind == "snaptoc":
            found.append(at)
        at = end + (8 if kind == "outertoc" else 0)
    return found


def read_segment(path: str) -> SpecSegment:
    with open(path, "rb") as f:
        data = f.read()
    if data[:16] != IDENT:
        raise ValueError("not a heapscope store segment")
    kind, _, payload, body = _block(data, 16)
    assert kind == "filemeta"
    seg = SpecSegment(json.loads(payload))
    every = seg.filemeta["checkpoint_every"]
    tocs = _index_fast(data)
    if tocs is None:
        tocs = _index_scan(data, body, seg.skipped)
    strings: list[str] = []
    frames: list[tuple] = []
    stacks: list[tuple] = []
    state: list[list[int]] = []  # per site, the nine counters of the previous snapshot
    hints: list[list[int]] = []  # per site, [size, xpb, unit]
    prev_seq: int | None = None
    tables_ok = True
    for toc_at in tocs:
        try:
            _, _, toc_payload, _ = _block(data, toc_at)
            blocks = {}
            for _kind, start, _, _ in _toc(toc_payload):
                k, entry, payload, _ = _block(data, start)
                blocks[k] = (entry, payload)
            info = json.loads(blocks["snapinfo"][1])
        except (Damaged, KeyError, ValueError) as exc:
            seg.skipped.append(f"snapshot at {toc_at}: {exc}")
            prev_seq = None
            continue
        seq = info["seq"]
        if not tables_ok:
            seg.skipped.append(f"snapshot {seq}: tables broken earlier")
            continue
        if "strings" in blocks:
            strings += _strings(blocks["strings"][1])
        if "frm_addr" in blocks:
            cols = [_column(*blocks[k]) for k in FRAME_COLS]
            # frm_inl from subversion 2 on; without it no frame is an inlined call.
            cols.append(_column(*blocks["frm_inl"]) if "frm_inl" in blocks else [0] * len(cols[0]))
            for addr, fn, fl, line, obj, pth, inl in zip(*cols, strict=True):
                s = [strings[i - 1] if i else None for i in (fn, fl, obj, pth)]
                frames.append((addr & MASK, s[0], s[1], line or None, s[2], s[3], bool(inl)))
        if "stk_len" in blocks:
            lens = _column(*blocks["stk_len"])
            frm = _column(*blocks["stk_frm"])
            at = 0
            for n in lens:
                stacks.append(tuple(frames[i] for i in frm[at : at + n]))
                at += n
        if (len(stacks), len(frames), len(strings)) != (info["sites"], info["frames"], info["strings"]):
            tables_ok = False
            seg.skipped.append(f"snapshot {seq}: tables do not add up")
            continue
        checkpoint = seq % every == 0
        if not checkpoint and prev_seq != seq - 1:
            seg.skipped.append(f"snapshot {seq}: its previous snapshot is missing")
            prev_seq = None
            continue
        listed = info["listed"]
        gaps = _column(*blocks["site_gap"]) if "site_gap" in blocks else [0] * listed
        res = [_column(*blocks[k]) if k in blocks else [0] * listed for k in COUNTERS]
        if checkpoint:
            state = [[0] * 9 for _ in range(info["sites"])]
            hints = [[0, 0, 0] for _ in range(info["sites"])]
        else:
            state += [[0] * 9 for _ in range(info["sites"] - len(state))]
            hints += [[0, 0, 0] for _ in range(info["sites"] - len(hints))]
        hinted = info.get("hinted", 0)
        if hinted:
            hgaps = _column(*blocks["h_gap"]) if "h_gap" in blocks else [0] * hinted
            hsize = _column(*blocks["h_size"]) if "h_size" in blocks else [0] * hinted
            hxpb = _column(*blocks["h_xpb"]) if "h_xpb" in blocks else [0] * hinted
            # h_unit from subversion 3 on; without it every unit is 0, which counts as 1.
            hunit = _column(*blocks["h_unit"]) if "h_unit" in blocks else [0] * hinted
            site = -1
            for gap, size, xpb, unit in zip(hgaps, hsize, hxpb, hunit, strict=True):
                site += gap + 1
                hints[site] = [size, xpb, unit]
        site = -1
        for row, gap in enumerate(gaps):
            site += gap + 1
            P = [0] * 9 if checkpoint else state[site]
            R = [r[row] for r in res]
            size, xpb, unit = hints[site]
            u = unit or 1
            N = [0] * 9
            N[0] = _wrap(P[0] + R[0])
            N[1] = _wrap(P[1] + R[0] * size + R[1] * u)
            N[2] = _wrap(P[2] + R[2])
            N[3] = _wrap(P[3] + R[2] * size + R[3] * u)
            N[4] = _wrap(P[4] + R[0] - R[2] + R[4])
            N[5] = _wrap(P[5] + (R[0] - R[2]) * size + (R[1] - R[3]) * u + R[5])
            N[6] = _wrap(P[6] + (R[0] - R[2] + R[4]) * xpb + R[6])
            if info.get("peak_moved") or checkpoint:
                N[7] = _wrap(N[5] + R[7])
                N[8] = _wrap(N[6] + R[8])
            else:
                N[7] = _wrap(P[7] + R[7])
                N[8] = _wrap(P[8] + R[8])
            state[site] = N
        by_stack: dict[tuple, list[int]] = {}
        for stack, counters in zip(stacks, state, strict=True):
            have = by_stack.setdefault(stack, [0] * 9)
            for i in range(9):
                have[i] += counters[i]
        seg.snapshots.append((info, by_stack))
        prev_seq = seq
    return seg
