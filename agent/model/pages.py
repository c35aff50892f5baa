"""Page-level memory: Massif's `--pages-as-heap=yes` accounting, fed by one event per mmap/munmap/mremap/brk.

Pure Python: no bcc, no I/O. The BPF layer builds `PageEvent`s (one per syscall, in order, with the calling
user stack already interned as a site id) and `PageMap.apply` keeps, page by page, which site mapped each
live page.

The rules are Valgrind 3.19's (massif/ms_main.c with --pages-as-heap=yes, and the core's
coregrind/m_syswrap/syswrap-generic.c that calls it), where they agree with the kernel:
- `ms_record_page_mem` records every page of a new range as a 4096-byte block charged to the stack of the
  running thread (`ms_new_mem_mmap`, `ms_new_mem_brk`); `ms_unrecord_page_mem` drops them
  (`ms_die_mem_munmap`, `ms_die_mem_brk`). Lengths are whole pages, as the kernel rounds them.
- mremap (`do_mremap`): shrinking unmaps the tail (`die_mem_munmap`); growing in place records only the new
  tail (`new_mem_mmap`), so the old pages keep their site; moving calls `ms_copy_mem_remap`, which is
  `ms_unrecord_page_mem(from)` then `ms_record_page_mem(to)`: the moved pages are charged to the stack that
  called mremap, not to the one that first mapped them, and so is any growth.
- brk (`ms_new_mem_brk`/`ms_die_mem_brk`): the pages between the old and the new page-rounded break.

Where Massif departs from the kernel, a map made with `massif=True` (--pages-as-heap=yes: the profile is Massif's)
follows Massif; the others (the mapped total beside the heap) follow the kernel, so their total agrees with
/proc/PID/maps:
- mmap(MAP_FIXED) over live pages: the core only calls `new_mem_mmap`, and Massif's block table
  (`VG_(HT_add_node)`, "no duplicate key detection") then holds each overlapped page twice; an unmapping drops
  the latest record of a page (`VG_(HT_remove)` finds the newest), so the older one is found next time. Massif's
  map keeps the pages mapped over in layers below the live ones; the kernel's unmaps them first.
- brk: 3.19's `ms_new_mem_brk` and `ms_die_mem_brk` record and unrecord from the page holding the lower break as
  many pages as the page-rounded break moved, which counts a page twice (or takes back one still mapped) when
  that break was not page aligned. The kernel's break region is exactly [base, PAGE_ALIGN(brk)).
- mremap that moves: `ms_copy_mem_remap` of the old size, then the growth as a new mapping (two ranges, two
  chances of a snapshot); the kernel's total is the same.

Mappings that exist when we attach are charged to `PRE_EXISTING_SITE`, never to a real stack.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from agent.model.maps import VSYSCALL, MapsEntry
from agent.model.stack import SiteCounts

if TYPE_CHECKING:
    from agent.model.pageschedule import PageSchedule

PAGE_SIZE = 4096
PRE_EXISTING_SITE = -1
PRE_EXISTING_LABEL = "(mapped before heapscope attached)"
PRE_EXISTING_EXEC_LABEL = "(mapped by the kernel at exec)"  # `run`: the image, the loader, the stack, vdso
UNKNOWN_SITE = 0  # the BPF layer's site id for an unknown stack or a full stack table

# Linux x86-64 flag values (uapi/asm-generic/mman*.h and uapi/linux/mman.h).
MAP_FIXED = 0x10
MAP_FIXED_NOREPLACE = 0x100000
MREMAP_MAYMOVE = 1
MREMAP_FIXED = 2
MREMAP_DONTUNMAP = 4

KINDS = frozenset({"mmap", "munmap", "mremap", "brk"})
# The vDSO's mappings: the kernel's, in every process but one under Valgrind, which gives its programs none.
KERNEL_PAGES = frozenset({"[vdso]", "[vvar]", "[vvar_vclock]"})

_ADDR_LIMIT = 1 << 64


def page_up(n: int) -> int:
    """`n` rounded up to a whole number of pages (the kernel's PAGE_ALIGN)."""
    return (n + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)


class PageEvent(NamedTuple):
    """One mmap/munmap/mremap/brk system call, as seen at its exit. (A tuple: the BPF layer builds one per
    call, a hundred thousand a second on an mmap-heavy target.)"""

    kind: str  # "mmap" | "munmap" | "mremap" | "brk"
    time_ns: int  # CLOCK_MONOTONIC at the syscall's exit
    tid: int
    site: int  # site id of the calling user stack (0 = unknown / overflow)
    addr: int  # mmap: the result address; munmap: addr arg; mremap: old_address; brk: requested brk arg
    length: int  # mmap/munmap: length arg; mremap: old_size
    new_addr: int = 0  # mremap: the result address; brk: the result (new program break)
    new_length: int = 0  # mremap: new_size
    flags: int = 0  # mmap/mremap flags (MAP_FIXED, MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP...)
    prot: int = 0
    failed: bool = False  # the syscall returned an error (then nothing changed)


def _stat_field(stat_text: str, number: int) -> int | None:
    """Field `number` (1-based, as in proc(5)) of /proc/PID/stat, or None when absent or 0."""
    close = stat_text.rfind(")")  # comm may hold spaces and parentheses
    if close < 0:
        return None
    fields = stat_text[close + 1 :].split()  # fields[0] is field 3 (state)
    try:
        value = int(fields[number - 3])
    except (IndexError, ValueError):
        return None
    return value or None


def parse_start_brk(stat_text: str) -> int | None:
    """Field 47 of /proc/PID/stat (start_brk, since Linux 3.3): the base of the break region, or None."""
    return _stat_field(stat_text, 47)


def parse_start_stack(stat_text: str) -> int | None:
    """Field 28 of /proc/PID/stat (startstack): where exec left the main thread's stack pointer (argc's
    address), or None."""
    return _stat_field(stat_text, 28)


# ----------------------------------------------------------------------------------------------------------
# The page map


@dataclass
class PageStats:
    """What the event stream held besides plain changes. Nothing here stops the accounting."""

    events: int = 0
    applied: int = 0
    failed: int = 0  # syscalls that returned an error: nothing changed
    unknown_kind: int = 0
    invalid: int = 0  # arguments the kernel would have refused (unaligned, zero length, past 2^64)
    out_of_order: int = 0  # time_ns earlier than the previous event's (applied anyway)
    # Bytes munmap/mremap/brk removed that were not in the map: unmapping holes is legal, but a large
    # figure means events were lost or the map was seeded late.
    unknown_unmapped_bytes: int = 0
    # Bytes a new mapping replaced without MAP_FIXED/MREMAP_FIXED: only possible after lost events.
    replaced_without_fixed_bytes: int = 0
    brk_refused: int = 0  # brk(addr) that left the break elsewhere (the kernel's way of failing)
    brk_unknown_base: int = 0  # a brk change seen before the break was known: not charged
    brk_resync: int = 0  # brk(0) showed another break than the one tracked: taken as is, not charged
    # Massif's counting: bytes of pages still counted under others mapped over them (MAP_FIXED), now.
    mapped_over_bytes: int = 0


@dataclass
class _Peak:
    total: int = 0
    time_ns: int | None = None  # None: the state the map was seeded with
    # Sites changed since the peak, with their bytes at the peak; the others still hold their peak value.
    saved: dict[int, int] = field(default_factory=dict)


class PageMap:
    """Live pages by the site that mapped them, with an exact peak.

    Pages are kept as sorted disjoint [start, end) intervals, each with one site; neighbours of one site are
    merged. A syscall touches O(log n) intervals plus the ones it covers.

    The peak is the state after the event that first reached the highest total. It costs nothing at the
    moment of a new peak: each site's bytes at the peak are saved lazily, the first time the site changes
    afterwards (the scheme the design notes give for the kernel side).
    """

    def __init__(self, *, massif: bool = False) -> None:
        # massif: Massif's own counting (--pages-as-heap=yes): a page mapped over is kept, and the break moves by
        # Massif's arithmetic; otherwise the kernel's (the mapped total beside the heap).
        self.massif = massif
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._sites: list[int] = []
        self._below: list[tuple[list[int], list[int], list[int]]] = []  # massif: earlier records of pages, by depth
        self._live: dict[int, int] = {}
        self._mapped_ever: dict[int, int] = {}  # bytes each site ever mapped (xtree's totB)
        self._unmapped: dict[int, int] = {}  # bytes of each site's pages unmapped since (totFdB)
        self._total = 0
        self._peak = _Peak()
        self._last_time: int | None = None
        self.brk_base: int | None = None  # start of the break region, when known
        self.brk_top: int | None = None  # PAGE_ALIGN(current break), when known
        self.brk: int | None = None  # the break itself, when known (massif: its arithmetic needs it)
        self.stats = PageStats()

    # -- seeding ---------------------------------------------------------------------------------------

    @classmethod
    def from_maps(
        cls, mappings: Iterable[MapsEntry], *, start_brk: int | None = None, massif: bool = False
    ) -> PageMap:
        """A map holding the mappings that existed at attach time, all charged to PRE_EXISTING_SITE.

        `start_brk` (see `parse_start_brk`) gives the break region's base when the process has no [heap]
        line yet; with a [heap] line, its end is the page-rounded break. [vsyscall] is left out (see
        `mapped_total`), so `total` starts equal to `mapped_total` of the same text. `massif` (Massif's
        counting) also leaves out the vDSO's pages: a program under Valgrind has none.
        """
        pm = cls(massif=massif)
        heap: MapsEntry | None = None
        for m in mappings:
            if m.path == VSYSCALL or (massif and m.path in KERNEL_PAGES):
                continue
            pm._place(m.start, m.end, PRE_EXISTING_SITE, replace_ok=False)
            if m.path == "[heap]":
                heap = m
        if heap is not None:
            pm.brk_base = start_brk if start_brk is not None else heap.start
            pm.brk_top = pm.brk = heap.end  # the break itself is not in the maps: its page end is
        elif start_brk is not None:
            pm.brk_base = pm.brk = start_brk
            pm.brk_top = page_up(start_brk)
        pm._peak = _Peak(total=pm._total)
        return pm

    # -- queries ---------------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Bytes mapped now (pre-existing mappings included)."""
        return self._total

    @property
    def peak_total(self) -> int:
        return self._peak.total

    @property
    def peak_time_ns(self) -> int | None:
        """time_ns of the event that reached the peak; None if the seeded state is still the peak."""
        return self._peak.time_ns

    def live_by_site(self) -> dict[int, int]:
        """Bytes mapped now, by site (sites with no bytes left out)."""
        return dict(self._live)

    def peak_by_site(self) -> dict[int, int]:
        """Bytes by site in the state of the peak (sites with no bytes left out)."""
        out = {s: b for s, b in self._live.items() if s not in self._peak.saved}
        out.update((s, b) for s, b in self._peak.saved.items() if b)
        return out

    def mapped_ever_by_site(self) -> dict[int, int]:
        """Bytes each site has mapped since the start (seeded mappings included), for xtree's totB."""
        return dict(self._mapped_ever)

    def unmapped_by_site(self) -> dict[int, int]:
        """Bytes of each site's pages unmapped since, whoever unmapped them (xtree's totFdB)."""
        return dict(self._unmapped)

    def intervals(self) -> list[tuple[int, int, int]]:
        """(start, end, site) of every live interval, in address order."""
        return list(zip(self._starts, self._ends, self._sites, strict=True))

    def site_at(self, address: int) -> int | None:
        """The site that mapped the page holding `address`, or None if it is not mapped."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._ends[i]:
            return self._sites[i]
        return None

    # -- events ----------------------------------------------------------------------------------------

    def apply_all(self, events: Iterable[PageEvent]) -> None:
        for ev in events:
            self.apply(ev)

    def apply(self, ev: PageEvent) -> None:
        """Account one syscall. Never raises on odd input: it is counted in `stats` instead."""
        ops = self.plan(ev)
        if ops is not None:
            for op in ops:
                self.do(op)
        self.close(ev.time_ns, ops is not None)

    def plan(self, ev: PageEvent) -> list[PageOp] | None:
        """The ranges the syscall maps and unmaps, in order, as Valgrind's core reports them to Massif; None when it
        changes nothing (counted in `stats`). The break's position moves on here; apply the ops with `do`, then
        `close` the event."""
        st = self.stats
        st.events += 1
        if self._last_time is not None and ev.time_ns < self._last_time:
            st.out_of_order += 1
        self._last_time = ev.time_ns if self._last_time is None else max(self._last_time, ev.time_ns)
        if ev.kind not in KINDS:
            st.unknown_kind += 1
            return None
        if ev.failed:
            st.failed += 1
            return None
        ops: list[PageOp] = []
        if ev.kind == "mmap":
            ok = self._mmap(ev, ops)
        elif ev.kind == "munmap":
            ok = self._munmap(ev, ops)
        elif ev.kind == "mremap":
            ok = self._mremap(ev, ops)
        else:
            ok = self._brk(ev, ops)
        if not ok:
            st.invalid += 1
            return None
        return ops

    def do(self, op: PageOp) -> None:
        """Apply one range of a planned event."""
        if op.site is None:
            self._unmap_counting(op.start, op.end)
        else:
            self._place(op.start, op.end, op.site, replace_ok=op.replace_ok)

    def close(self, time_ns: int, applied: bool) -> None:
        """After a planned event's ranges: count it, and move the peak."""
        if applied:
            self.stats.applied += 1
            if self._total > self._peak.total:
                self._peak = _Peak(total=self._total, time_ns=time_ns)

    def _mmap(self, ev: PageEvent, ops: list[PageOp]) -> bool:
        start, end = ev.addr, ev.addr + page_up(ev.length)
        if not _valid_range(start, ev.length, end):
            return False
        # A successful mmap owns [start, end): anything there before was replaced (MAP_FIXED).
        ops.append(PageOp(start, end, ev.site, bool(ev.flags & MAP_FIXED)))
        return True

    def _munmap(self, ev: PageEvent, ops: list[PageOp]) -> bool:
        start, end = ev.addr, ev.addr + page_up(ev.length)
        if not _valid_range(start, ev.length, end):
            return False
        ops.append(PageOp(start, end))
        return True

    def _mremap(self, ev: PageEvent, ops: list[PageOp]) -> bool:
        old, old_len = ev.addr, page_up(ev.length)
        new, new_len = ev.new_addr, page_up(ev.new_length)
        if ev.length < 0 or not _valid_range(new, ev.new_length, new + new_len) or old % PAGE_SIZE:
            return False
        if old + old_len > _ADDR_LIMIT:
            return False
        fixed = bool(ev.flags & MREMAP_FIXED)
        if old_len == 0 or ev.flags & MREMAP_DONTUNMAP:
            # old_size 0 duplicates a shared mapping; DONTUNMAP leaves the old range mapped. Either way
            # only the new range is added.
            ops.append(PageOp(new, new + new_len, ev.site, fixed))
        elif new == old:
            if new_len < old_len:
                ops.append(PageOp(old + new_len, old + old_len))
            elif new_len > old_len:
                # Grown in place: only the tail is new (Massif's new_mem_mmap on the tail).
                ops.append(PageOp(old + old_len, old + new_len, ev.site))
        else:
            # Moved: Valgrind's core reports it as ms_copy_mem_remap, which unrecords the old pages and records
            # them at the new address with the stack of the mremap caller, then any growth as a new mapping of
            # the same caller (shrinking first, in place).
            kept = min(old_len, new_len)
            if new_len < old_len:
                ops.append(PageOp(old + new_len, old + old_len))
            ops.append(PageOp(old, old + kept))
            ops.append(PageOp(new, new + kept, ev.site, fixed))
            if new_len > old_len:
                ops.append(PageOp(new + old_len, new + new_len, ev.site, fixed))
        return True

    def _brk(self, ev: PageEvent, ops: list[PageOp]) -> bool:
        result = ev.new_addr
        if result <= 0 or result >= _ADDR_LIMIT:
            return False
        new_top = page_up(result)
        if ev.addr != 0 and ev.addr != result:
            self.stats.brk_refused += 1
        top = self.brk_top
        old_brk = self.brk if self.brk is not None else top
        if top is None:
            self.brk = result
            # First sight of the break: a brk(0) query (the loader's, or glibc's first sbrk) gives the base
            # of an empty region; any other change cannot be charged without the old break.
            if ev.addr == 0 and self.brk_base is None:
                self.brk_base = result
            elif ev.addr != 0:
                self.stats.brk_unknown_base += 1
            self.brk_top = new_top
            return True
        if self.brk_base is not None and result < self.brk_base:
            return False
        self.brk = result
        if new_top == top:
            return True
        if ev.addr == 0:
            self.stats.brk_resync += 1
        elif self.massif and old_brk is not None:
            ops.extend(_massif_brk(old_brk, result, ev.site))
        elif new_top > top:
            ops.append(PageOp(top, new_top, ev.site))
        else:
            ops.append(PageOp(new_top, top))
        self.brk_top = new_top
        return True

    # -- interval store --------------------------------------------------------------------------------

    def _unmap_counting(self, start: int, end: int) -> None:
        removed = 0
        for s, e, site in _splice(self._starts, self._ends, self._sites, start, end, None):
            self._charge(site, s - e)
            removed += e - s
        self.stats.unknown_unmapped_bytes += (end - start) - removed
        if self._below:
            self._rise(start, end)

    def _place(self, start: int, end: int, site: int, *, replace_ok: bool) -> None:
        """Map [start, end) to `site`, over whatever was there."""
        if start >= end:
            return
        pieces = _splice(self._starts, self._ends, self._sites, start, end, site)
        self._charge(site, end - start)
        if self.massif:
            # Massif's block table keeps a page once per record (VG_(HT_add_node) does not look for the key): the
            # pages mapped over stay counted, under the new ones.
            self._sink(pieces)
            return
        replaced = 0
        for s, e, old in pieces:
            self._charge(old, s - e)
            replaced += e - s
        if replaced and not replace_ok:
            self.stats.replaced_without_fixed_bytes += replaced

    def _sink(self, pieces: list[tuple[int, int, int]]) -> None:
        """Massif: pages recorded again push their earlier records one layer down."""
        self.stats.mapped_over_bytes += sum(e - s for s, e, _ in pieces)
        depth = 0
        while pieces:
            if depth == len(self._below):
                self._below.append(([], [], []))
            layer = self._below[depth]
            pieces = [p for s, e, site in pieces for p in _splice(*layer, s, e, site)]
            depth += 1

    def _rise(self, start: int, end: int) -> None:
        """Massif: unrecording a page removes its latest record (VG_(HT_remove) finds the newest): the record
        below it, if any, is found next time. No byte changes hands."""
        upper = (self._starts, self._ends, self._sites)
        for depth, layer in enumerate(self._below):
            rising = _splice(*layer, start, end, None)
            if not rising:
                break
            if not depth:
                self.stats.mapped_over_bytes -= sum(e - s for s, e, _ in rising)
            for s, e, site in rising:
                _splice(*upper, s, e, site)
            upper = layer
        while self._below and not self._below[-1][0]:
            self._below.pop()

    def _charge(self, site: int, delta: int) -> None:
        live = self._live
        before = live.get(site, 0)
        saved = self._peak.saved
        if site not in saved:
            saved[site] = before  # first change since the peak: this is its value at the peak
        after = before + delta
        if delta > 0:
            self._mapped_ever[site] = self._mapped_ever.get(site, 0) + delta
        else:
            self._unmapped[site] = self._unmapped.get(site, 0) - delta
        if after:
            live[site] = after
        else:
            live.pop(site, None)
        self._total += delta


class PageOp(NamedTuple):
    """One range of a page syscall, as Valgrind's core reports it to Massif: recorded for `site` (a new mapping,
    over anything there when `replace_ok`: MAP_FIXED), or unrecorded (site None)."""

    start: int
    end: int
    site: int | None = None
    replace_ok: bool = False


def _massif_brk(old: int, new: int, site: int) -> list[PageOp]:
    """The pages Massif 3.19 records or unrecords when the break moves from `old` to `new` (ms_new_mem_brk,
    ms_die_mem_brk): from the page holding the lower break, as many pages as the page-rounded break moved. With
    an unaligned lower break that is one page lower than the kernel's pages, so Massif keeps a page twice, or
    takes back one still mapped."""
    lo, hi = min(old, new), max(old, new)
    pages = (hi - 1) // PAGE_SIZE - (lo - 1) // PAGE_SIZE
    if not pages:
        return []
    start = lo // PAGE_SIZE * PAGE_SIZE
    end = start + pages * PAGE_SIZE
    return [PageOp(start, end, site)] if new > old else [PageOp(start, end)]


def _splice(
    starts: list[int], ends: list[int], sites: list[int], start: int, end: int, site: int | None
) -> list[tuple[int, int, int]]:
    """Make [start, end) belong to `site` (None: unmapped) in one layer of sorted disjoint intervals; return the
    pieces (start, end, site) that were there.

    One slice assignment per list: replacing one interval by one moves nothing, and an insertion or a removal
    moves the tail of the lists once, not once per step.
    """
    if start >= end:
        return []
    lo = bisect.bisect_right(starts, start) - 1
    if lo < 0 or ends[lo] <= start:
        lo += 1
    hi = bisect.bisect_left(starts, end)  # intervals [lo, hi) overlap [start, end)
    pieces = [(max(starts[k], start), min(ends[k], end), sites[k]) for k in range(lo, hi)]
    new_s: list[int] = []
    new_e: list[int] = []
    new_site: list[int] = []
    if lo < hi and starts[lo] < start:  # the head of the first interval survives
        new_s.append(starts[lo])
        new_e.append(start)
        new_site.append(sites[lo])
    if site is not None:
        if new_s and new_site[-1] == site:
            new_e[-1] = end
        else:
            new_s.append(start)
            new_e.append(end)
            new_site.append(site)
    if lo < hi and ends[hi - 1] > end:  # the tail of the last interval survives
        if new_s and new_e[-1] == end and new_site[-1] == sites[hi - 1]:
            new_e[-1] = ends[hi - 1]
        else:
            new_s.append(end)
            new_e.append(ends[hi - 1])
            new_site.append(sites[hi - 1])
    # Keep neighbours of one site merged: absorb an adjoining outside interval of the same site.
    if new_s and lo > 0 and ends[lo - 1] == new_s[0] and sites[lo - 1] == new_site[0]:
        lo -= 1
        new_s[0] = starts[lo]
    if new_s and hi < len(starts) and starts[hi] == new_e[-1] and sites[hi] == new_site[-1]:
        new_e[-1] = ends[hi]
        hi += 1
    starts[lo:hi] = new_s
    ends[lo:hi] = new_e
    sites[lo:hi] = new_site
    return pieces


def _valid_range(start: int, length: int, end: int) -> bool:
    """The kernel's checks: page-aligned start, non-zero length, no wrap past the address space."""
    return length > 0 and start >= 0 and start % PAGE_SIZE == 0 and end <= _ADDR_LIMIT


# ----------------------------------------------------------------------------------------------------------
# The page map in the profile's terms


@dataclass(frozen=True)
class PageTotals:
    """The page-level figures of a target, for the daemon and its gauges."""

    mapped: int  # bytes mapped now, as the page syscalls left them
    peak_mapped: int  # the highest mapped total seen
    syscalls: int  # page syscalls applied
    dropped: int  # page syscalls the kernel could not report (event buffer or thread table full)
    stacks: int  # --stacks=yes: all threads' stacks at the last sample (0 without it)
    brk_folded: int = 0  # sampled mode: brk calls the kernel folded into the mapped total, not sent
    unsampled: int = 0  # sampled mode: mmap, munmap and mremap calls not sampled, folded as brk is
    traced: bool = True  # the page calls are traced (sampled mode: --page-calls=yes); else statm's total at each look


class PageAccount:
    """A PageMap fed with the kernel's page events, seen the way the heap profile sees the kernel's sites.

    For --pages-as-heap=yes each mapped page is a 4096-byte block: the snapshot total is the mapped total, the
    tree groups pages by the stack that mapped them, and Massif's B clock moves by every page mapped or
    unmapped. In heap mode `total` is the mapped memory next to the heap, and `calls` feeds MALT.
    """

    def __init__(self, pages: PageMap, schedule: PageSchedule | None = None) -> None:
        self.map = pages
        self.time_b = 0  # bytes mapped plus bytes unmapped so far (Massif's --time-unit=B)
        self.peak_time_b = 0
        self.peak_gen = 0  # bumped at every new peak
        # (site, "mmap" | "munmap") -> [count, min, max, sum] of the lengths of the calls made there (MALT's
        # per-stack mmap/munmap infos); mremap and brk have no place there.
        self.calls: dict[tuple[int, str], list[int]] = {}
        self.schedule = schedule  # --pages-as-heap=yes: Massif's snapshots, taken at the events

    def apply(self, events: Iterable[PageEvent]) -> None:
        pm = self.map
        calls = self.calls
        schedule = self.schedule
        for ev in events:
            before, peak_before = pm.total, pm.peak_total
            if schedule is None:
                pm.apply(ev)
                self.time_b += abs(pm.total - before)
            else:
                self._apply_scheduled(ev, schedule)
            if (ev.kind == "mmap" or ev.kind == "munmap") and not ev.failed:
                count_call(calls, ev)
            if pm.peak_total > peak_before:
                self.peak_time_b = self.time_b
                self.peak_gen += 1

    def _apply_scheduled(self, ev: PageEvent, schedule: PageSchedule) -> None:
        """One event, range by range, offering the states Massif would snapshot: after each range recorded; for
        a range unrecorded, before it (a peak) and after its first page only (Massif snapshots no page after it),
        and not at all when its first page was not mapped (Massif's block lookup fails there first)."""
        pm = self.map
        ops = pm.plan(ev)
        for op in ops or ():
            before = pm.total
            if op.site is not None:
                pm.do(op)
                self.time_b += abs(pm.total - before)
                schedule.after(self.time_b, ev.time_ns, pm.total, pm.live_by_site)
                continue
            if pm.site_at(op.start) is None:
                pm.do(op)
                self.time_b += before - pm.total
                continue
            schedule.before_free(self.time_b, ev.time_ns, before, pm.live_by_site)
            first = PageOp(op.start, op.start + PAGE_SIZE)
            pm.do(first)
            self.time_b += PAGE_SIZE
            schedule.after(self.time_b, ev.time_ns, pm.total, pm.live_by_site)
            rest = pm.total
            pm.do(PageOp(first.end, op.end))
            self.time_b += rest - pm.total
        pm.close(ev.time_ns, ops is not None)

    @property
    def total(self) -> int:
        return self.map.total

    @property
    def peak_total(self) -> int:
        return self.map.peak_total

    @property
    def stats(self) -> PageStats:
        return self.map.stats

    def site_counts(self) -> dict[int, SiteCounts]:
        """Per site: bytes mapped now, at the peak, ever, and unmapped since, in SiteCounts' fields (blocks are
        pages). A site whose pages are all gone is still listed: it mapped memory."""
        pm = self.map
        live, peak = pm.live_by_site(), pm.peak_by_site()
        ever, gone = pm.mapped_ever_by_site(), pm.unmapped_by_site()
        out = {}
        for site in ever.keys() | live.keys():
            cur, tot, freed = live.get(site, 0), ever.get(site, 0), gone.get(site, 0)
            out[site] = SiteCounts(
                cur_bytes=cur,
                cur_blocks=cur // PAGE_SIZE,
                tot_bytes=tot,
                tot_blocks=max(1, tot // PAGE_SIZE),
                freed_bytes=freed,
                freed_blocks=freed // PAGE_SIZE,
                peak_bytes=peak.get(site, 0),
            )
        return out


def count_call(calls: dict[tuple[int, str], list[int]], ev: PageEvent, weight: int = 1) -> None:
    """MALT's per-stack statistics of mmap and munmap: one more call of `ev.length` bytes, standing for `weight`
    calls (min and max are the lengths seen)."""
    c = calls.get((ev.site, ev.kind))
    if c is None:
        calls[(ev.site, ev.kind)] = [weight, ev.length, ev.length, ev.length * weight]
    else:
        c[0] += weight
        c[1] = min(c[1], ev.length)
        c[2] = max(c[2], ev.length)
        c[3] += ev.length * weight


class FoldedPages:
    """Sampled mode's page figures. By default no page call is traced: the session folds statm's total at each look
    (its peak is the highest a look saw) and no call is applied. With --page-calls=yes, as the kernel folds them
    (probes/bpf/pages.h):

    The mapped total is the kernel's own (the process's total_vm, which /proc/PID/maps lists: read at the exit of
    every page call, the last value and the highest since user space looked), so it and its peak need no page map
    and no event per call. The kernel sends an event only for the calls it samples, by length as the sampler samples
    allocations: a call of L bytes with probability p = min(1, L / rate). Each stands for 1/p calls (rounded at
    random, up with the probability of its fraction), so MALT's counts and sums of mmap and munmap calls by stack are
    unbiased estimates, as the allocations' are.
    """

    def __init__(self, total: int, rate: int, rand: Callable[[], float] = random.random) -> None:
        self.rate = rate
        self.total = total  # from /proc/PID/statm at the attach, until the first page call
        self.peak_total = total
        self.peak_time_ns: int | None = None
        self.stats = PageStats()  # events: the sampled calls; applied: those that succeeded
        self.calls: dict[tuple[int, str], list[int]] = {}  # as PageAccount.calls, estimated
        self._rand = rand

    def fold(self, mapped: tuple[int, int] | None, time_ns: int) -> None:
        """The kernel's mapped bytes now and the most since the last fold (None: no page call since)."""
        if mapped is None:
            return
        now, high = mapped
        self.total = now
        if high > self.peak_total:
            self.peak_total, self.peak_time_ns = high, time_ns

    def weight(self, length: int) -> int:
        """The calls a sampled call of `length` bytes stands for: 1/p, its fraction rounded at random."""
        if length <= 0 or length >= self.rate:
            return 1
        whole, fraction = divmod(self.rate, length)
        return whole + (self._rand() * length < fraction)

    def apply(self, events: Iterable[PageEvent]) -> None:
        st = self.stats
        for ev in events:
            st.events += 1
            if ev.failed or ev.kind not in KINDS:
                st.failed += ev.failed
                continue
            st.applied += 1
            if ev.kind == "mmap" or ev.kind == "munmap":
                count_call(self.calls, ev, self.weight(ev.length))
