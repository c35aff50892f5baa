"""Frames and stacks: a code location as Massif prints it, per-site counters, and Massif's stack trimming
(which frames are kept above the allocation function, and how deep).

Pure Python: no bcc, no I/O. The behaviour follows Valgrind 3.19's Massif (massif/ms_main.c).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Frame:
    """One code location, as Massif prints it.

    `address` is the runtime address shown in the tree (the return address for a caller frame).
    Inlined calls give several Frames with the same address, innermost first.
    """

    address: int
    function: str | None = None  # None: unknown, printed as ???
    file: str | None = None  # base name of the source file, as Massif shows it
    line: int | None = None
    obj: str | None = None  # path of the ELF object holding the address
    # Directory + file name as DWARF gives it, for the xtree report (Valgrind writes the full name there).
    # Not part of the frame's identity: the Massif label only shows the base name.
    path: str | None = field(default=None, compare=False)
    # An inlined call, shown above the frame of the function it was inlined into (the next one, at the same
    # address). Recursion also puts consecutive frames at one address, so the address alone cannot tell
    # one instruction pointer's inlined calls from several calls (see ip_groups). Derived from the
    # address, like the label's other parts: not part of the identity.
    inlined: bool = field(default=False, compare=False)

    def __hash__(self) -> int:
        # Computed once: stacks of a dozen frames are dict keys by the ten thousand (trees, merges, diffs, the
        # store's reader), and the generated hash builds a tuple of the fields at every call (6x slower).
        d = self.__dict__
        try:
            return d["_hash"]  # type: ignore[no-any-return]
        except KeyError:
            h = d["_hash"] = hash((self.address, self.function, self.file, self.line, self.obj))
            return h

    def __getstate__(self) -> dict[str, object]:
        # str hashes differ from process to process: a pickled frame carries no hash.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @functools.cached_property
    def label(self) -> str:
        """Massif's `0xADDR: fn (file:line)` / `0xADDR: fn (in /obj)` / `0xADDR: ???` (computed once: trees
        of 10,000 stacks ask for it hundreds of thousands of times)."""
        fn = self.function or "???"
        if self.file and self.line:
            return f"0x{self.address:X}: {fn} ({self.file}:{self.line})"
        if self.obj:
            return f"0x{self.address:X}: {fn} (in {self.obj})"
        return f"0x{self.address:X}: {fn}"


# A call stack, innermost frame (the allocation's call site) first.
Stack = tuple[Frame, ...]


@dataclass
class SiteCounts:
    """Counters of one allocation stack, as kept in the kernel (bytes are requested sizes)."""

    cur_bytes: int = 0  # live bytes now
    cur_blocks: int = 0  # live blocks now
    tot_bytes: int = 0  # bytes ever allocated
    tot_blocks: int = 0  # blocks ever allocated
    freed_bytes: int = 0  # bytes of this stack's blocks freed
    freed_blocks: int = 0
    peak_bytes: int = 0  # live bytes at the global peak (exact)
    cur_extra: int = 0  # Massif's extra bytes (slop + admin) of the live blocks
    peak_extra: int = 0  # the same at the global peak



# Valgrind's "below main" functions (m_debuginfo's get_fnname_kind, plus the name it prints for them).
BELOW_MAIN_FUNCTIONS: frozenset[str] = frozenset(
    {"__libc_start_main", "__libc_start_call_main", "generic_start_main", "_start", "(below main)"}
)


def ip_groups(frames: Sequence[Frame]) -> list[Stack]:
    """Split a stack into instruction pointers: one IP is its inlined calls (innermost first) and the real
    function, last. A group ends at a frame that is not an inlined call, or where the address changes.
    A recursive function calling itself from one line gives one IP per call, all at the same address."""
    groups: list[Stack] = []
    start = 0
    for i, frame in enumerate(frames):
        last = i + 1 == len(frames)
        if last or not frame.inlined or frames[i + 1].address != frame.address:
            groups.append(tuple(frames[start : i + 1]))
            start = i + 1
    return groups


def _main_offset(groups: Sequence[Stack]) -> int:
    """Index of the IP where Massif stops (VG_(XT_offset_main_or_below_main)).

    Scanning from the outermost IP inwards, remember each main/below-main IP and stop at the first `main`.
    Without either, the whole stack is kept. An IP's kind is that of its real (not inlined) function.
    """
    last = len(groups) - 1
    found = last
    found_kind = "normal"
    for i in range(last, -1, -1):
        fn = groups[i][-1].function
        if fn == "main":
            return i
        if fn in BELOW_MAIN_FUNCTIONS:
            found, found_kind = i, "below"
    return found if found_kind == "below" else last


def trim_stack(frames: Sequence[Frame], alloc_fns: frozenset[str], depth: int) -> Stack:
    """Massif's filter_IPs: the part of a raw stack (innermost first) that Massif shows.

    - Drop IPs from the top while they are allocation functions. An IP with inlined frames is dropped only
      when all its frames are alloc-fns (an alloc-fn inlined into a normal function stays).
    - Cut everything below `main` (main itself is kept). Without main, cut below the innermost below-main
      function (__libc_start_main...); with neither, keep everything (thread stacks end in clone).
    - Keep at most `depth` IPs (Massif's --depth counts addresses; inlined frames come along with their IP).
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    groups = ip_groups(frames)
    top = 0
    while top < len(groups) and all(f.function is not None and f.function in alloc_fns for f in groups[top]):
        top += 1
    n_sel = len(groups) - top
    if n_sel > 0:
        mbm = _main_offset(groups)
        # Massif's special case: main itself is an alloc-fn. It keeps one IP then.
        n_sel = 1 if mbm < top else mbm - top + 1
    n_sel = min(n_sel, depth)
    return tuple(f for g in groups[top : top + n_sel] for f in g)


