"""MALT profile recording: samples the timelines while the target runs, and builds the profile from the
kernel's statistics (agent.kernel.probes, HS_MALT) when it is asked for; once the target's profile has ended, from
the copy taken of them (agent.kernel.frozen), the first time it is asked for.

The kernel keeps everything exact that is per call (per-stack counts, sizes, lifetimes, sizeMap,
reallocJump, per-thread counts and time, log2 histograms); only the timelines are sampled, at the session's
sampling interval, and binned the way MALT bins them (agent.model.malt.TimelineBinner).

Sampled mode: the kernel's figures are the samples' weighted estimates, by the allocation function the
sampler named; the per-thread call counts are the sampler's own exact counts instead (`exact_calls`), and the
profile's config says which figures are exact (EXACT_IN_SAMPLED).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from agent.kernel.abi import FN_KINDS, LOG2_BINS
from agent.kernel.interface import LiveProbes, SiteReader
from agent.model.callcounts import ThreadCalls, merge_by_thread
from agent.model.counters import Counters
from agent.model.functions import BY_SYMBOL, malt_name_of_kind
from agent.model.malt import (
    BANDWIDTH_FIELDS,
    MEMORY_FIELDS,
    SYSTEM_FIELDS,
    CountMinMaxSum,
    MaltConfig,
    MaltGlobals,
    MaltLeak,
    MaltProfile,
    MaltRun,
    MaltStack,
    MaltStackStats,
    MaltThread,
    MaltTotals,
    ScatterChart,
    StackKey,
    ThreadFunctionStats,
    TimelineBinner,
)
from agent.model.sampling import ProfileMode
from agent.process.discovery import ProbePoint
from agent.process.procinfo import ResidentReader, resident_bytes
from agent.symbols.debugfiles import PROCESS_ROOT
from agent.symbols.globalvars import global_variables

if TYPE_CHECKING:
    from agent.session.session import Session

TICKS_PER_SECOND = 1_000_000_000  # the kernel's clock: nanoseconds
# Sampled mode: the figures of the MALT profile that are the sampler's exact counts (the per-thread call counts).
EXACT_IN_SAMPLED = ("threads.stats.*.count", "threads.cntMemOps")


@dataclass(frozen=True)
class _Ended:
    """What a profile is built from, and what the end's could not wait for: the time and date of the end (or of
    now), and the objects whose files were there then (their global variables)."""

    tables: SiteReader  # the probes' copy (agent.kernel.frozen), MALT's tables in it
    ns: int
    date: str
    objects: dict[str, str]


@dataclass(frozen=True)
class _NodeReading:
    free: int
    cached: int
    swap_used: int
    own_rss: int  # the daemon's (MALT's "internal" memory: the profiler's own)


class _NodeReadings:
    """The node's memory and the daemon's own, read for every target's timeline at once: each recorder read
    /proc/meminfo, /proc/vmstat and the daemon's statm at each of its samples (20 a second a target)."""

    def __init__(self, max_age: float) -> None:
        self._max_age = max_age
        self._lock = threading.Lock()
        self._at = -math.inf
        self._last: _NodeReading | None = None

    def reading(self) -> _NodeReading:
        with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._at > self._max_age:
                vm, swap = psutil.virtual_memory(), psutil.swap_memory()
                self._last = _NodeReading(vm.free, getattr(vm, "cached", 0), swap.used, resident_bytes())
                self._at = now
            return self._last


# Half a second: the node's free memory and swap move slowly, and a prefork server's new workers each read them at
# their first looks.
_node = _NodeReadings(max_age=0.5)


