"""A profiling session: turns the kernel's counters into Massif snapshots.

The kernel aggregates (agent.kernel.probes); this module samples it on a schedule, symbolizes the stacks it
finds (agent.symbols.symbolizer), and keeps the snapshot series (agent.model.profile) that the exporters write.
It does not know how the target was started: the pipeline hands it a probe set and a way to tell whether the
target still runs.
"""

from __future__ import annotations

import gc
import io
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from agent.export.massif import render_snapshot, write_massif
from agent.kernel.probes import EV_EXEC, EV_EXIT, EV_SCHEDULE, SCHED_PEAK, Counters, HeapProbes, UnwindMapping
from agent.model.options import MassifOptions
from agent.model.pages import (
    PAGE_SIZE,
    PRE_EXISTING_EXEC_LABEL,
    PRE_EXISTING_LABEL,
    PRE_EXISTING_SITE,
    PageAccount,
    PageMap,
    PageTotals,
    parse_maps_full,
    parse_start_brk,
    parse_start_stack,
)
from agent.model.profile import (
    HEAP_ROOT_LABEL,
    PAGES_ROOT_LABEL,
    Frame,
    IndexedTree,
    SiteCounts,
    Snapshot,
    SnapshotKind,
    SnapshotSeries,
    Stack,
    StackIndex,
    trim_stack,
)
from agent.model.schedule import PointFeed
from agent.symbols.elf import ElfError, open_elf
from agent.symbols.symbolizer import Mapping, Symbolizer, parse_maps

if TYPE_CHECKING:
    from agent.export.malt import MaltProfile
    from agent.process.discovery import ProbePoint
    from agent.session.maltrec import MaltRecorder
    from agent.symbols.unwind import UnwindTable
from agent.export.xtree import write_xtree

# Shown for allocations whose stack the kernel did not store (its stack table was full, or the walk was
# overtaken on a preemptible kernel).
_OVERFLOW_FRAME = Frame(address=0, function="[stack not recorded]")
# The xtree keeps every frame up to main; this stands for "no depth limit".
_XTREE_DEPTH = 1 << 16
# Sites outside the heap tree (Session._site_stack): made by an --ignore-fn function, or with no frame left once
# trimmed (HeapTree leaves those out too).
_IGNORED = -1
_NO_FRAME = -2


class MapsRecorder:
    """The target's file mappings, recorded while it lives so that it can be symbolized after it exits."""

    def __init__(self, pid: int, proc: str = "/proc") -> None:
        self.path = f"{proc}/{pid}/maps"
        self.stat_path = f"{proc}/{pid}/stat"
        self._text = ""
        self._seen: dict[tuple[int, int, int, str], Mapping] = {}
        self.mappings: tuple[Mapping, ...] = ()  # every mapping ever seen, newest first
        self.current: tuple[Mapping, ...] = ()  # the mappings at the last refresh
        # Where the main thread's stack reads must stop: just above argc, where exec left the stack pointer.
        # Its frames lie below, in pages the process has used; above argc's page the kernel's random gap may
        # never have been touched, and a read from the BPF side cannot fault it in. 0: unknown.
        self.stack_end = 0

    def refresh(self) -> bool:
        """Read the maps again; True when something new was mapped."""
        try:
            with open(self.path) as f:
                text = f.read()
        except OSError:  # the target is gone: keep what was recorded
            return False
        if text == self._text:
            return False
        self._text = text
        fresh = False
        self.current = tuple(parse_maps(text))
        try:
            with open(self.stat_path) as f:
                start_stack = parse_start_stack(f.read())
        except OSError:
            start_stack = None
        self.stack_end = start_stack + 8 if start_stack else 0
        for m in self.current:
            key = (m.start, m.end, m.offset, m.path)
            if key not in self._seen:
                self._seen[key] = m
                fresh = True
        if fresh or len(self.current) != len(self._seen):
            fresh = True
            # Newest first, so that an address range reused by a later mapping finds the later one.
            self.mappings = tuple(reversed(self._seen.values()))
        return fresh


@dataclass
class Ignored:
    """Bytes of --ignore-fn allocations, taken off the snapshot totals."""

    heap: int = 0
    extra: int = 0


