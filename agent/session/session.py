"""A profiling session: turns the kernel's counters into Massif snapshots.

The kernel aggregates (agent.kernel.probes); this module samples it on a schedule and keeps the snapshot series
(agent.model.snapshot) that the exporters write. Its parts: the sites and their trees (agent.session.sites), the
target's mappings (agent.process.maps), the unwind tables handed to the stack walk (agent.session.tables) and the
page map (agent.model.pages). It does not know how the target was started: the pipeline hands it a probe set
and a way to tell whether the target still runs.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from agent.kernel.abi import EV_EXEC, EV_EXIT, EV_PAGES, EV_SCHEDULE, EV_SITES, EV_SNAP_LOG, SCHED_PEAK
from agent.kernel.interface import LiveProbes, SiteReader
from agent.model.counters import Counters
from agent.model.maps import parse_maps_full
from agent.model.options import MassifOptions
from agent.model.pages import (
    PAGE_SIZE,
    PRE_EXISTING_EXEC_LABEL,
    PRE_EXISTING_LABEL,
    FoldedPages,
    PageAccount,
    PageMap,
    PageTotals,
    parse_start_brk,
)
from agent.model.pageschedule import PageSchedule
from agent.model.schedule import PointFeed, SiteLog, SiteValues
from agent.model.snapshot import Snapshot, SnapshotKind, SnapshotSeries
from agent.model.stack import Frame, SiteCounts, Stack
from agent.model.summary import PageSummary, ProfileSummary, ScheduleSummary
from agent.model.tree import HEAP_ROOT_LABEL, PAGES_ROOT_LABEL, IndexedTree
from agent.process.maps import MapsRecorder
from agent.process.procinfo import ResidentReader
from agent.session.sites import Ignored, SiteTrees
from agent.session.storerec import StoreColumns
from agent.session.tables import UnwindTables
from agent.store.format import COUNTER_FIELDS
from agent.symbols.symbolizer import Symbolizer

if TYPE_CHECKING:
    from agent.model.malt import MaltProfile
    from agent.process.discovery import ProbePoint
    from agent.symbols.unwind import UnwindTable


# The live counter a site's peak counter falls back to (SiteReader.peak_column).
_PEAK_OF = {"peak_bytes": "cur_bytes", "peak_extra": "cur_extra"}


class Recorder(Protocol):
    """What the session asks of MALT's recorder (agent.session.maltrec): a sample at each tick, the profile
    when asked, and to build the end's profile from the probes' copy."""

    def sample(self, c: Counters, mapped: int | None = None) -> None: ...

    def build(self, session: Session, c: Counters, probe_points: Sequence[ProbePoint], allocator: str) -> MaltProfile:
        ...

    def end(self, session: Session, tables: SiteReader) -> None: ...


_NO_COUNTERS = Counters()  # for `now` where the unit is the clock


@dataclass
class SessionInfo:
    pid: int
    cmd: str  # the target's command line, for the files' cmd: lines
    desc: Sequence[str]  # the Massif options as the user gave them, for desc:
    allocator: str  # one line: which allocator was found


class IdlePace:
    """How long a sampling loop waits between looks at its target. A target that did nothing since the last look
    is looked at as often as the sampling interval for the first few quiet ticks, then twice as long after each
    further one, up to IDLE_MAX seconds. A light one (fewer than LIGHT_RATE allocator calls a second) the same,
    up to LIGHT_MAX: a look costs the daemon the same whatever it finds, the kernel counts every call whenever
    it looks, and a fleet's services spend most of their time making a few calls a second. A busy target brings
    the loop back to its interval. `light_rate`: the calls a second from which a target is busy; sampled mode has
    none, and paces every target as SAMPLED does (IdlePace.sampled)."""

    IDLE_MAX = 1.0
    LIGHT_MAX = 0.2  # a light target's memory line keeps five points a second
    LIGHT_RATE = 1000.0  # calls a second
    QUIET_TICKS = 4  # quiet (or light) ticks at the full rate before the waits grow
    # Sampled mode: once a second from the first look. A look costs the daemon 2-3 ms whatever it finds (the
    # counters, the schedule's points, MALT's timelines, the history store, the maps), and a prefork server's
    # replaced workers make most of its looks: under ab, apache2's workers live about three seconds, and a look a
    # quarter and three quarters of a second into each life cost 8-10% of the daemon's CPU for them
    # (bench/worker_cost.py) with nothing to show for it. The kernel keeps each interval's peak and sums the samples
    # between looks: the snapshots and MALT's figures lose nothing; the memory line keeps one point a second, and an
    # ended process's last state is read at its exit whenever it comes.
    SAMPLED_WAIT = 1.0

    def __init__(self, interval: float, light_rate: float = LIGHT_RATE, light_max: float = LIGHT_MAX,
                 quiet_ticks: int = QUIET_TICKS) -> None:
        self.interval = interval
        self.light_rate = light_rate
        self.light_max = light_max
        self.quiet_ticks = quiet_ticks
        self.idle_ticks = 0
        self.light_ticks = 0

    @classmethod
    def sampled(cls, interval: float, at_most: float = math.inf) -> IdlePace:
        """Sampled mode's pace: no target is busy, and every wait is SAMPLED_WAIT (a longer interval is kept), but
        never past `at_most` (the history's --store-interval: each of its samples is a look). Every look counts as
        paced (no quiet ticks): the next one is timed from it."""
        wait = min(cls.SAMPLED_WAIT, at_most)
        return cls(max(interval, wait), math.inf, wait, quiet_ticks=0)

    def idle(self) -> float:
        """Another quiet tick: the wait until the next look."""
        self.idle_ticks += 1
        return self._grown(self.idle_ticks, self.IDLE_MAX)

    def active(self, calls: int = 0, seconds: float = 0.0) -> float:
        """A look that found `calls` allocator calls made in the `seconds` since the one before: the wait until
        the next look."""
        self.idle_ticks = 0
        if seconds > 0 and calls < self.light_rate * seconds:
            self.light_ticks += 1
            return self._grown(self.light_ticks, self.light_max)
        self.light_ticks = 0
        return self.interval

    def paced(self) -> bool:
        """Whether the last wait was longer than the interval (the next look is then timed from now)."""
        return self.idle_ticks > self.quiet_ticks or self.light_ticks > self.quiet_ticks

    def _grown(self, ticks: int, cap: float) -> float:
        doublings = max(0, ticks - self.quiet_ticks)
        return min(max(cap, self.interval), self.interval * (1 << min(doublings, 20)))


# One look at a time in the whole process. Sampled mode times every target's looks on one grid (on_grid), so a
# fleet's looks fall due together and run back to back, each in the caches the one before warmed, none fighting
# another for the interpreter's lock: with forty apache2 workers a look and its stored sample cost 10-15% less
# (docs/benchmarks.md). Only the looks are inside it: a target's events are caught up at once by its own thread.
LOOKS = threading.Lock()


def on_grid(due: float, now: float, step: float) -> float:
    """`due` moved to the nearest multiple of `step` on the monotonic clock, but after `now`: looks timed this
    way by every target's thread fall due at the same instants."""
    at = round(due / step) * step
    return at if at > now else at + step * math.ceil((now - at) / step + 1e-9)


def _code_news(live: LiveProbes) -> int | None:
    """A count that moves when code may have been mapped since it was read: the traced page calls' that can map code;
    untraced (sampled mode), the frames the walks met outside every published table (the loader's mappings come as
    events). None: nothing says, the maps are read at every look."""
    calls = live.mapping_calls()
    return calls if calls is not None else live.code_outside()


class Session:
    """Sample, symbolize and record one target's heap."""

    def __init__(
        self,
        opts: MassifOptions,
        probes: LiveProbes,
        info: SessionInfo,
        symbolizer: Symbolizer | None = None,
        proc: str = "/proc",
        tables: Callable[[str], UnwindTable | None] | None = None,
        exec_limit: int = 0,
    ) -> None:
        self.opts = opts
        self.live: LiveProbes | None = probes  # None once the profile has ended (freeze)
        self.probes: SiteReader = probes  # what the counters are read from: the live maps, then their copy
        self.info = info
        self.proc = proc
        self.maps = MapsRecorder(info.pid, proc)
        self._published_maps = 0  # the maps' version whose unwind tables the kernel has (sync_mappings)
        self.tables = UnwindTables(tables) if tables is not None else None  # None: frame-pointer stacks
        self.exec_limit = exec_limit  # execs the target may make (run: its first one) before the profile ends
        # The mappings the page map starts with: made by the kernel at exec (run) or before the attach.
        pre_existing = PRE_EXISTING_EXEC_LABEL if exec_limit else PRE_EXISTING_LABEL
        # --pages-as-heap=yes: the tree is of pages, by the stack of the syscall that mapped them
        root_label = PAGES_ROOT_LABEL if opts.pages_as_heap else HEAP_ROOT_LABEL
        self.symbolizer = symbolizer or Symbolizer()
        self.sites = SiteTrees(opts, self.maps, self.symbolizer, root_label, Frame(address=0, function=pre_existing))
        self.recorder: Recorder | None = None  # MALT's timelines, when a MALT profile is wanted
        # Called while a `run` target is held at its exit(): the last moment its memory can be read.
        self.before_exit: Callable[[], None] | None = None
        self.series = SnapshotSeries(detailed_freq=opts.detailed_freq, max_snapshots=opts.max_snapshots)
        self.start_ns = time.monotonic_ns()  # the same clock as bpf_ktime_get_ns
        self._created_ns = self.start_ns  # start_ns is the earlier profile's when this one continues it
        self.time_offset_b = 0  # --time-unit=B: where this session's clock starts (a profile continued)
        self._ended_ns: int | None = None  # when run() stopped sampling
        self.end_counters: Counters | None = None
        self._end_ignored: tuple[Ignored, Ignored] | None = None  # --ignore-fn: left out at the peak, at the end
        self.final: Snapshot | None = None  # the state at the end, with its tree (finish)
        self._sites_seen = 0  # the kernel's n_sites when the sites were last symbolized
        self._sites_frozen = -1  # the kernel's n_sites when the long-lived objects were last frozen (gc.freeze)
        # The page map, when the probes trace page syscalls; sampled mode's: its mapped total (FoldedPages).
        self.pages: PageAccount | FoldedPages | None = None
        self._statm: ResidentReader | None = None  # sampled mode without the page calls: the mapped total's source
        self._pages_lock = threading.Lock()
        self.stack_bytes = 0  # --stacks=yes: all threads' stacks at the last sample
        self.calls_seen = 0  # the allocator calls the kernel had counted at the last sample
        self._lock = threading.Lock()  # readers (HTTP) and the sampler share the model
        # Snapshots on Massif's schedule: the kernel sends a point at each event that reaches the next due time
        # (agent.model.schedule). With --pages-as-heap=yes the heap is the page map's, and the ticks sample it.
        self.points: PointFeed | None = None
        self._steered_cullings = 0  # the series' cullings when the kernel was last given a due time
        # The kernel's snapshot log, read so far, and what became of the trees it was read for.
        self.log = SiteLog()
        self._log_lost = 0  # the kernel's snap_lost when last read
        self._lost_before = 0  # the points numbered below this may miss records the log lost
        self.trees_at_instant = 0  # detailed and peak snapshots given the tree of their own instant
        self.trees_missed = 0  # of which the log had lost records: a later tick's tree, or none
        if not opts.pages_as_heap:
            self.points = PointFeed(self.series, self._point_time, peak_kind=SCHED_PEAK)
            probes.start_schedule(self.start_ns, opts.max_snapshots, opts.peak_inaccuracy)

    # ---- time -------------------------------------------------------------------------------------

    def now(self, c: Counters, read_ns: int | None = None) -> int:
        """The current time in the session's unit (once sampling has ended, the time it ended); `read_ns`: the
        clock just before `c` was read, which its state is no earlier than."""
        if self.opts.time_unit == "B":
            return c.time_b + self.time_offset_b
        if self._ended_ns is not None:
            now_ns = self._ended_ns
        else:
            now_ns = read_ns if read_ns is not None else time.monotonic_ns()
        return (now_ns - self.start_ns) // 1_000_000

    def time_now(self) -> int:
        """`now` without a tick's counters: read only when the time unit is bytes (milliseconds need the clock
        alone, and the memory line asks at every tick)."""
        return self.now(self.counters() if self.opts.time_unit == "B" else _NO_COUNTERS)

    def _point_time(self, raw: int) -> int:
        """A schedule point's time in the session's unit (the kernel gives ns for ms)."""
        if self.opts.time_unit == "B":
            return raw
        return max(0, (raw - self.start_ns) // 1_000_000)

    def peak_time(self, c: Counters) -> int:
        if self.opts.time_unit == "B":
            return c.peak_time_b + self.time_offset_b
        return max(0, (c.peak_ns - self.start_ns) // 1_000_000)

    # ---- stacks -----------------------------------------------------------------------------------

    def malt_profile(self, points: Sequence[ProbePoint], allocator: str) -> MaltProfile:
        """MALT's profile of the state now (the final state once finished). Needs the recorder."""
        assert self.recorder is not None
        with self._lock:  # the sampler adds to the recorder's timelines and symbolizes under it too
            return self.recorder.build(self, self.end_counters or self.counters(), points, allocator)

    def symbolize_new(self, keys: Sequence[int]) -> None:
        """Symbolize stacks not seen before, while the target's mappings are still readable."""
        self.sites.symbolize_new(self.probes, keys)

    def frames_of(self, key: int) -> list[Frame]:
        """The symbolized raw stack of a site (symbolize_new first)."""
        return self.sites.frames_of(key)

    def live_tree(self) -> tuple[IndexedTree, Ignored]:
        """The tree of the live bytes now (under the session lock)."""
        if self._page_tree_wanted():
            return self.sites.page_tree(self.probes, self.read_sites(0), at_peak=False)
        return self.sites.live_tree(self.probes)

    def peak_tree(self, peak_gen: int) -> tuple[IndexedTree, Ignored]:
        """The tree at the global peak numbered `peak_gen` (under the session lock)."""
        if self._page_tree_wanted():  # the page map keeps its own peak
            return self.sites.page_tree(self.probes, self.read_sites(0), at_peak=True)
        return self.sites.peak_tree(self.probes, peak_gen)

    def _page_tree_wanted(self) -> bool:
        return self.opts.pages_as_heap and self.pages is not None

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
        if not isinstance(pages, PageAccount) or not self.opts.pages_as_heap:
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
        """Counters per site (see SiteReader.sites); with --pages-as-heap=yes, the page map's."""
        if self.opts.pages_as_heap and isinstance(self.pages, PageAccount):
            with self._pages_lock:
                return self.pages.site_counts()
        return self.probes.sites(peak_gen)

    def update_pages(self, statm_mapped: int | None = None) -> PageAccount | FoldedPages | None:
        """Apply the page syscalls the kernel has reported since the last call (sampled mode: and its total).
        `statm_mapped`: statm's mapped bytes the caller has just read (sampled mode without the page calls; 0: the
        read failed), not read again here."""
        if self.pages is None:
            return None
        if self.live is not None:
            with self._pages_lock:
                self.pages.apply(self.live.page_events())
                if isinstance(self.pages, FoldedPages):
                    self.pages.fold(self._mapped_now(statm_mapped), time.monotonic_ns())
        return self.pages

    @property
    def traces_page_calls(self) -> bool:
        """Whether the kernel follows the target's page syscalls (sampled mode: --page-calls=yes)."""
        return self.probes.settings.pages

    def _mapped_now(self, statm_mapped: int | None = None) -> tuple[int, int] | None:
        """Sampled mode's mapped bytes now and the most since the last look: the kernel's fold of the page calls
        (--page-calls=yes), else statm's figure now for both, `statm_mapped` if the caller read it (None: unchanged,
        or the target is gone)."""
        assert self.live is not None
        if self._statm is None:
            return self.live.mapped_fold()
        if statm_mapped is None:
            sizes = self._statm.sizes()
            statm_mapped = sizes[1] if sizes is not None else 0
        if not statm_mapped:  # gone, or its memory already given back at its exit (statm reads 0)
            return None
        return statm_mapped, statm_mapped

    def prepare_attach(self) -> None:
        """`attach`, before the probes are said to be live: the page map and the unwind tables of the mappings
        of now (`run` does both at the target's exec)."""
        self.seed_pages()
        self.sync_mappings()

    def seed_pages(self) -> None:
        """Start the page map from the target's mappings now: at its exec (run), or at the attach. Events
        already reported are dropped first: the maps read after them hold their effect. An event that lands
        between the two is applied on top, which changes nothing but its site (see agent.model.pages)."""
        live = self.live
        if live is None or not (live.settings.pages or live.settings.sampled) or self.pages is not None:
            return
        settings = live.settings
        with self._pages_lock:
            live.page_events()
            if settings.sampled:
                # The kernel's own total (total_vm, statm's first figure), which its page calls fold from here on
                # (no map to build); or, with the page calls untraced, statm's figure at each look.
                statm = ResidentReader(self.info.pid, self.proc)
                sizes = statm.sizes()
                if settings.pages:
                    statm.close()
                else:
                    self._statm = statm
                if sizes is not None:  # else the target is gone: nothing to seed
                    self.pages = FoldedPages(sizes[1], settings.sample_rate)
                return
            try:
                with open(f"{self.proc}/{self.info.pid}/maps") as f:
                    maps_text = f.read()
                with open(f"{self.proc}/{self.info.pid}/stat") as f:
                    start_brk = parse_start_brk(f.read())
            except OSError:  # the target is gone: nothing to seed
                return
            massif = self.opts.pages_as_heap  # the profile is of pages: Massif's own counting of them
            pm = PageMap.from_maps(parse_maps_full(maps_text), start_brk=start_brk, massif=massif)
            self.pages = PageAccount(pm)
            if massif:
                # Massif's snapshots at the events, its clock counting the mappings there at the start as its
                # startup records; the first snapshot is their state.
                b_unit = self.opts.time_unit == "B"
                schedule = PageSchedule(
                    self.series, self.opts.peak_inaccuracy, lambda b, ns: b if b_unit else self._point_time(ns)
                )
                self.pages.schedule = schedule
                self.pages.time_b = self.pages.peak_time_b = pm.total
                schedule.after(pm.total, time.monotonic_ns(), pm.total, pm.live_by_site)

    # ---- sampling ---------------------------------------------------------------------------------

    def take_points(self) -> None:
        """Record the kernel's schedule points sent so far, and steer its schedule (between ticks: when the
        kernel says the series is due to cull)."""
        with self._lock:
            self._take_points()
            self._steer()

    def _take_points(self) -> None:
        """Record the points sent so far, and give each detailed one (and each peak) the tree of its instant."""
        if self.points is not None and self.live is not None and not self.series.finished:
            self.points.feed(self.live.schedule_points(), self.stack_bytes)
            self._give_trees()

    def take_log(self) -> None:
        """Read the kernel's snapshot log into memory (its ring is half full), keeping only what points still to
        be read can need."""
        with self._lock:
            if self.live is not None:
                self.log.add(self.live.snapshot_log())
                if self.points is not None:
                    self.log.forget(self.points.next_epoch)

    def _give_trees(self) -> None:
        """The trees owed to the points just recorded, each rebuilt at its point's instant from the sites read now
        and the snapshot log read after them (agent.model.schedule.SiteLog). Should the log have lost records
        meanwhile, the trees cannot be had: the latest point takes the state now with its tree instead, as a
        tick's sample would, and the others stay without one (counted)."""
        assert self.points is not None and self.live is not None
        owed = self.points.take_owed()
        if not owed:  # most ticks: the log stays in its ring (the kernel wakes us at half full: take_log)
            return
        p = self.probes
        n = p.site_count()
        now = SiteValues(
            p.site_column("cur_bytes", n, signed=True),
            p.site_column("cur_extra", n, signed=True),
            p.site_column("tot_blocks", n),
        )
        self.log.add(self.live.snapshot_log())  # after the sites: every change they show has its record
        c = p.counters()
        if c.snap_lost != self._log_lost:  # a record lost now is of a change after a point numbered below this
            self._log_lost, self._lost_before = c.snap_lost, c.sched_points
        missed = [snap for snap, epoch in owed if epoch < self._lost_before]
        if missed:
            self._miss_trees(missed)
            owed = [(snap, epoch) for snap, epoch in owed if epoch >= self._lost_before]
        if owed:
            values = self.log.values_at([epoch for _, epoch in owed], now)
            for snap, epoch in owed:
                at = values[epoch]
                tree, ign = self.sites.site_tree(p, n, at.bytes, at.extra.copy, allocated=at.allocs)
                self.series.give_tree(snap, tree, ign.heap, ign.extra)
            self.trees_at_instant += len(owed)
        self.log.forget(self.points.next_epoch)

    def _miss_trees(self, snaps: Sequence[Snapshot]) -> None:
        c = self.counters()
        tree, ign = self.live_tree()
        t = max(self.now(c), self.series.latest_time or 0)
        for snap in snaps:
            self.series.tree_missed(snap, t, c.heap - ign.heap, c.extra - ign.extra, self.stack_bytes, tree)
        self.trees_missed += len(snaps)

    def _steer(self, c: Counters | None = None) -> None:
        """Tell the kernel the series' interval and its next culling; after a culling, also when the next point
        is due (the kernel set it with the interval it guessed), if the kernel has sent no point since the last
        feed (else the series is behind it). Between cullings the kernel's due time is already the series'; a
        write then could only race with the kernel moving it on."""
        if self.points is None or self.live is None or self.series.finished:
            return
        k = self.points.kernel_schedule()
        c = c or self.probes.counters()
        due = None
        if self.series.n_cullings != self._steered_cullings and c.sched_points == self.points.n_points:
            due = k.due
            self._steered_cullings = self.series.n_cullings
        if due is not None and self.opts.time_unit != "B":
            due = self.start_ns + due * 1_000_000
        self.live.set_schedule(k.interval, k.cull_at, due)

    def sample(self) -> None:
        """One tick: record the kernel's schedule points (and their trees), then what the tick itself adds: the
        first snapshot; with --pages-as-heap=yes, a snapshot if the schedule wants one."""
        with self._lock:
            # The stacks' deepest since the last tick, when the points read now were sent.
            if self.opts.stacks and self.live is not None:
                self.stack_bytes = self.live.stack_bytes()
            self._take_points()  # before the counters: the tick's state is then no earlier than any point
            # The tick's time is the clock before the counters are read, not after the work below: a point sent
            # meanwhile is then later than the tick (and not counted in c).
            read_ns = time.monotonic_ns()
            c = self.counters()
            self.calls_seen = c.n_allocs + c.n_frees
            if self.recorder is not None:
                self.recorder.sample(c, mapped=self.pages.total if self.pages is not None else None)
            t = self.now(c, read_ns)
            if self.series.finished or (self.series.snapshots and t < self.series.snapshots[-1].time):
                return
            # With the kernel's schedule a tick only takes the first snapshot; with the page events' (or before
            # the page map is seeded at the exec), not even that.
            if (
                (self.points is not None and len(self.series) > 0)
                or self._page_scheduled()
                or (self.opts.pages_as_heap and self.pages is None)
            ):
                self._give_page_trees()
                built = False
                self._symbolize_sites(c)
            else:
                built = self._tick_snapshot(c, t)
            self._steer(c)
            new_sites = built and c.n_sites != self._sites_frozen
            if new_sites:
                self._sites_frozen = c.n_sites
        if new_sites:
            # The index's nodes and the symbolized frames are long-lived objects: out of the cyclic collector's
            # sight, its full passes stay short (they stalled HTTP requests for half a second). What is garbage
            # now goes first: frozen, a reference cycle would never be freed (the HTTP threads' of the moment
            # too), and only when there is something new to freeze. The collection walks only the objects made
            # since the last freeze.
            gc.collect()
            gc.freeze()

    def _first_snapshot(self) -> None:
        """Massif's first snapshot, at time 0 with nothing allocated yet: on the kernel's schedule, taken before
        any point is read (an attached target may call the allocator before the first tick)."""
        with self._lock:
            if self.points is None or len(self.series) or self.series.finished:
                return
            t = self.now(Counters(), read_ns=self._created_ns)
            tree = None
            if self.series.next_kind(t) is SnapshotKind.DETAILED:
                n = self.probes.site_count()
                tree, _ = self.sites.site_tree(self.probes, n, [0] * n, lambda: [0] * n, allocated=[0] * n)
            self.series.add(t, 0, 0, self.stack_bytes, tree)

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

    def _symbolize_sites(self, c: Counters) -> None:
        # Stacks are symbolized as they appear, while the target's mappings are readable; the sites are looked
        # at only when the kernel has handed out new site ids since the last look.
        if c.n_sites != self._sites_seen:
            self._sites_seen = c.n_sites
            self.symbolize_new(self._used_site_keys())

    def run(self, alive: Callable[[], bool], stop: threading.Event, interval: float,
            busy_at_most: float = math.inf) -> None:
        """Sample every `interval` seconds until the target exits or `stop` is set; between samples, catch up
        at once with the target's exec, loader changes and exit (agent.kernel.abi EV_*). Sampled mode looks at a
        busy target at least every `busy_at_most` seconds (IdlePace.sampled)."""
        live = self.live
        assert live is not None, "the session has ended"
        if not self.exec_limit:
            self.seed_pages()  # attach: the mappings of now; run seeds at the target's exec (_catch_up)
        code_at = _code_news(live)  # before the maps are read: a mapping made meanwhile moves it again
        self.sync_mappings()
        token = live.activity()  # before the first look: calls made while it reads are seen at the next tick
        self._first_snapshot()
        self.sample()
        # Sampled mode: a busy target is looked at as a light one, down to once a second. The kernel sums its
        # samples whenever it looks, and what a look reads (the schedule's points, the memory line, MALT's timelines;
        # the kernel keeps each interval's peak) needs no more. Under pgbench, heapscope took 15% of a core for
        # postgres at 20 looks a second a target, 8-12% at 5. Its pace's interval is its own (IdlePace.sampled).
        sampled = live.settings.sampled
        pace = IdlePace.sampled(interval, busy_at_most) if sampled else IdlePace(interval)
        interval = pace.interval
        looked_at, calls_seen = time.monotonic(), self.calls_seen
        next_sample = looked_at + interval
        if sampled:
            next_sample = on_grid(next_sample, looked_at, interval)
        going = alive()
        while going and not stop.is_set() and not self.exec_ended():
            events = live.wait_events(max(0.001, next_sample - time.monotonic()))
            stopped = live.stopped()
            if EV_SCHEDULE in events or stopped == EV_SCHEDULE:
                self.take_points()  # the series culls: the kernel waits for its new interval
            if EV_PAGES in events or stopped:
                # the page events' ring is a quarter full; or the target waits (`run`: from 3/4 full, the kernel stops
                # it; its stop word may name another reason since): drain before it goes on
                self.update_pages()
            if EV_SNAP_LOG in events:
                self.take_log()  # so is the snapshot log's
            if EV_SITES in events or stopped:
                # --ignore-fn: a call from a new stack waits for its site's flag (its stop word may name another
                # reason since); the target goes on below
                self.flag_sites()
            if any(e not in (EV_SCHEDULE, EV_PAGES, EV_SNAP_LOG) for e in events) or stopped not in (0, EV_SCHEDULE):
                self._catch_up(live, events)
            elif stopped == EV_SCHEDULE:
                live.resume()
            now = time.monotonic()
            if now < next_sample:
                going = alive()
                continue
            # The look, and what `alive` records after it (the memory line, the history), one target at a time for
            # the whole process (LOOKS).
            with LOOKS:
                now = time.monotonic()  # after the looks of the targets before
                # A target that did nothing since the last tick is not sampled (Massif takes no snapshot
                # without an allocation either), and it is looked at less and less often, down to IDLE_MAX;
                # a light one down to LIGHT_MAX, and in sampled mode any one at SAMPLED_WAIT (IdlePace).
                last, token = token, live.activity()
                if token == last and not events:
                    next_sample = now + pace.idle()
                else:
                    was_paced = pace.idle_ticks > 0 or pace.paced()
                    code = _code_news(live)
                    if (code is None or code != code_at) and alive():
                        code_at = code
                        self.sync_mappings()
                    self.sample()
                    self.flag_sites()
                    wait = pace.active(self.calls_seen - calls_seen, now - looked_at)
                    looked_at, calls_seen = now, self.calls_seen
                    # At the interval the looks keep their cadence; a paced look counts from now.
                    next_sample = next_sample + interval if not (was_paced or pace.paced()) else now + wait
                if sampled:
                    next_sample = on_grid(next_sample, now, interval)
                going = alive()
        self._ended_ns = time.monotonic_ns()  # the final snapshot's time: not after the detach's seconds

    def exec_ended(self) -> bool:
        """The target exec'ed another program: the kernel disarmed the probes and this profile is over."""
        return self.probes.counters().execs > self.exec_limit  # the kernel's count: no page map to bring up to date

    def _catch_up(self, live: LiveProbes, events: Sequence[int] = ()) -> None:
        """New objects mapped, or the target is about to exit: record mappings, load unwind tables,
        symbolize while the mappings are still there; then let a stopped target go on. (A thread's stop for the
        schedule may have taken the place of another's at exit in the stop word: `events` still says it.)"""
        self.sync_mappings()
        stopped = live.stopped()
        if stopped == EV_EXEC:
            self.seed_pages()  # stopped at exec: the kernel's mappings of the new image, before any syscall
        if stopped == EV_EXIT or EV_EXIT in events:
            with self._lock:
                self.symbolize_new(self._used_site_keys())
            if self.before_exit is not None:
                self.before_exit()
        if stopped:
            live.resume()

    def sync_mappings(self) -> None:
        """Read the target's mappings; give the stack walk the unwind tables of new executable ones. By the maps'
        version, not by what this read found: the symbolizer reads them too, when a stack's address is in none it
        knows, and a mapping it found first was never published (its frames walked by frame pointers for good)."""
        if self.live is None:
            return
        self.maps.refresh()
        if self.maps.version == self._published_maps:
            return
        self._published_maps = self.maps.version
        self.live.set_stack_end(self.maps.stack_end)  # where the stack walk's reads must stop
        if self.tables is not None:
            self.live.publish_unwind(self.tables.entries(self.maps.current))

    def finish(self) -> None:
        """The target exited or the profile ends. On the kernel's schedule the series ends as Massif's does, at its
        last snapshot (Massif adds none at exit, nor an exact peak); sampled at ticks, the exact peak and the final
        state are added. Either way the final state, with its tree, is kept (`final`: the monitor commands'
        snapshot of an ended profile, the summary's end)."""
        self.maps.hold_files()  # what is still to be symbolized and written, read through its root held open
        with self._lock:
            if self.series.finished:
                return
            self._take_points()
            c = self.counters()
            self.end_counters = c
            if self.recorder is not None:  # the timelines end with the final state
                self.recorder.sample(c, mapped=self.pages.total if self.pages is not None else None)
            self._give_page_trees()
            # No earlier than any snapshot: the peak just set, or a tick's later state, may be after the clock
            # stopped (a sampled target allocates on until its sampler is disarmed).
            if self.points is None and c.peak_total > 0 and not self._page_scheduled():
                peak_tree, ign = self.peak_tree(c.peak_gen)
                self.series.set_peak(
                    self.peak_time(c), c.peak_heap - ign.heap, c.peak_extra - ign.extra, self.stack_bytes, peak_tree
                )
            t_end = max(self.now(c), self.series.latest_time or 0)
            tree, ign = self.live_tree()
            self.final = Snapshot(
                t_end, c.heap - ign.heap, c.extra - ign.extra, self.stack_bytes, tree, SnapshotKind.DETAILED
            )
            if self.points is None and not self._page_scheduled():
                self.series.finish(t_end, c.heap - ign.heap, c.extra - ign.extra, self.stack_bytes, tree)
            else:
                self.series.close()
            if self.opts.ignore_fns:  # the summary leaves them out too
                peak_ign = self.peak_tree(c.peak_gen)[1] if c.peak_total > 0 else Ignored()
                self._end_ignored = (peak_ign, ign)

    def freeze(self, copy: SiteReader) -> None:
        """The probes are about to be unloaded: read `copy` of their maps from now on (and MALT's final profile
        from it, when first asked)."""
        with self._lock:
            if self.recorder is not None:
                self.recorder.end(self, copy)
            self.probes = copy
            self.live = None
        if self._statm is not None:
            self._statm.close()

    # ---- what the profile says --------------------------------------------------------------------

    def _page_scheduled(self) -> bool:
        """--pages-as-heap=yes: the page events take Massif's snapshots (agent.model.pageschedule)."""
        return isinstance(self.pages, PageAccount) and self.pages.schedule is not None

    def _give_page_trees(self) -> None:
        """--pages-as-heap=yes: the trees of the snapshots the page events took, each of its own instant (under the
        session lock)."""
        if not isinstance(self.pages, PageAccount) or self.pages.schedule is None:
            return
        with self._pages_lock:
            owed = self.pages.schedule.take_owed()
        for snap, live in owed:
            sites = {site: SiteCounts(cur_bytes=b, tot_blocks=1) for site, b in live.items()}
            tree, ign = self.sites.page_tree(self.probes, sites, at_peak=False)
            with self._pages_lock:
                self.series.give_tree(snap, tree, ign.heap)

    def flag_sites(self) -> None:
        """--ignore-fn: tell the kernel which of the new sites are ignored (their blocks, and reallocs of them,
        are not counted: probes/heap.bpf.c record_alloc, record_realloc)."""
        if self.live is None or not self.live.settings.ignore:
            return
        with self._lock:
            flags = self.sites.new_flags(self.probes)
        self.live.set_site_flags(flags)

    def summary(self) -> ProfileSummary:
        c = self.end_counters or self.counters()
        if self._end_ignored is not None:  # the profile's figures: --ignore-fn's blocks left out
            at_peak, at_end = self._end_ignored
            c = replace(
                c,
                heap=c.heap - at_end.heap,
                extra=c.extra - at_end.extra,
                blocks=c.blocks - at_end.blocks,
                peak_heap=c.peak_heap - at_peak.heap,
                peak_extra=c.peak_extra - at_peak.extra,
                peak_total=c.peak_total - at_peak.heap - at_peak.extra,
            )
        pages = None
        if self.pages is not None:
            pm = self.pages
            pages = PageSummary(pm.stats, pm.total, pm.peak_total, self.probes.page_counters(), self.traces_page_calls)
        unwind = None
        if self.tables is not None:
            unwind = self.tables.summary(self.probes.rows_used, self.probes.rows_dropped, self.probes.rows_shared)
        schedule = None
        if self.points is not None:
            st = self.series
            schedule = ScheduleSummary(
                st.n_taken, st.n_peaks_taken, st.n_cullings, len(st), self.points.n_late, self.trees_at_instant,
                self.trees_missed,
            )
        return ProfileSummary(c, pages, unwind, schedule)

    def page_totals(self) -> PageTotals | None:
        """Mapped memory and its peak, as the page syscalls left them (None before the map is seeded)."""
        pages = self.update_pages()
        if pages is None:
            return None
        counted = self.probes.page_counters()
        return PageTotals(
            mapped=pages.total,
            peak_mapped=pages.peak_total,
            syscalls=pages.stats.applied,
            dropped=counted.dropped,
            stacks=self.stack_bytes,
            brk_folded=counted.brk_folded,
            unsampled=counted.unsampled,
            traced=self.traces_page_calls,
        )

    def snapshot_model(self, detailed: bool) -> Snapshot:
        """A snapshot taken now (Massif's monitor commands `snapshot` and `detailed_snapshot`); once the profile
        has ended, its final state. Its tree stays valid: it is read without the lock."""
        with self._lock:
            if self.final is not None:
                last = self.final
                if detailed:
                    return last
                return Snapshot(last.time, last.heap_B, last.heap_extra_B, last.stacks_B, None, SnapshotKind.NORMAL)
            c = self.counters()
            tree = None
            ign = Ignored()
            if detailed:
                tree, ign = self.live_tree()
            kind = SnapshotKind.DETAILED if detailed else SnapshotKind.NORMAL
            return Snapshot(self.now(c), c.heap - ign.heap, c.extra - ign.extra, self.stack_bytes, tree, kind)

    def snapshot_list(self) -> list[Snapshot]:
        """The snapshots recorded so far, in time order (what massif.out holds)."""
        with self._lock:
            return list(self.series.snapshots)

    def store_columns(self, known: Container[int]) -> StoreColumns:
        """Every used site's counters now, as columns for the history store (agent.session.storerec), with the
        symbolized stacks of the sites not in `known`. Peak counters are the sites' bytes at the global peak."""
        with self._lock:
            c = self.counters()
            if self._page_tree_wanted():
                sites = self.read_sites(c.peak_gen)
                ids = np.fromiter(sites, dtype=np.int64, count=len(sites))
                rows = [[getattr(s, name) for name in COUNTER_FIELDS] for s in sites.values()]
                counters = np.array(rows, dtype=np.int64).reshape(len(ids), len(COUNTER_FIELDS)).T
            else:
                p = self.probes
                n = p.site_count()
                ids = np.array(p.used_sites(n), dtype=np.int64)
                cols = [
                    p.peak_column(name, _PEAK_OF[name], n, c.peak_gen, signed=True) if name in _PEAK_OF
                    # live counts read as signed: a racy read that saw one below zero stays small
                    else p.site_column(name, n, signed=name.startswith("cur_"))
                    for name in COUNTER_FIELDS
                ]
                counters = np.array(cols, dtype=np.int64)[:, ids]
            new = [sid for sid in ids.tolist() if sid not in known]
            stacks: dict[int, Stack] = {}
            if new:
                self.symbolize_new(new)
                stacks = {sid: tuple(self.frames_of(sid)) for sid in new}
            mapped = self.pages.total if self.pages is not None else None
            return StoreColumns(c, self.now(c), self.peak_time(c), self.stack_bytes, mapped, ids, counters, stacks)

    def merged_sites(self, massif_trim: bool) -> dict[Stack, SiteCounts]:
        """Counters per stack, merged over kernel keys whose stacks are equal once trimmed: with Massif's
        trimming (alloc-fns, --depth) when `massif_trim`, else the xtree's (cut below main only)."""
        with self._lock:
            c = self.end_counters or self.counters()
            sites = self.read_sites(c.peak_gen)
            self.symbolize_new(list(sites))
            return self.sites.merged(sites, massif_trim)