class MaltRecorder:
    def __init__(self, probes: LiveProbes, pid: int, points: int = 512, mode: ProfileMode | None = None,
                 exact_calls: Callable[[], list[ThreadCalls] | None] | None = None,
                 resident: ResidentReader | None = None) -> None:
        self.probes = probes
        self.pid = pid
        self.points = points
        self.mode = mode or ProfileMode()  # sampled: the kernel's counts are the samples' weights
        self.exact_calls = exact_calls  # sampled: the sampler's exact counts per thread (None: not armed yet)
        self.start_ns = time.monotonic_ns()
        self.memory = TimelineBinner(MEMORY_FIELDS, points=points, start=0)
        self.system = TimelineBinner(SYSTEM_FIELDS, points=points, start=0)
        self.bandwidth = TimelineBinner(BANDWIDTH_FIELDS, points=points, bandwidth=True, start=0)
        self.size_over_time = ScatterChart.size_over_time()
        self._prev: Counters | None = None
        self._prev_sizes = [0] * LOG2_BINS
        self._last_mem = (0, 0)
        vm = psutil.virtual_memory()
        self.total_memory = vm.total
        self.free_at_start = vm.free
        self.cached_at_start = getattr(vm, "cached", 0)
        # every tick: psutil's memory_info cost ten times its pread; the profile's own reader where it has one
        self._statm = resident or ResidentReader(pid)
        self._ended: _Ended | None = None

    def end(self, session: Session, tables: SiteReader) -> None:
        """The profile has ended: its final MALT profile is built from `tables` (the probes' copy, MALT's tables
        in it) when first asked, or never (most of a prefork server's replaced workers). Its stacks are
        symbolized now, while the target's files can still be read."""
        session.symbolize_new([*tables.used_sites(tables.site_count()), *_page_sites(session)])
        self._ended = self._as_of_now(session, tables)

    @staticmethod
    def _as_of_now(session: Session, tables: SiteReader) -> _Ended:
        return _Ended(tables, time.monotonic_ns(), time.strftime("%Y-%m-%d %H:%M"), _objects(session))

    def sample(self, c: Counters, mapped: int | None = None) -> None:
        """One point of the memory, system and bandwidth timelines, and the sizes allocated since the last.
        `mapped`: the target's mapped bytes from the page syscalls (the virtual line); else its VmSize."""
        t = time.monotonic_ns() - self.start_ns
        window_max, window_site = self.probes.take_window(c.heap)
        mem = self._statm.sizes()
        if mem is not None:  # else exited: the last reading stands
            self._last_mem = mem
        rss, vms = self._last_mem
        if mapped is not None:
            vms = mapped
        node = _node.reading()
        self.memory.push(t, (max(window_max, c.heap), rss, vms, node.own_rss, c.blocks), callsite=window_site or None)
        self.system.push(t, (node.free, node.cached, node.swap_used))
        prev = self._prev
        if prev is not None:
            self.bandwidth.push(
                t,
                (
                    c.alloc_bytes - prev.alloc_bytes,
                    (c.n_allocs + c.n_reallocs) - (prev.n_allocs + prev.n_reallocs),
                    c.freed_bytes - prev.freed_bytes,
                    c.n_frees - prev.n_frees,
                ),
            )
        self._prev = c
        sizes = self.probes.size_histogram()  # the lifetimes' 4,096 counters are read once, at the end
        for b, (now, before) in enumerate(zip(sizes, self._prev_sizes, strict=True)):
            if now > before:
                self.size_over_time.add_log2_bins(t, b, now - before)
        self._prev_sizes = sizes

    def _page_stacks(self, session: Session, tables: SiteReader) -> tuple[list[MaltStack], dict[str, int]]:
        """MALT's stacks of mmap and munmap calls, from the page syscalls (with each function's address: the
        system call's instruction in its libc wrapper, the innermost address of these stacks)."""
        pages = session.pages
        if pages is None or not session.traces_page_calls:
            return [], {}
        sites = _page_sites(session)
        raw = tables.stacks(sites)
        session.symbolize_new(sites)
        stacks: list[MaltStack] = []
        functions: dict[str, int] = {}
        for (site, kind), (count, lo, hi, total) in sorted(pages.calls.items()):
            ips = raw.get(site, ())
            if not ips:
                continue
            functions.setdefault(kind, ips[0])
            # The callers only: the wrapper's own frame is the function MALT names at the leaf.
            frames = tuple(f for f in session.frames_of(site) if f.address != ips[0])
            calls = CountMinMaxSum(count, lo, hi, total)
            stats = MaltStackStats(mmap=calls) if kind == "mmap" else MaltStackStats(munmap=calls)
            stacks.append(MaltStack(StackKey(tuple(ips[1:]), kind), stats, frames, stack_id=site))
        return stacks, functions

    def build(self, session: Session, c: Counters, probe_points: Sequence[ProbePoint], allocator: str) -> MaltProfile:
        end = self._ended or self._as_of_now(session, self.probes)  # the end's, once ended; else now's
        probes = end.tables
        sites = probes.malt_sites()
        raw = probes.stacks(list(sites))
        session.symbolize_new(list(sites))
        keys: dict[int, StackKey] = {}
        stacks = []
        leaks = []
        for site_id, f in sorted(sites.items()):
            key = StackKey(raw.get(site_id, ()), malt_name_of_kind(FN_KINDS.get(f.fn, "malloc")))
            keys[site_id] = key
            n_sized = f.tot_blocks - f.count_zeros
            stats = MaltStackStats(
                alloc=CountMinMaxSum(n_sized, f.alloc_min, f.alloc_max, f.tot_bytes) if n_sized else CountMinMaxSum(),
                free=CountMinMaxSum(f.free_count, f.free_min, f.free_max, f.free_sum),
                lifetime=CountMinMaxSum(f.life_count, f.life_min, f.life_max, f.life_sum),
                count_zeros=f.count_zeros,
                max_alive_req=max(f.max_alive, f.cur_bytes),
                alive_req=f.cur_bytes,
                global_peak=f.peak_bytes if f.peak_gen == c.peak_gen else f.cur_bytes,
                realloc_count=f.realloc_count,
                realloc_sum_delta=f.realloc_delta,
            )
            stacks.append(MaltStack(key, stats, tuple(session.frames_of(site_id)), stack_id=site_id))
            if f.cur_blocks:
                leaks.append(MaltLeak(key, f.cur_blocks, f.cur_bytes))
        leaks.sort(key=lambda lk: (-lk.memory, -lk.count))
        page_stacks, page_functions = self._page_stacks(session, probes)
        stacks.extend(page_stacks)
        mmap_calls = [s.stats.mmap for s in page_stacks if s.key.function == "mmap"]

        threads: dict[int, MaltThread] = {}
        for (tid, fn), (count, nbytes, ns) in sorted(probes.thread_stats().items()):
            name = malt_name_of_kind(FN_KINDS.get(fn, "malloc"))
            thread = threads.setdefault(tid, MaltThread(tid))
            acc = thread.stats.setdefault(name, ThreadFunctionStats())
            acc.count += count
            acc.sum += 0 if name == "free" else nbytes
            acc.time += ns
        calls = self.exact_calls() if self.exact_calls is not None else None
        if calls is not None:
            _exact_thread_counts(threads, calls)

        life = probes.life_histogram()
        lifetime_over_size = ScatterChart.lifetime_over_size()
        for i, n in enumerate(life):
            if n:
                lifetime_over_size.add_log2_bins(i // LOG2_BINS, i % LOG2_BINS, n)

        memory = self.memory.series()
        # The kernel names the site that set each interval's maximum by id; MALT by its stack.
        memory.callsites = [keys.get(cs, cs) if isinstance(cs, int) else cs for cs in memory.callsites]
        mappings = session.maps.mappings
        runtime = end.ns - self.start_ns
        return MaltProfile(
            run=MaltRun(
                exe=_exe_of(session),
                command=session.info.cmd,
                hostname=socket.gethostname(),
                allocator=allocator,
                date=end.date,
                runtime=runtime,
            ),
            globals=MaltGlobals(
                ticks_per_second=TICKS_PER_SECOND,
                total_memory=self.total_memory,
                free_memory_at_start=self.free_at_start,
                cached_memory_at_start=self.cached_at_start,
                max_thread_count=len(threads),
            ),
            totals=MaltTotals(
                alloc_count=c.n_allocs + c.n_reallocs,
                alloc_bytes=c.alloc_bytes,
                free_count=c.n_frees,
                free_bytes=c.freed_bytes,
                peak_bytes=c.peak_heap,
                mmap_count=sum(m.count for m in mmap_calls),
                mmap_bytes=sum(m.sum for m in mmap_calls),
            ),
            config=MaltConfig(points=self.points, mmap=session.pages is not None and session.traces_page_calls,
                              mode=self.mode.mode, sample_rate=self.mode.period,
                              exact=EXACT_IN_SAMPLED if calls is not None else ()),
            stacks=stacks,
            function_addresses={**_function_addresses(probe_points, mappings), **page_functions},
            mappings=mappings,
            size_map=probes.size_map(),
            realloc_jump=probes.realloc_jumps(),
            global_variables=global_variables(end.objects),
            threads=list(threads.values()),
            memory_timeline=memory,
            system_timeline=self.system.series(),
            memory_bandwidth=self.bandwidth.series(),
            size_over_time=self.size_over_time,
            lifetime_over_size=lifetime_over_size,
            leaks=leaks,
        )


def _exact_thread_counts(threads: dict[int, MaltThread], calls: Sequence[ThreadCalls]) -> None:
    """Put the sampler's exact call counts in place of the samples' estimated ones, thread by thread (the bytes
    stay the estimates: the sampler counts bytes per thread, not per function). A thread that made calls but
    no sample gets its entry here."""
    for tid, c in merge_by_thread(calls).items():
        thread = threads.setdefault(tid, MaltThread(tid))
        exact: dict[str, int] = {}
        for kind, n in c.by_kind().items():
            name = malt_name_of_kind(kind)
            exact[name] = exact.get(name, 0) + n
        for name in set(exact) | set(thread.stats):
            thread.stats.setdefault(name, ThreadFunctionStats()).count = exact.get(name, 0)


def _page_sites(session: Session) -> list[int]:
    """The sites of the page syscalls MALT shows (mmap and munmap), when they are traced."""
    pages = session.pages
    if pages is None or not session.traces_page_calls:
        return []
    return sorted({site for site, _ in pages.calls if site > 0})


def _objects(session: Session) -> dict[str, str]:
    """The target's mapped files that are there, by path, with the name each is shown by."""
    named = {m.path: m.name for m in sorted(session.maps.mappings, key=lambda m: m.name)}  # a file, not a segment
    return {path: name for path, name in named.items() if os.path.isfile(path)}


def _exe_of(session: Session) -> str:
    cmd = session.info.cmd.split()
    return cmd[0] if cmd else ""


def _resolved(path: str) -> str:
    """`path` with its links resolved, or as given where they cannot be: under /proc/PID/root of a target that has
    exited but is not reaped yet (a container's process, its runtime not done with it), the kernel still shows
    /proc/PID but no longer reads its root link, and realpath raises FileNotFoundError."""
    try:
        return os.path.realpath(path)
    except OSError:
        return path


def _seen_inside(path: str, by_path: dict[str, list]) -> list:  # type: ignore[type-arg]
    """The mappings of `path`, a file under a process's /proc/PID/root, by its path inside that root: the maps'
    own name for it, or a name ending so (the maps name a container's file by its path from the daemon's root)."""
    inside = PROCESS_ROOT.sub("", path, count=1)
    if inside == path:
        return []
    same = by_path.get(inside)
    if same:
        return same
    return [m for name, ms in by_path.items() if name.endswith(inside) for m in ms]


def _function_addresses(points: Sequence[ProbePoint], mappings: Sequence) -> dict[str, int]:  # type: ignore[type-arg]
    """Where each allocation function sits in the target: the leaf frame of MALT's stacks."""
    out: dict[str, int] = {}
    by_path: dict[str, list] = {}  # type: ignore[type-arg]
    for m in mappings:
        by_path.setdefault(m.path, []).append(m)
    by_real: dict[str, list] | None = None  # type: ignore[type-arg]
    for p in points:
        # The maps name a file by its real path, as the points mostly do; an attached target's points are under
        # its /proc/PID/root, which no longer resolves once it has ended (when its profile is built): the path
        # inside its root is the maps' name for it, or (a container's root seen from here) the end of that name.
        # Only when none of these is a mapping's are every object's links resolved (a lstat each), and once.
        same = by_path.get(p.path) or _seen_inside(p.path, by_path)
        if not same:
            if by_real is None:
                by_real = {}
                for path, ms in by_path.items():
                    if path.startswith("/"):  # not [heap], [stack] or an anonymous mapping
                        by_real.setdefault(_resolved(path), []).extend(ms)
            same = by_real.get(_resolved(p.path), [])
        for m in same:
            if m.offset <= p.file_offset < m.offset + (m.end - m.start):
                name = BY_SYMBOL[p.symbol].malt_name if p.symbol in BY_SYMBOL else p.symbol
                out.setdefault(name, m.start + p.file_offset - p.placement.offset - m.offset)
                break
    return out
