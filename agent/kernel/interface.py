"""The kernel layer as the session sees it, without bcc: the probes' settings and the sizes of their tables, the
unwind mappings handed to them, and the readers of a profile's counters (SiteReader, LiveProbes)."""

from __future__ import annotations

import abc
import ctypes
import mmap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from agent.kernel.abi import MAX_SIZES, MAX_THREADS, PAGE_RING_BYTES, PENDING_SLOTS, SAMPLED_MAX_SIZES
from agent.model.counters import Counters, PageCounters
from agent.model.pages import PageEvent
from agent.model.stack import SiteCounts
from agent.process.discovery import ProbePoint


@dataclass(frozen=True)
class UnwindMapping:
    """An executable mapping of the target and the unwind table of its object."""

    start: int
    end: int
    bias: int  # runtime address = ELF virtual address + bias
    key: str  # the object's identity (build-id or path): its rows are loaded once
    rows: bytes  # agent.symbols.unwind ROW-packed, sorted
    n_rows: int


@dataclass(frozen=True)
class MaltSiteFields:
    """MALT's statistics of one site (probes/heap.h struct hs_site, HS_MALT fields)."""

    fn: int = 0  # enum hs_fn (FN_KINDS)
    tot_bytes: int = 0
    tot_blocks: int = 0
    cur_bytes: int = 0
    cur_blocks: int = 0
    peak_bytes: int = 0
    peak_gen: int = 0
    alloc_min: int = 0
    alloc_max: int = 0
    count_zeros: int = 0
    max_alive: int = 0
    free_count: int = 0
    free_min: int = 0
    free_max: int = 0
    free_sum: int = 0
    life_count: int = 0
    life_min: int = 0
    life_max: int = 0
    life_sum: int = 0
    realloc_count: int = 0
    realloc_delta: int = 0


@dataclass(frozen=True)
class ProbeSettings:
    target_tgid: int
    arm_on_exec: bool  # run: count from the target's exec on; attach: count from now on
    stop_events: bool = False  # run: stop the target at exec, loader changes and exit() for user space
    unwind: bool = True  # walk stacks with .eh_frame tables; False: frame pointers only
    max_rows: int = 1 << 21  # unwind table rows, all objects together
    free_stacks: bool = False  # charge freed bytes to the stack of the free call (xtree full)
    malt: bool = False  # keep MALT's statistics too (sizes, lifetimes, threads, scatter)
    heap_admin: int = 8
    alignment: int = 16
    max_depth: int = 40
    max_blocks: int = 1 << 20  # live blocks a target may hold (exact mode)
    # Live blocks the shared block table holds for every target of the program together (a daemon's node): 0, as
    # many as one target may (a single target: the CLI)
    node_blocks: int = 0
    # Seconds the loaded program stays loaded once its last target is gone, for the next target of its shape (a
    # daemon's --keep-programs); 0: unloaded with its last target (a command's one target)
    keep_programs: float = 0.0
    max_stacks: int = 1 << 16
    pages: bool = False  # trace mmap/munmap/mremap/brk: one PageEvent per call (page_events())
    # Walk the stack of each page call (its site: the pages-as-heap tree, MALT's mmap statistics). Without it the
    # page walker is not loaded, which saves its verification (~0.8 s of an attach), and every call has site 0.
    page_stacks: bool = True
    stacks: bool = False  # keep each thread's stack extent (--stacks=yes: stack_bytes())
    sampled: bool = False  # also compile probes/bpf/sampled.h (HS_SAMPLED) (points of kind sample_alloc / sample_free)
    schedule_ns: bool = False  # the snapshot schedule's points are timed in ns (--time-unit=ms), else in B
    sample_rate: int = 524288  # sampled: the sampler's mean bytes between samples (its weights' rate)
    page_ring_bytes: int = PAGE_RING_BYTES  # the page events' ring buffer (pages): a power of two of pages
    ignore: bool = False  # --ignore-fn: reallocs follow Massif's rule by the sites' flags (set_site_flags)


