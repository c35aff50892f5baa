"""The exact call counts the in-process sampler keeps per thread (probes/sampler/hs_sampler.h, struct hs_counts),
and the calls per allocation function they give.

Pure Python (no I/O). The sampler counts every call it sees, sampled or not; the functions are the kinds of
probes/heap.h `enum hs_fn`, as exact mode records the same calls (operator new and mallocx are malloc, delete
is free, aligned_alloc is memalign, reallocarray and rallocx are realloc); the sampler also counts the aligned
operator new, as memalign, which exact mode does not probe (agent.model.functions.SAMPLED_ONLY). Its
malloc and free hooks keep no count of their own, so that their fast path stays two adds: malloc's calls are
the allocations less every other function's, free's the frees less the old blocks of reallocs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

# Functions counted apart from malloc (the other allocations), in struct hs_counts' order.
COUNTED_KINDS: tuple[str, ...] = ("calloc", "realloc", "memalign", "posix_memalign", "valloc", "pvalloc")


@dataclass(frozen=True)
class ThreadCalls:
    """One slot of the sampler's counts: one thread's calls since arming (tid 0: the slot threads beyond the
    sampler's 16,383rd share)."""

    tid: int
    allocs: int = 0  # allocation calls that returned a block, reallocs included
    frees: int = 0  # frees of a non-null pointer, deletes, and the old blocks of reallocs
    alloc_bytes: int = 0  # bytes the allocations asked for
    calloc: int = 0
    realloc: int = 0
    memalign: int = 0
    posix_memalign: int = 0
    valloc: int = 0
    pvalloc: int = 0
    realloc_frees: int = 0

    def by_kind(self) -> dict[str, int]:
        """Calls per allocation function (enum hs_fn kind), free included; functions not called are left out.
        A negative figure (a count read while its thread was between two adds) is 0."""
        others = {k: getattr(self, k) for k in COUNTED_KINDS}
        out = {"malloc": max(self.allocs - sum(others.values()), 0), **others,
               "free": max(self.frees - self.realloc_frees, 0)}  # fmt: skip
        return {k: v for k, v in out.items() if v}

    def __add__(self, other: ThreadCalls) -> ThreadCalls:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "tid"}
        return ThreadCalls(self.tid, **sums)


def merge_by_thread(slots: Iterable[ThreadCalls]) -> dict[int, ThreadCalls]:
    """The slots summed per tid (a tid the kernel gave again to a later thread has two slots)."""
    out: dict[int, ThreadCalls] = {}
    for s in slots:
        out[s.tid] = out[s.tid] + s if s.tid in out else s
    return out


_SUMMED = tuple(f.name for f in fields(ThreadCalls) if f.name != "tid")


def total(slots: Iterable[ThreadCalls]) -> ThreadCalls:
    """Every slot's counts summed (tid 0). Column by column: a sampler has up to 16,384 slots, read at every look."""
    rows = [[getattr(s, name) for name in _SUMMED] for s in slots]
    return ThreadCalls(0, *(sum(column) for column in zip(*rows, strict=True))) if rows else ThreadCalls(0)
