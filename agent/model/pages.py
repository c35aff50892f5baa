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

Where Massif departs from the kernel we follow the kernel, so the total agrees with /proc/PID/maps:
- mmap(MAP_FIXED) over live pages: the core only calls `new_mem_mmap`, and Massif's block table
  (`VG_(HT_add_node)`, "no duplicate key detection") then holds each overlapped page twice. Here the
  overlapped pages are unmapped first, then charged to the new site.
- brk: 3.19's `ms_new_mem_brk` records from `PGROUNDDN(old_brk)`, which counts a page twice when the old
  break was not page aligned. Here the break region is exactly [base, PAGE_ALIGN(brk)), as the kernel maps it.

Mappings that exist when we attach are charged to `PRE_EXISTING_SITE`, never to a real stack.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from agent.model.profile import SiteCounts

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


# ----------------------------------------------------------------------------------------------------------
# /proc/PID/maps, every line (agent.symbols.symbolizer.parse_maps keeps file mappings only)

VSYSCALL = "[vsyscall]"
ANON = "[anon]"


@dataclass(frozen=True)
class MapsEntry:
    """One line of /proc/PID/maps. `path` is the file, a kernel name ([heap], [stack], [vdso]...), or [anon]."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_file(self) -> bool:
        return self.path.startswith("/")


def parse_maps_full(text: str) -> list[MapsEntry]:
    """Every well-formed line of /proc/PID/maps text, in file order. A blank path becomes `[anon]`."""
    out: list[MapsEntry] = []
    for raw in text.splitlines():
        parts = raw.split(None, 5)
        if len(parts) < 5:
            continue
        try:
            lo, hi = parts[0].split("-", 1)
            start, end = int(lo, 16), int(hi, 16)
            offset, inode = int(parts[2], 16), int(parts[4])
        except ValueError:
            continue
        if end <= start:
            continue
        path = parts[5] if len(parts) == 6 and parts[5].strip() else ANON
        out.append(MapsEntry(start, end, parts[1], offset, parts[3], inode, path))
    return out


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

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._sites: list[int] = []
        self._live: dict[int, int] = {}
        self._mapped_ever: dict[int, int] = {}  # bytes each site ever mapped (xtree's totB)
        self._unmapped: dict[int, int] = {}  # bytes of each site's pages unmapped since (totFdB)
        self._total = 0
        self._peak = _Peak()
        self._last_time: int | None = None
        self.brk_base: int | None = None  # start of the break region, when known
        self.brk_top: int | None = None  # PAGE_ALIGN(current break), when known
        self.stats = PageStats()

    # -- seeding ---------------------------------------------------------------------------------------

    @classmethod
    def from_maps(cls, mappings: Iterable[MapsEntry], *, start_brk: int | None = None) -> PageMap:
        """A map holding the mappings that existed at attach time, all charged to PRE_EXISTING_SITE.

        `start_brk` (see `parse_start_brk`) gives the break region's base when the process has no [heap]
        line yet; with a [heap] line, its end is the page-rounded break. [vsyscall] is left out (see
        `mapped_total`), so `total` starts equal to `mapped_total` of the same text.
        """
        pm = cls()
        heap: MapsEntry | None = None
        for m in mappings:
            if m.path == VSYSCALL:
                continue
            pm._place(m.start, m.end, PRE_EXISTING_SITE, replace_ok=False)
            if m.path == "[heap]":
                heap = m
        if heap is not None:
            pm.brk_base = start_brk if start_brk is not None else heap.start
            pm.brk_top = heap.end
        elif start_brk is not None:
            pm.brk_base = start_brk
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
        st = self.stats
        st.events += 1
        if self._last_time is not None and ev.time_ns < self._last_time:
            st.out_of_order += 1
        self._last_time = ev.time_ns if self._last_time is None else max(self._last_time, ev.time_ns)
        if ev.kind not in KINDS:
            st.unknown_kind += 1
            return
        if ev.failed:
            st.failed += 1
            return
        if ev.kind == "mmap":
            ok = self._mmap(ev)
        elif ev.kind == "munmap":
            ok = self._munmap(ev)
        elif ev.kind == "mremap":
            ok = self._mremap(ev)
        else:
            ok = self._brk(ev)
        if not ok:
            st.invalid += 1
            return
        st.applied += 1
        if self._total > self._peak.total:
            self._peak = _Peak(total=self._total, time_ns=ev.time_ns)

    def _mmap(self, ev: PageEvent) -> bool:
        start, end = ev.addr, ev.addr + page_up(ev.length)
        if not _valid_range(start, ev.length, end):
            return False
        # A successful mmap owns [start, end): anything there before was replaced (MAP_FIXED).
        self._place(start, end, ev.site, replace_ok=bool(ev.flags & MAP_FIXED))
        return True

    def _munmap(self, ev: PageEvent) -> bool:
        start, end = ev.addr, ev.addr + page_up(ev.length)
        if not _valid_range(start, ev.length, end):
            return False
        self._unmap_counting(start, end)
        return True

    def _mremap(self, ev: PageEvent) -> bool:
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
            self._place(new, new + new_len, ev.site, replace_ok=fixed)
        elif new == old:
            if new_len < old_len:
                self._unmap_counting(old + new_len, old + old_len)
            elif new_len > old_len:
                # Grown in place: only the tail is new (Massif's new_mem_mmap on the tail).
                self._place(old + old_len, old + new_len, ev.site, replace_ok=False)
        else:
            # Moved: Massif's ms_copy_mem_remap unrecords the old pages and records the new range,
            # growth included, with the stack of the mremap caller.
            self._unmap_counting(old, old + old_len)
            self._place(new, new + new_len, ev.site, replace_ok=fixed)
        return True

    def _brk(self, ev: PageEvent) -> bool:
        result = ev.new_addr
        if result <= 0 or result >= _ADDR_LIMIT:
            return False
        new_top = page_up(result)
        if ev.addr != 0 and ev.addr != result:
            self.stats.brk_refused += 1
        top = self.brk_top
        if top is None:
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
        if new_top == top:
            return True
        if ev.addr == 0:
            self.stats.brk_resync += 1
        elif new_top > top:
            self._place(top, new_top, ev.site, replace_ok=False)
        else:
            self._unmap_counting(new_top, top)
        self.brk_top = new_top
        return True

    # -- interval store --------------------------------------------------------------------------------

    def _unmap_counting(self, start: int, end: int) -> None:
        removed = self._splice(start, end, None)
        self.stats.unknown_unmapped_bytes += (end - start) - removed

    def _place(self, start: int, end: int, site: int, *, replace_ok: bool) -> None:
        """Map [start, end) to `site`, replacing whatever was there."""
        replaced = self._splice(start, end, site)
        if replaced and not replace_ok:
            self.stats.replaced_without_fixed_bytes += replaced

    def _splice(self, start: int, end: int, site: int | None) -> int:
        """Make [start, end) belong to `site` (None: unmapped); return the bytes that were mapped there.

        One slice assignment per list: replacing one interval by one moves nothing, and an insertion or a
        removal moves the tail of the lists once, not once per step.
        """
        if start >= end:
            return 0
        starts, ends, sites = self._starts, self._ends, self._sites
        lo = bisect.bisect_right(starts, start) - 1
        if lo < 0 or ends[lo] <= start:
            lo += 1
        hi = bisect.bisect_left(starts, end)  # intervals [lo, hi) overlap [start, end)
        new_s: list[int] = []
        new_e: list[int] = []
        new_site: list[int] = []
        removed = 0
        for k in range(lo, hi):
            cut = min(ends[k], end) - max(starts[k], start)
            removed += cut
            self._charge(sites[k], -cut)
        if lo < hi and starts[lo] < start:  # the head of the first interval survives
            new_s.append(starts[lo])
            new_e.append(start)
            new_site.append(sites[lo])
        if site is not None:
            self._charge(site, end - start)
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
        return removed

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


class PageAccount:
    """A PageMap fed with the kernel's page events, seen the way the heap profile sees the kernel's sites.

    For --pages-as-heap=yes each mapped page is a 4096-byte block: the snapshot total is the mapped total, the
    tree groups pages by the stack that mapped them, and Massif's B clock moves by every page mapped or
    unmapped. In heap mode `total` is the mapped memory next to the heap, and `calls` feeds MALT.
    """

    def __init__(self, pages: PageMap) -> None:
        self.map = pages
        self.time_b = 0  # bytes mapped plus bytes unmapped so far (Massif's --time-unit=B)
        self.peak_time_b = 0
        self.peak_gen = 0  # bumped at every new peak
        # (site, "mmap" | "munmap") -> [count, min, max, sum] of the lengths of the calls made there (MALT's
        # per-stack mmap/munmap infos); mremap and brk have no place there.
        self.calls: dict[tuple[int, str], list[int]] = {}

    def apply(self, events: Iterable[PageEvent]) -> None:
        pm = self.map
        calls = self.calls
        for ev in events:
            before, peak_before = pm.total, pm.peak_total
            pm.apply(ev)
            if (ev.kind == "mmap" or ev.kind == "munmap") and not ev.failed:
                c = calls.get((ev.site, ev.kind))
                if c is None:
                    calls[(ev.site, ev.kind)] = [1, ev.length, ev.length, ev.length]
                else:
                    c[0] += 1
                    c[1] = min(c[1], ev.length)
                    c[2] = max(c[2], ev.length)
                    c[3] += ev.length
            self.time_b += abs(pm.total - before)
            if pm.peak_total > peak_before:
                self.peak_time_b = self.time_b
                self.peak_gen += 1

    @property
    def total(self) -> int:
        return self.map.total

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