def table_sizes(s: ProbeSettings) -> dict[str, int]:
    """The sizes of the kernel's tables (probes/heap.h HS_* defines) for these settings. Each target holds its
    tables in the kernel for as long as it is profiled, busy or not: what the mode does not use is compiled at
    its smallest (sampled mode attaches no allocation function, so exact mode's block table and call slots go
    unused, and sampled calls never reach MALT's realloc jumps; without MALT its size tables go unused). The
    block table is the program's, shared by its targets (probes/bpf/blocks.h)."""
    node = max(s.node_blocks, s.max_blocks)
    return {
        "HS_BLOCK_SLOTS": 2 if s.sampled else block_slots(node),
        "HS_MAX_BLOCKS": 16 if s.sampled else max(node // 2, 16),
        "HS_TARGET_BLOCKS": s.max_blocks,
        "HS_MAX_SAMPLED_BLOCKS": s.max_blocks,  # sampled_blocks (probes/bpf/sampled.h, sampled mode only)
        "HS_PENDING_SLOTS": 1 if s.sampled else PENDING_SLOTS,
        "HS_MAX_PENDING": 16 if s.sampled else MAX_THREADS,
        "HS_MAX_STACKS": s.max_stacks,
        "HS_MAX_SIZES": (SAMPLED_MAX_SIZES if s.sampled else MAX_SIZES) if s.malt else 1,
        "HS_MAX_JUMPS": MAX_SIZES if s.malt and not s.sampled else 1,
        "HS_PAGE_RING_PAGES": s.page_ring_bytes // mmap.PAGESIZE,
    }


def block_slots(max_blocks: int) -> int:
    """Slots of the kernel's block table for --max-blocks: a power of two, at least 2 (one bucket). Blocks
    whose bucket is full go to an overflow hash of half as many entries."""
    return max(2, 1 << (max_blocks - 1).bit_length())


class SiteArray:
    """Entries of an array map whose fields are all 64 bits, read as columns: the kernel's array mapped
    read-only (BPF_F_MMAPABLE), so a read is neither a syscall nor a copy of the whole array; or a copy of it.

    `fields` gives each field's offset in words and whether it is signed."""

    def __init__(self, buf: Any, stride: int, fields: dict[str, tuple[int, bool]], entries: int) -> None:
        self._buf = buf
        self._words = memoryview(buf).cast("B").cast("Q")
        self._signed = memoryview(buf).cast("B").cast("q")
        self.stride = stride  # words per entry
        self.fields = fields
        self.entries = entries  # entries readable

    @classmethod
    def of_leaf(cls, buf: Any, leaf: Any, entries: int) -> SiteArray:
        """Over `buf`, holding entries of the ctypes struct `leaf` (bcc's description of the map's value)."""
        stride = ctypes.sizeof(leaf) // 8
        fields = {
            name: (getattr(leaf, name).offset // 8, getattr(kind, "_type_", "Q") in ("q", "l"))
            for name, kind in leaf._fields_
        }
        return cls(buf, stride, fields, entries)

    def column(self, name: str, count: int, signed: bool | None = None) -> list[int]:
        """Field `name` of entries 0..count-1, signed as declared unless `signed` says otherwise."""
        offset, declared = self.fields[name]
        count = min(count, self.entries)
        words = self._signed if (declared if signed is None else signed) else self._words
        return words[offset : offset + count * self.stride : self.stride].tolist()

    def entry(self, index: int) -> list[int]:
        """All words of one entry."""
        return self._words[index * self.stride : (index + 1) * self.stride].tolist()

    def copy(self, count: int) -> SiteArray:
        """Entries 0..count-1, copied: readable after the map is gone."""
        count = min(count, self.entries)
        return SiteArray(bytearray(self._words[: count * self.stride]), self.stride, self.fields, count)

    def release(self) -> None:
        self._words.release()
        self._signed.release()


def _drop_leading(ips: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """`ips` without its leading addresses that lie in one of `ranges` ([lo, hi))."""
    i = 0
    while i < len(ips) and any(lo <= ips[i] < hi for lo, hi in ranges):
        i += 1
    return ips[i:]


class SiteReader(abc.ABC):
    """Reads a profile's counters: the global counters, the sites' counters and their stacks. The live probes
    (HeapProbes) read the kernel's maps in place; FrozenProbes reads a copy taken before the program is unloaded,
    so an exited target's profile can still be queried."""

    settings: ProbeSettings
    rows_used = 0  # unwind rows loaded into the kernel, all objects together
    rows_dropped = 0  # rows that did not fit in the table (their objects fall back to frame pointers)
    rows_shared = 0  # of rows_used, those another target had placed already (one image's pods: written once)

    def __init__(self) -> None:
        self._stacks: dict[int, tuple[int, ...]] = {}  # site id -> return addresses, read once per site
        # Address ranges whose frames are dropped from the start of every stack: sampled mode's stacks begin
        # inside the sampler library (its hooks), which stand where exact mode's probe sees the caller.
        self.lead_trim: tuple[tuple[int, int], ...] = ()

    @abc.abstractmethod
    def counters(self) -> Counters: ...

    @abc.abstractmethod
    def page_counters(self) -> PageCounters: ...

    @abc.abstractmethod
    def _site_view(self, count: int) -> SiteArray: ...

    @abc.abstractmethod
    def _read_stack(self, key: int) -> tuple[int, ...]: ...

    def site_count(self) -> int:
        """Site ids in use so far, the overflow site 0 included: read columns of this many sites."""
        return min(self.counters().n_sites + 1, self.settings.max_stacks)

    def site_column(self, name: str, count: int, signed: bool | None = None) -> list[int]:
        """One counter of struct hs_site (probes/heap.h), for sites 0..count-1, read in place. `signed`: read
        an unsigned counter as signed (a live count a racy read saw below zero comes out negative)."""
        return self._site_view(count).column(name, count, signed)

    def copy_sites(self, count: int) -> SiteArray:
        """The counters of sites 0..count-1, copied (they stay readable once the program is unloaded)."""
        return self._site_view(count).copy(count)

    def used_sites(self, count: int) -> list[int]:
        """Site ids among 0..count-1 with an allocation or a free charged to them; the others were handed out
        but never used (another CPU published the same stack first), or their first call is still running."""
        used = zip(
            self.site_column("tot_blocks", count),
            self.site_column("freed_blocks", count),
            self.site_column("free_count", count),
            strict=True,
        )
        return [key for key, (a, f, n) in enumerate(used) if a or f or n]

    def sites(self, peak_gen: int) -> dict[int, SiteCounts]:
        """Counters per used site, with the peak values resolved against the global peak numbered `peak_gen`."""
        n = self.site_count()
        plain = ("cur_bytes", "cur_blocks", "tot_bytes", "tot_blocks", "freed_bytes", "freed_blocks", "cur_extra")
        columns = [self.site_column(name, n) for name in plain]
        peak_bytes = self.peak_column("peak_bytes", "cur_bytes", n, peak_gen)
        peak_extra = self.peak_column("peak_extra", "cur_extra", n, peak_gen)
        return {
            key: SiteCounts(
                **{name: column[key] for name, column in zip(plain, columns, strict=True)},
                peak_bytes=peak_bytes[key],
                peak_extra=peak_extra[key],
            )
            for key in self.used_sites(n)
        }

    def peak_column(self, name: str, live: str, count: int, peak_gen: int, signed: bool | None = None) -> list[int]:
        """A site's value at the global peak numbered `peak_gen` (peak_bytes, peak_extra): a site untouched
        since that peak still holds it in its live counter (`live`), as the kernel copies it lazily."""
        at_peak = self.site_column(name, count, signed)
        now = self.site_column(live, count, signed)
        gens = self.site_column("peak_gen", count)
        return [p if g == peak_gen else c for p, c, g in zip(at_peak, now, gens, strict=True)]

    # ---- MALT's tables (settings.malt), read for its profile: the sites' own columns, and four tables
    @abc.abstractmethod
    def size_map(self) -> dict[int, int]: ...

    @abc.abstractmethod
    def realloc_jumps(self) -> dict[tuple[int, int], int]: ...

    @abc.abstractmethod
    def thread_stats(self) -> dict[tuple[int, int], tuple[int, int, int]]: ...

    @abc.abstractmethod
    def life_histogram(self) -> list[int]: ...

    def malt_sites(self) -> dict[int, MaltSiteFields]:
        """MALT's per-stack statistics (settings.malt), by site id: the sites with an allocation or a free."""
        n = self.site_count()
        names = [f.name for f in fields(MaltSiteFields)]
        columns = [self.site_column(name, n) for name in names]
        tot_n, free_count = self.site_column("tot_blocks", n), self.site_column("free_count", n)
        out = {}
        for key in range(n):
            if tot_n[key] == 0 and free_count[key] == 0:
                continue
            out[key] = MaltSiteFields(**{name: column[key] for name, column in zip(names, columns, strict=True)})
        return out

    def stacks(self, keys: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """Return addresses behind site keys (innermost first). Read from the kernel once per site: they are
        written before the site's id is published, and never change."""
        out = {}
        for key in keys:
            ips = self._stacks.get(key)
            if ips is None:
                ips = self._read_stack(key)
                if ips and self.lead_trim:
                    ips = _drop_leading(ips, self.lead_trim)
                if ips:
                    self._stacks[key] = ips
            out[key] = ips
        return out


class LiveProbes(SiteReader):
    """A target's probes while they are loaded, as the session reads and steers them: its events and stops, the
    page events, the snapshot schedule and log, the unwind tables and MALT's statistics. HeapProbes implements
    it (each method is documented there); the session never sees bcc."""

    points: tuple[ProbePoint, ...]  # where the uprobes are attached

    # ---- events and stops
    @abc.abstractmethod
    def wait_events(self, timeout: float) -> list[int]: ...

    @abc.abstractmethod
    def stopped(self) -> int: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def activity(self) -> bytes: ...

    @abc.abstractmethod
    def mapping_calls(self) -> int | None: ...

    def code_outside(self) -> int | None:
        """Frames the stack walks met in code outside every mapping with a published unwind table, or None when the
        walks read no tables (frame pointers only): while it stands still, every stack walked lay in mappings
        already read (a new mapping of code, if any, was not met)."""
        return None

    @abc.abstractmethod
    def page_events(self) -> list[PageEvent]: ...

    def mapped_fold(self) -> tuple[int, int] | None:
        """Sampled mode: the mapped bytes now and the most since the last call (None: no page call since)."""
        return None

    @abc.abstractmethod
    def stack_bytes(self) -> int: ...

    # ---- the snapshot schedule
    @abc.abstractmethod
    def start_schedule(self, origin_ns: int, max_snapshots: int, peak_inaccuracy: float) -> None: ...

    @abc.abstractmethod
    def set_schedule(self, interval: int, cull_at: int, due: int | None) -> None: ...

    @abc.abstractmethod
    def schedule_points(self) -> list[tuple[int, int, int, int, int]]: ...

    @abc.abstractmethod
    def snapshot_log(self) -> list[tuple[int, int, int, int, int]]: ...

    # ---- what the stack walk and the realloc rule read
    @abc.abstractmethod
    def set_stack_end(self, end: int) -> None: ...

    @abc.abstractmethod
    def publish_unwind(self, mappings: Sequence[UnwindMapping]) -> None: ...

    @abc.abstractmethod
    def set_site_flags(self, flags: Mapping[int, bool]) -> None: ...

    # ---- MALT's statistics (settings.malt; the profile's tables are SiteReader's)
    @abc.abstractmethod
    def size_histogram(self) -> list[int]: ...

    @abc.abstractmethod
    def take_window(self, heap_now: int) -> tuple[int, int]: ...
