"""Xtree memory report in callgrind format, as Valgrind writes it (coregrind/m_xtree.c,
VG_(XT_callgrind_print); events from m_xtmemory.c). Read by callgrind_annotate (with --inclusive=yes) and
KCachegrind. Pure: writes to the given text stream only.

Each stack is written from its outermost frame to its innermost, every frame repeating the stack's cost, and
each call arc with `calls=0` (a real count would make KCachegrind show the number of stacks through the arc).
File and function names are compressed: `fl=(n) name` the first time, `fl=(n)` afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

from agent.model.stack import SiteCounts, Stack, ip_groups

UNKNOWN_FILE = "UnknownFile???"
UNKNOWN_FN = "UnknownFn???"

# Valgrind's event descriptions, written verbatim in the `event:` lines.
ALLOCS_EVENTS: tuple[tuple[str, str], ...] = (
    ("curB", "currently allocated Bytes"),
    ("curBk", "currently allocated Blocks"),
)
FULL_EVENTS: tuple[tuple[str, str], ...] = (
    *ALLOCS_EVENTS,
    ("totB", "total allocated Bytes"),
    ("totBk", "total allocated Blocks"),
    ("totFdB", "total Freed Bytes"),
    ("totFdBk", "total Freed Blocks"),
)

XtreeKind = Literal["allocs", "full"]


@dataclass(frozen=True)
class _Loc:
    file: str
    function: str
    line: int


def _loc(ip: Stack) -> _Loc:
    """One instruction pointer as Valgrind's xtree names it: the real (outermost, not inlined) function, and
    the file and line of the innermost inlined frame at that address."""
    inner, outer = ip[0], ip[-1]
    if inner.line and (inner.path or inner.file):
        file, line = (inner.path or inner.file or UNKNOWN_FILE), inner.line
    else:
        file, line = UNKNOWN_FILE, 0
    return _Loc(file, outer.function or UNKNOWN_FN, line)


def _values(counts: SiteCounts, kind: XtreeKind) -> tuple[int, ...]:
    if kind == "allocs":
        return (counts.cur_bytes, counts.cur_blocks)
    return (
        counts.cur_bytes,
        counts.cur_blocks,
        counts.tot_bytes,
        counts.tot_blocks,
        counts.freed_bytes,
        counts.freed_blocks,
    )


class _Names:
    """Valgrind's name compression: one numbering for files, another for functions, from 1."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def ref(self, name: str) -> tuple[int, bool]:
        n = self._ids.get(name)
        if n is None:
            n = self._ids[name] = len(self._ids) + 1
            return n, True
        return n, False


def _one_line(text: str) -> str:
    return " ".join(text.splitlines()) if ("\n" in text or "\r" in text) else text


def write_xtree(
    out: TextIO,
    sites: Mapping[Stack, SiteCounts],
    *,
    cmd: str,
    pid: int,
    kind: XtreeKind,
    creator: str = "xtree-1",
    desc: Sequence[str] = (),
) -> None:
    """Write the report for `sites` (stack -> counters, stacks innermost first, in the order wanted in the
    file; Valgrind writes them in the order it first saw them).

    kind="allocs" (Valgrind's --xtree-memory=allocs): curB curBk, the live bytes and blocks.
    kind="full": curB curBk totB totBk totFdB totFdBk. Note that Valgrind puts freed bytes on the stack of
    the `free` call; here they go on whatever stacks the caller gives them for.
    Sites whose values are all zero, and empty stacks, are left out, as Valgrind does.
    `desc`: the format's `desc:` header lines ("Key: value"; callgrind_annotate prints them).
    """
    if kind not in ("allocs", "full"):
        raise ValueError(f"kind must be 'allocs' or 'full', got {kind!r}")
    events = ALLOCS_EVENTS if kind == "allocs" else FULL_EVENTS
    out.write("# callgrind format\n")
    out.write("version: 1\n")
    out.write(f"creator: {_one_line(creator)}\n")
    out.write(f"pid: {int(pid)}\n")
    out.write(f"cmd: {_one_line(cmd)}\n")
    for line in desc:
        out.write(f"desc: {_one_line(line)}\n")
    out.write("\npositions: line\n")
    for name, text in events:
        out.write(f"event: {name} : {text}\n")
    # Valgrind cuts each description at its ':' and keeps the space before it: hence the double spaces.
    out.write("events:" + "".join(f" {name} " for name, _ in events) + "\n")

    files, fns = _Names(), _Names()
    totals = [0] * len(events)

    def pos(tag: str, names: _Names, name: str) -> None:
        n, new = names.ref(name)
        out.write(f"{tag}=({n}) {_one_line(name)}\n" if new else f"{tag}=({n})\n")

    for stack, counts in sites.items():
        values = tuple(max(v, 0) for v in _values(counts, kind))
        if not stack or not any(values):
            continue
        totals = [t + v for t, v in zip(totals, values, strict=True)]
        img = " ".join(str(v) for v in values)
        locs: Sequence[_Loc] = [_loc(ip) for ip in ip_groups(stack)]
        # From the outermost caller down to the allocation site; only the site has a "self" cost line.
        for i in range(len(locs) - 1, -1, -1):
            here = locs[i]
            pos("fl", files, here.file)
            pos("fn", fns, here.function)
            if i == 0:
                out.write(f"{here.line} {img}\n")
                break
            out.write(f"{here.line}\n")
            callee = locs[i - 1]
            pos("cfi", files, callee.file)
            pos("cfn", fns, callee.function)
            out.write(f"calls=0 {callee.line}\n")
            out.write(f"{here.line} {img}\n")
        out.write("\n")
    out.write("totals: " + " ".join(str(t) for t in totals) + "\n")