@dataclass
class SessionInfo:
    pid: int
    cmd: str  # the target's command line, for the files' cmd: lines
    desc: Sequence[str]  # the Massif options as the user gave them, for desc:
    allocator: str  # one line: which allocator was found


class Session:
    """Sample, symbolize and record one target's heap."""

    def __init__(
        self,
        opts: MassifOptions,
        probes: HeapProbes,
        info: SessionInfo,
        symbolizer: Symbolizer | None = None,
        proc: str = "/proc",
        tables: Callable[[str], UnwindTable | None] | None = None,
        exec_limit: int = 0,
    ) -> None:
        self.opts = opts
        self.probes = probes
        self.info = info
        self.proc = proc
        self.maps = MapsRecorder(info.pid, proc)
        self.tables = tables  # unwind tables per object path (None: frame-pointer stacks)
        self.exec_limit = exec_limit  # execs the target may make (run: its first one) before the profile ends
        # The mappings the page map starts with: made by the kernel at exec (run) or before the attach.
        pre_existing = PRE_EXISTING_EXEC_LABEL if exec_limit else PRE_EXISTING_LABEL
        self._pre_existing_frame = Frame(address=0, function=pre_existing)
        self.recorder: MaltRecorder | None = None  # MALT's timelines, when a MALT profile is wanted
        self.unwind_problems: dict[str, str] = {}  # objects whose table could not be built, and why
        self._table_seconds: dict[str, float] = {}  # object path -> time to build or load its table
        self._loaded_tables: dict[str, UnwindTable | None] = {}
        self.symbolizer = symbolizer or Symbolizer()
        self.series = SnapshotSeries(detailed_freq=opts.detailed_freq, max_snapshots=opts.max_snapshots)
        self.start_ns = time.monotonic_ns()  # the same clock as bpf_ktime_get_ns
        self._ended_ns: int | None = None  # when run() stopped sampling
        self.end_counters: Counters | None = None
        self._frames: dict[int, list[Frame]] = {}  # stack key -> symbolized raw stack
        self._trimmed: dict[int, Stack] = {}  # stack key -> Massif's trimmed stack
        self._sites_seen = 0  # the kernel's n_sites when the sites were last symbolized
        # --pages-as-heap=yes: the tree is of pages, by the stack of the syscall that mapped them
        self.root_label = PAGES_ROOT_LABEL if opts.pages_as_heap else HEAP_ROOT_LABEL
        self.pages: PageAccount | None = None  # the page map, when the probes trace page syscalls
        self._pages_lock = threading.Lock()
        self.stack_bytes = 0  # --stacks=yes: all threads' stacks at the last sample
        # The heap tree's stacks, numbered once: a snapshot's tree is then one pass over the sites' counters.
        self._index = StackIndex(self.root_label)
        self._site_stack: dict[int, int] = {}  # site -> its trimmed stack's number in _index, or _IGNORED/_NO_FRAME
        self._first_keys: list[int] = []  # by stack number: the first site found with that stack
        self._more_keys: list[tuple[int, int]] = []  # (site, stack number) of the other sites in the tree
        self._ignored_keys: list[int] = []  # sites of --ignore-fn functions
        self._waiting: list[int] = []  # site ids not in the tree yet: unused so far, or only frees charged
        self._ids_taken = 1  # site ids 0.._ids_taken-1 are in one of the lists above (0 is in _waiting)
        self._waiting.append(0)
        # --pages-as-heap=yes: the page map's sites (a dict, with PRE_EXISTING_SITE) have an index of their own
        self._page_index = StackIndex(self.root_label)
        self._page_stack: dict[int, int] = {}  # page site -> its stack's number in _page_index, or _IGNORED/_NO_FRAME
        self._lock = threading.Lock()  # readers (HTTP) and the sampler share the model
        self._alloc_fns = opts.all_alloc_fns
        self._ignore_fns = frozenset(opts.ignore_fns)
        # Snapshots on Massif's schedule: the kernel sends a point at each event that reaches the next due time
        # (agent.model.schedule). With --pages-as-heap=yes the heap is the page map's, and the ticks sample it.
        self.points: PointFeed | None = None
        self._steered_cullings = 0  # the series' cullings when the kernel was last given a due time
        if not opts.pages_as_heap:
            self.points = PointFeed(self.series, self._point_time, peak_kind=SCHED_PEAK)
            probes.start_schedule(self.start_ns, opts.max_snapshots, opts.peak_inaccuracy)

    # ---- time -------------------------------------------------------------------------------------

    def now(self, c: Counters) -> int:
        """The current time in the session's unit (once sampling has ended, the time it ended)."""
        if self.opts.time_unit == "B":
            return c.time_b
        now_ns = self._ended_ns if self._ended_ns is not None else time.monotonic_ns()
        return (now_ns - self.start_ns) // 1_000_000

    def _point_time(self, raw: int) -> int:
        """A schedule point's time in the session's unit (the kernel gives ns for ms)."""
        if self.opts.time_unit == "B":
            return raw
        return max(0, (raw - self.start_ns) // 1_000_000)

    def peak_time(self, c: Counters) -> int:
        if self.opts.time_unit == "B":
            return c.peak_time_b
        return max(0, (c.peak_ns - self.start_ns) // 1_000_000)

    # ---- stacks -----------------------------------------------------------------------------------

    def malt_profile(self, points: Sequence[ProbePoint], allocator: str) -> MaltProfile:
        """MALT's profile of the state now (the final state once finished). Needs the recorder."""
        assert self.recorder is not None
        with self._lock:  # the sampler adds to the recorder's timelines and symbolizes under it too
            return self.recorder.build(self, self.end_counters or self.counters(), points, allocator)

    def symbolize_new(self, keys: Sequence[int]) -> None:
        """Symbolize stacks not seen before, while the target's mappings are still readable."""
        new = [k for k in keys if k not in self._frames]
        if not new:
            return
        raw = self.probes.stacks(new)
        if any(ip and not self._mapped(ip) for ips in raw.values() for ip in ips[:1]):
            self.maps.refresh()
        for key in new:
            ips = raw.get(key, ())
            if key == PRE_EXISTING_SITE:
                self._frames[key] = [self._pre_existing_frame]
            elif not ips:
                self._frames[key] = [_OVERFLOW_FRAME]
            else:
                self._frames[key] = self.symbolizer.symbolize_stack(self.maps.mappings, ips)

    def frames_of(self, key: int) -> list[Frame]:
        """The symbolized raw stack of a site (symbolize_new first)."""
        return self._frames.get(key, [])

    def _mapped(self, ip: int) -> bool:
        return any(m.start <= ip < m.end for m in self.maps.mappings)

    def trimmed(self, key: int) -> Stack:
        stack = self._trimmed.get(key)
        if stack is None:
            stack = trim_stack(self._frames[key], self._alloc_fns, self.opts.depth)
            self._trimmed[key] = stack
        return stack

    def _ignored(self, stack: Stack) -> bool:
        """--ignore-fn: the allocation was made directly in an ignored function."""
        return bool(stack) and stack[0].function in self._ignore_fns if self._ignore_fns else False

    def _take_sites(self, count: int) -> None:
        """Put sites 0..count-1 that have allocations into the tree's lists (symbolizing them), once each."""
        fresh = range(self._ids_taken, count)
        if not fresh and not self._waiting:
            return
        tot_blocks = self.probes.site_column("tot_blocks", count)
        candidates = self._waiting + list(fresh)
        self._ids_taken = max(self._ids_taken, count)
        # Sites with only frees charged (xtree full, MALT) are no allocation sites: they wait, as do ids not
        # used yet.
        take = [k for k in candidates if k < len(tot_blocks) and tot_blocks[k]]
        if not take:
            self._waiting = candidates
            return
        taken = set(take)
        self._waiting = [k for k in candidates if k not in taken]
        self.symbolize_new(take)
        for key in take:
            number = self._stack_number(key)
            if number == len(self._first_keys):
                self._first_keys.append(key)
            elif number >= 0:
                self._more_keys.append((key, number))
            elif number == _IGNORED:
                self._ignored_keys.append(key)

    def _stack_number(self, key: int) -> int:
        number = self._site_stack.get(key)
        if number is None:
            number = self._site_stack[key] = self._number_in(self._index, self.trimmed(key))
        return number

    def _number_in(self, index: StackIndex, stack: Stack) -> int:
        if self._ignored(stack):
            return _IGNORED
        if not stack:
            return _NO_FRAME
        return index.add(stack)

    def _site_tree(self, count: int, nbytes: list[int], extra: Callable[[], list[int]]) -> tuple[IndexedTree, Ignored]:
        """The heap tree of `nbytes` per site (sites whose trimmed stacks are equal add up), and what
        --ignore-fn left out of it (`extra` gives the sites' extra bytes). Under the session lock."""
        self._take_sites(count)
        # Mostly one site per stack: a C-speed gather, then the few sites that share a stack.
        per_stack = list(map(nbytes.__getitem__, self._first_keys))
        for key, number in self._more_keys:
            per_stack[number] += nbytes[key]
        ignored = Ignored()
        if self._ignored_keys:
            extras = extra()
            ignored.heap = sum(nbytes[k] for k in self._ignored_keys)
            ignored.extra = sum(extras[k] for k in self._ignored_keys)
        return self._index.tree(per_stack), ignored

    # The trees read byte counts as signed: a count seen below zero by a racy read counts as 0, as in HeapTree.

    def live_tree(self) -> tuple[IndexedTree, Ignored]:
        """The tree of the live bytes now (under the session lock)."""
        if self._page_tree_wanted():
            return self._page_tree(at_peak=False)
        p = self.probes
        n = p.site_count()
        return self._site_tree(
            n, p.site_column("cur_bytes", n, signed=True), lambda: p.site_column("cur_extra", n, signed=True)
        )

    def peak_tree(self, peak_gen: int) -> tuple[IndexedTree, Ignored]:
        """The tree at the global peak numbered `peak_gen` (under the session lock)."""
        if self._page_tree_wanted():
            return self._page_tree(at_peak=True)
        p = self.probes
        n = p.site_count()
        return self._site_tree(
            n,
            p.peak_column("peak_bytes", "cur_bytes", n, peak_gen, signed=True),
            lambda: p.peak_column("peak_extra", "cur_extra", n, peak_gen, signed=True),
        )

    def _page_tree_wanted(self) -> bool:
        return self.opts.pages_as_heap and self.pages is not None

    def _page_tree(self, at_peak: bool) -> tuple[IndexedTree, Ignored]:
        """--pages-as-heap=yes: the tree of the page map's sites (a few mmap/brk call sites, so a loop)."""
        sites = self.read_sites(0)  # the page map keeps its own peak
        self.symbolize_new(list(sites))
        numbers = []
        for key, s in sites.items():
            if s.tot_blocks == 0:
                continue
            number = self._page_stack.get(key)
            if number is None:
                number = self._page_stack[key] = self._number_in(self._page_index, self.trimmed(key))
            numbers.append((number, s.peak_bytes if at_peak else s.cur_bytes))
        per_stack = [0] * self._page_index.n_stacks
        ignored = Ignored()
        for number, nbytes in numbers:
            if number >= 0:
                per_stack[number] += nbytes
            elif number == _IGNORED:
                ignored.heap += nbytes
        return self._page_index.tree(per_stack), ignored

    def _used_site_keys(self) -> list[int]:
        """The sites to symbolize: the page map's with --pages-as-heap=yes, else those with heap calls."""
        if self._page_tree_wanted():
            return list(self.read_sites(0))
        return self.probes.used_sites(self.probes.site_count())

    # ---- reading the kernel -----------------------------------------------------------------------

    def counters(self) -> Counters:
        """The kernel's counters; with --pages-as-heap=yes, the heap figures are the page map's."""
        c = self.probes.counters()
        pages = self.update_pages()
        if pages is None or not self.opts.pages_as_heap:
            return c
        pm = pages.map
        peak_ns = pm.peak_time_ns if pm.peak_time_ns is not None else self.start_ns
        return replace(
            c,
            heap=pm.total,
            extra=0,
            blocks=pm.total // PAGE_SIZE,
            time_b=pages.time_b,
            peak_total=pm.peak_total,
            peak_heap=pm.peak_total,
            peak_extra=0,
            peak_time_b=pages.peak_time_b,
            peak_ns=peak_ns,
            peak_gen=pages.peak_gen,
        )

    def read_sites(self, peak_gen: int) -> dict[int, SiteCounts]:
        """Counters per site (see HeapProbes.sites); with --pages-as-heap=yes, the page map's."""
        if self.opts.pages_as_heap and self.pages is not None:
            with self._pages_lock:
                return self.pages.site_counts()
        return self.probes.sites(peak_gen)

    def update_pages(self) -> PageAccount | None:
        """Apply the page syscalls the kernel has reported since the last call."""
        if self.pages is None:
            return None
        with self._pages_lock:
            self.pages.apply(self.probes.page_events())
        return self.pages

    def prepare_attach(self) -> None:
        """`attach`, before the probes are said to be live: the page map and the unwind tables of the mappings
        of now (`run` does both at the target's exec)."""
        self.seed_pages()
        self.sync_mappings()

    def seed_pages(self) -> None:
        """Start the page map from the target's mappings now: at its exec (run), or at the attach. Events
        already reported are dropped first: the maps read after them hold their effect. An event that lands
        between the two is applied on top, which changes nothing but its site (see agent.model.pages)."""
        if not self.probes.settings.pages or self.pages is not None:
            return
        with self._pages_lock:
            self.probes.page_events()
            try:
                with open(f"{self.proc}/{self.info.pid}/maps") as f:
                    maps_text = f.read()
                with open(f"{self.proc}/{self.info.pid}/stat") as f:
                    start_brk = parse_start_brk(f.read())
            except OSError:  # the target is gone: nothing to seed
                return
            self.pages = PageAccount(PageMap.from_maps(parse_maps_full(maps_text), start_brk=start_brk))

    # ---- sampling ---------------------------------------------------------------------------------

    def take_points(self) -> None:
        """Record the kernel's schedule points sent so far, and steer its schedule (between ticks: when the
        kernel says the series is due to cull)."""
        with self._lock:
            self._take_points()
            self._steer()

    def _take_points(self) -> None:
        if self.points is not None and not self.series.finished:
            self.points.feed(self.probes.schedule_points(), self.stack_bytes)

    def _steer(self, c: Counters | None = None) -> None:
        """Tell the kernel the series' interval and its next culling; after a culling, also when the next point
        is due (the kernel set it with the interval it guessed), if the kernel has sent no point since the last
        feed (else the series is behind it). Between cullings the kernel's due time is already the series'; a
        write then could only race with the kernel moving it on."""
        if self.points is None or self.series.finished:
            return
        k = self.points.kernel_schedule()
        c = c or self.probes.counters()
        due = None
        if self.series.n_cullings != self._steered_cullings and c.sched_points == self.points.n_points:
            due = k.due
            self._steered_cullings = self.series.n_cullings
        if due is not None and self.opts.time_unit != "B":
            due = self.start_ns + due * 1_000_000
        self.probes.set_schedule(k.interval, k.cull_at, due)

    def sample(self) -> None:
        """One tick: record the kernel's schedule points, then what the tick itself adds: the first snapshot, an
        owed tree (see SnapshotSeries.give_tree); with --pages-as-heap=yes, a snapshot if the schedule wants
        one."""
        with self._lock:
            self._take_points()  # before the counters: the tick's state is then no earlier than any point
            c = self.counters()
            if self.opts.stacks:
                self.stack_bytes = self.probes.stack_bytes()
            if self.recorder is not None:
                self.recorder.sample(c, mapped=self.pages.total if self.pages is not None else None)
            t = self.now(c)
            if self.series.finished or (self.series.snapshots and t < self.series.snapshots[-1].time):
                return
            # With the kernel's schedule a tick only takes the first snapshot and pays owed trees.
            kernel_scheduled = self.points is not None and len(self.series) > 0
            built = self._pay_tree(c, t) if kernel_scheduled else self._tick_snapshot(c, t)
            self._steer(c)
        if built:
            # The index's nodes and the symbolized frames are long-lived objects: out of the cyclic collector's
            # sight, its full passes stay short (they stalled HTTP requests for half a second).
            gc.freeze()

    def _tick_snapshot(self, c: Counters, t: int) -> bool:
        """A snapshot of the tick's state if Massif's schedule wants one; True when a tree was built."""
        kind = self.series.next_kind(t)
        if kind is None:
            self.series.add(t, c.heap, c.extra, self.stack_bytes)  # counted as skipped
            return False
        if kind is not SnapshotKind.DETAILED:
            self.series.add(t, c.heap, c.extra, self.stack_bytes)
            self._symbolize_sites(c)
            return False
        # A kept tree shares the index's nodes: its own part is one array of prefix sums.
        tree, ignored = self.live_tree()
        self.series.add(t, c.heap - ignored.heap, c.extra - ignored.extra, self.stack_bytes, tree)
        return True

    def _pay_tree(self, c: Counters, t: int) -> bool:
        """Kernel schedule, at a tick: when the detailed frequency fell on a point, the state now with its tree
        takes the place of the latest point; else new stacks are only symbolized. True when a tree was built.
        Only when the kernel has sent no point since they were read: the state now is then less than an interval
        after the latest point (else the kernel would have sent one), and no point is left behind it."""
        assert self.points is not None
        if not self.series.tree_owed or c.sched_points != self.points.n_points:
            self._symbolize_sites(c)
            return False
        tree, ignored = self.live_tree()
        self.series.give_tree(t, c.heap - ignored.heap, c.extra - ignored.extra, self.stack_bytes, tree)
        return True

    def _symbolize_sites(self, c: Counters) -> None:
        # Stacks are symbolized as they appear, while the target's mappings are readable; the sites are looked
        # at only when the kernel has handed out new site ids since the last look.
        if c.n_sites != self._sites_seen:
            self._sites_seen = c.n_sites
            self.symbolize_new(self._used_site_keys())

    def run(self, alive: Callable[[], bool], stop: threading.Event, interval: float) -> None:
        """Sample every `interval` seconds until the target exits or `stop` is set; between samples, catch up
        at once with the target's exec, loader changes and exit (agent.kernel.probes EV_*)."""
        if not self.exec_limit:
            self.seed_pages()  # attach: the mappings of now; run seeds at the target's exec (_catch_up)
        self.sync_mappings()
        self.sample()
        next_sample = time.monotonic() + interval
        while alive() and not stop.is_set() and not self.exec_ended():
            events = self.probes.wait_events(max(0.001, next_sample - time.monotonic()))
            stopped = self.probes.stopped()
            if EV_SCHEDULE in events or stopped == EV_SCHEDULE:
                self.take_points()  # the series culls: the kernel waits for its new interval
            if any(e != EV_SCHEDULE for e in events) or stopped not in (0, EV_SCHEDULE):
                self._catch_up(events)
            elif stopped == EV_SCHEDULE:
                self.probes.resume()
            if time.monotonic() >= next_sample:
                next_sample += interval
                if alive():
                    self.sync_mappings()
                self.sample()
        self._ended_ns = time.monotonic_ns()  # the final snapshot's time: not after the detach's seconds

    def exec_ended(self) -> bool:
        """The target exec'ed another program: the kernel disarmed the probes and this profile is over."""
        return self.counters().execs > self.exec_limit

    def _catch_up(self, events: Sequence[int] = ()) -> None:
        """New objects mapped, or the target is about to exit: record mappings, load unwind tables,
        symbolize while the mappings are still there; then let a stopped target go on. (A thread's stop for the
        schedule may have taken the place of another's at exit in the stop word: `events` still says it.)"""
        self.sync_mappings()
        stopped = self.probes.stopped()
        if stopped == EV_EXEC:
            self.seed_pages()  # stopped at exec: the kernel's mappings of the new image, before any syscall
        if stopped == EV_EXIT or EV_EXIT in events:
            with self._lock:
                self.symbolize_new(self._used_site_keys())
        if stopped:
            self.probes.resume()

    def sync_mappings(self) -> None:
        """Read the target's mappings; give the stack walk the unwind tables of new executable ones."""
        if not self.maps.refresh():
            return
        self.probes.set_stack_end(self.maps.stack_end)  # where the stack walk's reads must stop
        if self.tables is None:
            return
        published = []
        for m in self.maps.current:
            if "x" not in m.perms:
                continue
            entry = self._unwind_entry(m)
            if entry is not None:
                published.append(entry)
        self.probes.publish_unwind(published)

    def _unwind_entry(self, m: Mapping) -> UnwindMapping | None:
        assert self.tables is not None
        try:
            if m.path not in self._loaded_tables:  # each object's table is read once per session
                started = time.monotonic()
                self._loaded_tables[m.path] = self.tables(m.path)
                self._table_seconds[m.path] = time.monotonic() - started
            table = self._loaded_tables[m.path]
            obj = open_elf(m.path)
        except (OSError, ElfError, ValueError) as exc:
            self.unwind_problems[m.path] = str(exc)
            return None
        vaddr = obj.file_offset_to_vaddr(m.offset)
        if table is None or vaddr is None:
            return None
        key = table.build_id or f"{m.path}:{os.stat(m.path).st_mtime_ns}"
        return UnwindMapping(m.start, m.end, m.start - vaddr, key, table.rows, table.n_rows)

    def finish(self) -> None:
        """The target exited or the profile ends: add the peak and the final state."""
        with self._lock:
            if self.series.finished:
                return
            self._take_points()
            c = self.counters()
            self.end_counters = c
            if self.recorder is not None:  # the timelines end with the final state
                self.recorder.sample(c, mapped=self.pages.total if self.pages is not None else None)
            t_end = max(self.now(c), self.series.snapshots[-1].time if self.series.snapshots else 0)
            if c.peak_total > 0:
                peak_tree, ign = self.peak_tree(c.peak_gen)
                self.series.set_peak(
                    self.peak_time(c), c.peak_heap - ign.heap, c.peak_extra - ign.extra, self.stack_bytes, peak_tree
                )
            tree, ign = self.live_tree()
            self.series.finish(t_end, c.heap - ign.heap, c.extra - ign.extra, self.stack_bytes, tree)

    # ---- output -----------------------------------------------------------------------------------

    def massif_text(self) -> str:
        """The whole massif.out so far (Massif's monitor command all_snapshots)."""
        with self._lock:
            snapshots = self.series.snapshots
        out = io.StringIO()
        write_massif(
            out,
            snapshots,
            desc=self.info.desc,
            cmd=self.info.cmd,
            time_unit=self.opts.time_unit,
            threshold=self.opts.threshold,
        )
        return out.getvalue()

    def xtree_text(self) -> str:
        """The xtree memory report in callgrind format (Massif's monitor command xtmemory)."""
        # Valgrind's xtree drops only the allocation function itself (not in our stacks) and cuts below main;
        # it keeps other alloc-fns and ignores --depth.
        merged = self.merged_sites(massif_trim=False)
        out = io.StringIO()
        write_xtree(
            out,
            merged,
            cmd=self.info.cmd,
            pid=self.info.pid,
            kind="full" if self.opts.xtree_memory == "full" else "allocs",
        )
        return out.getvalue()

    def snapshot_now(self, detailed: bool) -> str:
        """Massif's monitor commands `snapshot` and `detailed_snapshot`: a file with one snapshot, taken now."""
        return render_snapshot(
            self.snapshot_model(detailed),
            desc=self.info.desc,
            cmd=self.info.cmd,
            time_unit=self.opts.time_unit,
            threshold=self.opts.threshold,
        )

    def summary(self) -> list[str]:
        c = self.end_counters or self.counters()
        lines = [
            f"{c.n_allocs} allocations, {c.n_frees} frees, {c.n_reallocs} reallocs; "
            f"peak {c.peak_heap} B useful + {c.peak_extra} B extra; {c.blocks} blocks ({c.heap} B) live at the end"
        ]
        if c.untracked_frees:
            lines.append(f"{c.untracked_frees} frees of blocks allocated before the probes were attached (not counted)")
        if c.failed_allocs:
            lines.append(f"{c.failed_allocs} allocation calls returned NULL")
        if c.dropped:
            lines.append(
                f"NOT COUNTED: {c.dropped_blocks} blocks (block table full), {c.dropped_stacks} stacks "
                f"(stack table full), {c.dropped_sites} sites (site table full), {c.dropped_pending} calls "
                "(thread table full): raise --max-blocks / --max-stacks"
            )
        if c.lost_returns:
            lines.append(f"{c.lost_returns} allocation calls whose return was not seen")
        if self.points is not None:
            st = self.series
            lines.append(
                f"snapshots: {st.n_taken} taken on Massif's schedule ({st.n_peaks_taken} at peaks), "
                f"{st.n_cullings} cullings, {len(st)} kept"
            )
        if c.sched_lost:
            lines.append(
                f"NOT COUNTED: {c.sched_lost} of the snapshot schedule's points (their ring buffer was full): "
                "the graph has fewer snapshots than Massif's"
            )
        if c.walks_interrupted:
            lines.append(
                f"{c.walks_interrupted} stack walks overtaken by another thread's on the same CPU (a preemptible "
                "kernel): their calls are charged to [stack not recorded] (or, at a tail call, not seen)"
            )
        lines.extend(self._page_summary())
        if self.tables is not None:
            lines.append(
                f"unwind: {self.probes.rows_used} table rows ({self.probes.rows_used * 12 // 1024} KiB) for "
                f"{len(self._table_seconds)} objects, built or loaded in {sum(self._table_seconds.values()):.2f} s; "
                f"frames: {c.unwind_frames} by table, {c.unwind_fp} by frame pointer (no table), "
                f"{c.unwind_no_rule} with no rule, {c.unwind_bad_read} bad reads "
                f"({c.unwind_short_reads} runs read again to a page end), {c.unwind_depth_cut} stacks cut "
                "at the depth limit"
            )
            if self.probes.rows_dropped:
                lines.append(f"unwind: {self.probes.rows_dropped} rows did not fit in the kernel table")
            for path, problem in self.unwind_problems.items():
                lines.append(f"unwind: no table for {path}: {problem}")
        return lines

    def page_totals(self) -> PageTotals | None:
        """Mapped memory and its peak, as the page syscalls left them (None before the map is seeded)."""
        pages = self.update_pages()
        if pages is None:
            return None
        return PageTotals(
            mapped=pages.total,
            peak_mapped=pages.map.peak_total,
            syscalls=pages.map.stats.applied,
            dropped=self.probes.page_counters().dropped,
            stacks=self.stack_bytes,
        )

    def _page_summary(self) -> list[str]:
        if self.pages is None:
            return []
        pm, st = self.pages.map, self.pages.map.stats
        kc = self.probes.page_counters()
        lines = [
            f"pages: {st.applied} mmap/munmap/mremap/brk calls applied ({st.failed} failed); mapped "
            f"{pm.total} B at the end, {pm.peak_total} B at the peak"
        ]
        if kc.dropped:
            lines.append(
                f"pages: NOT COUNTED: {kc.lost} syscalls (event buffer full), {kc.calls_full} (thread table "
                "full): the page figures are inexact from there on"
            )
        odd = {
            "bytes unmapped that were not mapped": st.unknown_unmapped_bytes,
            "bytes mapped over others without MAP_FIXED": st.replaced_without_fixed_bytes,
            "brk changes before the break was known": st.brk_unknown_base,
            "invalid calls": st.invalid,
        }
        shown = [f"{n} {what}" for what, n in odd.items() if n]
        if shown:
            lines.append("pages: " + ", ".join(shown))
        return lines

    # ---- read-only views for the daemon (added for the HTTP API) ------------------------------------

    def snapshot_model(self, detailed: bool) -> Snapshot:
        """The snapshot that snapshot_now() renders, as a model object (for the API's JSON form). Its tree
        stays valid: it is read without the lock."""
        with self._lock:
            c = self.counters()
            tree = None
            ign = Ignored()
            if detailed:
                tree, ign = self.live_tree()
            kind = SnapshotKind.DETAILED if detailed else SnapshotKind.NORMAL
            return Snapshot(self.now(c), c.heap - ign.heap, c.extra - ign.extra, self.stack_bytes, tree, kind)

    def snapshot_list(self) -> list[Snapshot]:
        """The snapshots recorded so far, in time order (what massif_text() writes)."""
        with self._lock:
            return list(self.series.snapshots)

    def merged_sites(self, massif_trim: bool) -> dict[Stack, SiteCounts]:
        """Counters per stack, merged over kernel keys whose stacks are equal once trimmed: with Massif's
        trimming (alloc-fns, --depth) when `massif_trim`, else the xtree's (cut below main only)."""
        with self._lock:
            c = self.end_counters or self.counters()
            sites = self.read_sites(c.peak_gen)
            self.symbolize_new(list(sites))
            merged: dict[Stack, SiteCounts] = {}
            for key, s in sites.items():
                stack = self.trimmed(key) if massif_trim else trim_stack(self._frames[key], frozenset(), _XTREE_DEPTH)
                m = merged.setdefault(stack, SiteCounts())
                for name in ("cur_bytes", "cur_blocks", "tot_bytes", "tot_blocks", "freed_bytes", "freed_blocks"):
                    setattr(m, name, getattr(m, name) + getattr(s, name))
            return merged
