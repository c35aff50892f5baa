"""Prometheus metrics: a prometheus_client custom Collector that builds its families fresh at each scrape from
the targets the daemon holds. Nothing is cached between scrapes and no global registry is used: the caller
registers the collector in the registry it serves.

Names follow Prometheus's conventions: a `heapscope_` prefix, base units in the name (`_bytes`), `_total` on
counters (prometheus_client adds it to counter families). Every per-target series carries `pid` and `command`.
The per-site series are bounded: the top N sites by live bytes plus one `(other sites)` series per target, so
a target with a million allocation sites still makes N + 1 series.

What is growing (agent.model.growth, read from a target's stored history over the last GROWTH_WINDOW_S) is the
one figure not read afresh: it reads up to 48 stored snapshots, so each target's is kept GROWTH_REFRESH_S, and a
scrape spends at most GROWTH_BUDGET_S recomputing the oldest (the others keep their last figures meanwhile).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.errors import HeapscopeError
from agent.model.counters import Counters
from agent.model.fleet import FORGET_REASONS, REFUSAL_REASONS, FleetStatus, TargetOrigin
from agent.model.growth import DEFAULT_WINDOW_S, GrowthReport
from agent.model.pages import PageTotals
from agent.model.stored import StoreStatus
from agent.model.target import SiteTotal

# Every per-target series: the process, and where it runs as its cgroup path tells (agent.model.cgroup; "" where
# the path does not say). One value of each per target, so they add no series.
TARGET_LABELS = ("pid", "command", "cgroup", "unit", "container", "pod")


class MetricsTarget(Protocol):
    pid: int
    command: str
    allocator: str
    origin: TargetOrigin
    mode: str  # exact, or sampled: the byte and block figures are estimates
    sample_rate: int  # 1 in exact mode

    @property
    def state(self) -> str: ...

    def counters(self) -> Counters: ...

    def rate_in_force(self) -> tuple[int, int] | None: ...

    def sample_budget(self) -> int | None: ...

    def top_sites(self, n: int) -> tuple[list[SiteTotal], SiteTotal]: ...

    def page_totals(self) -> PageTotals | None: ...

    def store_status(self) -> StoreStatus: ...

    def stored_growth(self, since: str | None, window_s: float | None, top: int) -> GrowthReport: ...


class MetricsSource(Protocol):
    def targets(self) -> Sequence[MetricsTarget]: ...


# (metric name without _total, help, Counters field)
_GAUGES = (
    ("heapscope_heap_useful_bytes", "Live heap bytes requested by the program (Massif's mem_heap_B).", "heap"),
    (
        "heapscope_heap_extra_bytes",
        "Live heap bytes lost to alignment and allocator headers (Massif's mem_heap_extra_B).",
        "extra",
    ),
    ("heapscope_heap_peak_useful_bytes", "Useful heap bytes at the peak of useful + extra.", "peak_heap"),
    ("heapscope_heap_peak_extra_bytes", "Extra heap bytes at the peak of useful + extra.", "peak_extra"),
    ("heapscope_heap_live_blocks", "Heap blocks allocated and not yet freed.", "blocks"),
)
_COUNTERS = (
    ("heapscope_allocated_bytes", "Bytes requested by allocation calls since the probes were attached.", "alloc_bytes"),
    ("heapscope_freed_bytes", "Bytes of tracked blocks freed since the probes were attached.", "freed_bytes"),
    ("heapscope_allocation_calls", "Allocation calls (malloc, calloc, new, the aligned ones, ...) seen; reallocs "
     "are in heapscope_realloc_calls_total.", "n_allocs"),
    ("heapscope_realloc_calls", "realloc calls seen.", "n_reallocs"),
    ("heapscope_free_calls", "Free calls seen.", "n_frees"),
    ("heapscope_untracked_frees", "Frees of blocks allocated before the probes were attached (not counted).",
     "untracked_frees"),
    ("heapscope_stack_walks_interrupted", "Stack walks overtaken on their CPU (a preemptible kernel): charged to "
     "[stack not recorded].", "walks_interrupted"),
)
# Page-level figures (agent.model.pages.PageTotals field): memory malloc does not explain.
_PAGE_GAUGES = (
    ("heapscope_mapped_bytes", "Bytes the process has mapped (mmap, mremap, brk, and what existed at the start).",
     "mapped"),
    ("heapscope_mapped_peak_bytes", "The highest mapped total since the profile started.", "peak_mapped"),
    ("heapscope_stacks_bytes", "Stack bytes of all threads at the last sample (--stacks=yes; else 0).", "stacks"),
)
# The history store (agent.model.stored.StoreStatus field), for targets that keep one.
_STORE_COUNTERS = (
    ("heapscope_store_snapshots_written", "Samples written to the history store.", "snapshots_written"),
    ("heapscope_store_quiet_skipped", "Looks not stored in the history store: nothing had moved since the last "
     "stored sample.", "quiet_skipped"),
    ("heapscope_store_bytes_written", "Bytes written to the history store.", "bytes_written"),
    ("heapscope_store_write_errors", "Samples the history store could not write (a full disk...); the profile "
     "goes on.", "write_errors"),
)
# Full kernel tables: what was not counted because a map had no room ("map" label -> Counters field).
_DROPS = (
    ("blocks", "dropped_blocks"),
    ("stacks", "dropped_stacks"),
    ("sites", "dropped_sites"),
    ("threads", "dropped_pending"),
    ("malt_sizes", "dropped_sizes"),  # MALT's request sizes and realloc jumps
    ("malt_threads", "dropped_threads"),  # MALT's per-thread statistics
    ("snapshot_log", "snap_lost"),  # the snapshot log's ring: trees of earlier points not of their own instant
)


GROWTH_WINDOW_S = DEFAULT_WINDOW_S
GROWTH_REFRESH_S = 30.0
GROWTH_BUDGET_S = 2.0


class GrowthCache:
    """Each target's growth report, recomputed once it is GROWTH_REFRESH_S old, oldest first, within a time budget
    per scrape (one at least). A target whose history cannot be read (none stored yet) has no figures."""

    def __init__(self, window_s: float = GROWTH_WINDOW_S, refresh_s: float = GROWTH_REFRESH_S,
                 budget_s: float = GROWTH_BUDGET_S) -> None:
        self.window_s = window_s
        self.refresh_s = refresh_s
        self.budget_s = budget_s
        self._lock = threading.Lock()  # scrapes may run at once (the server's worker threads)
        self._held: dict[tuple[int, int], tuple[float, GrowthReport | None]] = {}  # (pid, id) -> (when, report)

    def reports(self, targets: Sequence[MetricsTarget], top: int) -> dict[int, GrowthReport]:
        """The latest report of each target that keeps a history, by id(target)."""
        with self._lock:
            now = time.monotonic()
            keys = {(t.pid, id(t)): t for t in targets}
            for gone in self._held.keys() - keys.keys():
                del self._held[gone]
            stale = sorted((self._held.get(k, (-1e18, None))[0], k) for k in keys)
            spent = 0.0
            for done, (at, key) in enumerate(stale):
                if now - at < self.refresh_s or (done and spent >= self.budget_s):  # one at least, for progress
                    break
                t0 = time.monotonic()
                try:
                    report = keys[key].stored_growth(None, self.window_s, top)
                except HeapscopeError:  # no history kept, none stored yet, or gone
                    report = None
                spent += time.monotonic() - t0
                self._held[key] = (now, report)
            return {k[1]: r for k, (_, r) in self._held.items() if r is not None}


class HeapscopeCollector(Collector):
    def __init__(self, source: MetricsSource, top_stacks: int = 10, growth: GrowthCache | None = None) -> None:
        if top_stacks < 0:
            raise ValueError(f"top_stacks must be at least 0, got {top_stacks}")
        self.source = source
        self.top_stacks = top_stacks
        self.growth = growth if growth is not None else GrowthCache()

    def describe(self) -> list[Metric]:
        # No families at registration: collect() reads the maps and must only run at scrape time.
        return []

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("heapscope_target", "A profiled process.", labels=TARGET_LABELS)
        profile = InfoMetricFamily(
            "heapscope_profile",
            "How a target is profiled: mode exact (every call counted) or sampled (one sample per sample_rate "
            "bytes on average: the heap byte and block figures are estimates, the call counts exact).",
            labels=TARGET_LABELS,
        )
        exited = GaugeMetricFamily(
            "heapscope_target_exited", "1 once the process has exited (its last state stays).", labels=TARGET_LABELS
        )
        rate_now = GaugeMetricFamily(
            "heapscope_sample_rate_in_force_bytes",
            "Sampled mode: the mean bytes between samples the sampler samples at now; above sample_rate while "
            "the sampling budget (--max-samples) has raised it (the estimates stay unbiased, from fewer samples).",
            labels=TARGET_LABELS,
        )
        budget = GaugeMetricFamily(
            "heapscope_sample_budget",
            "Sampled mode: the samples a second the sampler may take now before its rate in force rises: "
            "--max-samples, or its share of a daemon's --total-samples (0: no budget).",
            labels=TARGET_LABELS,
        )
        rate_moves = CounterMetricFamily(
            "heapscope_sample_rate_changes",
            "Sampled mode: how often the sampling budget has moved the rate in force.",
            labels=TARGET_LABELS,
        )
        gauges = [GaugeMetricFamily(name, doc, labels=TARGET_LABELS) for name, doc, _ in _GAUGES]
        counters = [CounterMetricFamily(name, doc, labels=TARGET_LABELS) for name, doc, _ in _COUNTERS]
        drops = CounterMetricFamily(
            "heapscope_map_full_drops",
            "Events not counted because a kernel table was full (raise --max-blocks / --max-stacks).",
            labels=(*TARGET_LABELS, "map"),
        )
        site_bytes = GaugeMetricFamily(
            "heapscope_site_live_bytes",
            f"Live heap bytes of the top {self.top_stacks} allocation sites, and of all other sites together.",
            labels=(*TARGET_LABELS, "site"),
        )
        site_blocks = GaugeMetricFamily(
            "heapscope_site_live_blocks",
            f"Live heap blocks of the top {self.top_stacks} allocation sites, and of all other sites together.",
            labels=(*TARGET_LABELS, "site"),
        )
        page_gauges = [GaugeMetricFamily(name, doc, labels=TARGET_LABELS) for name, doc, _ in _PAGE_GAUGES]
        page_calls = CounterMetricFamily(
            "heapscope_page_syscalls",
            "mmap, munmap, mremap and brk calls applied to the page map.",
            labels=TARGET_LABELS,
        )
        store_counters = [CounterMetricFamily(name, doc, labels=TARGET_LABELS) for name, doc, _ in _STORE_COUNTERS]
        window = f"{self.growth.window_s:.0f} s"
        site_growth = GaugeMetricFamily(
            "heapscope_site_growth_bytes_per_second",
            f"Growth of the live heap bytes of the top {self.top_stacks} sites by growth (leak suspects first, then "
            f"by bytes added), a second, over the last {window} of the stored history (Theil-Sen's slope; "
            "recomputed every 30 s), and of all other sites together.",
            labels=(*TARGET_LABELS, "site"),
        )
        suspects = GaugeMetricFamily(
            "heapscope_leak_suspects",
            f"Sites whose live bytes grew steadily and stayed over the last {window} of the stored history "
            "(GET /targets/PID/growth lists them).",
            labels=TARGET_LABELS,
        )
        targets = list(self.source.targets())
        growth = self.growth.reports([t for t in targets if _keeps_history(t)], self.top_stacks)
        n_targets = 0
        for t in targets:
            try:
                c = t.counters()
                top, other = t.top_sites(self.top_stacks)
                pages = t.page_totals()
                store = t.store_status()
                in_force = t.rate_in_force()
                budget_now = t.sample_budget()
            except HeapscopeError:  # detached or gone between the listing and the read: leave it out
                continue
            n_targets += 1
            where = t.origin.placement
            labels = [str(t.pid), t.command, where.path, where.unit, where.container, where.pod]
            info.add_metric(labels, {"state": t.state, "allocator": t.allocator})
            profile.add_metric(labels, {"mode": t.mode, "sample_rate": str(t.sample_rate)})
            exited.add_metric(labels, 1.0 if t.state == "exited" else 0.0)
            if in_force is not None:
                rate_now.add_metric(labels, in_force[0])
                rate_moves.add_metric(labels, in_force[1])
            if budget_now is not None:
                budget.add_metric(labels, budget_now)
            for fam, (_, _, fld) in zip(gauges, _GAUGES, strict=True):
                fam.add_metric(labels, max(getattr(c, fld), 0))
            for cfam, (_, _, fld) in zip(counters, _COUNTERS, strict=True):
                cfam.add_metric(labels, max(getattr(c, fld), 0))
            for name, fld in _DROPS:
                drops.add_metric([*labels, name], getattr(c, fld))
            if pages is not None:
                for fam, (_, _, fld) in zip(page_gauges, _PAGE_GAUGES, strict=True):
                    fam.add_metric(labels, getattr(pages, fld))
                page_calls.add_metric(labels, pages.syscalls)
                drops.add_metric([*labels, "page_events"], pages.dropped)
            if store.enabled:
                for cfam, (_, _, fld) in zip(store_counters, _STORE_COUNTERS, strict=True):
                    cfam.add_metric(labels, getattr(store, fld))
            for s in [*top, other]:
                site_bytes.add_metric([*labels, s.site], s.bytes)
                site_blocks.add_metric([*labels, s.site], s.blocks)
            report = growth.get(id(t))
            if report is not None:
                suspects.add_metric(labels, report.suspects)
                for g in report.sites[: self.top_stacks]:
                    site_growth.add_metric([*labels, g.site], g.bytes_per_s)
                site_growth.add_metric([*labels, OTHER_SITES], report.rest_bytes_per_s)
        yield GaugeMetricFamily("heapscope_targets", "Processes the daemon holds a profile of.", value=n_targets)
        yield info
        yield profile
        yield exited
        yield rate_now
        yield budget
        yield rate_moves
        yield from gauges
        yield from counters
        yield from page_gauges
        yield page_calls
        yield drops
        yield site_bytes
        yield site_blocks
        yield from store_counters
        yield site_growth
        yield suspects


OTHER_SITES = "(other sites)"


def _keeps_history(t: MetricsTarget) -> bool:
    try:
        return t.store_status().enabled
    except HeapscopeError:
        return False


class FleetSource(Protocol):
    def fleet_status(self) -> FleetStatus: ...


class FleetCollector(Collector):
    """The daemon's own figures: its selectors, the targets it refused at a limit, the kernel's process events,
    its limits and what it holds against them."""

    def __init__(self, source: FleetSource) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        f = self.source.fleet_status()
        refused = CounterMetricFamily(
            "heapscope_targets_refused",
            "New targets refused because the daemon was at a limit (--max-targets, --max-sites, --max-memory).",
            labels=("reason",),
        )
        for reason in REFUSAL_REASONS:
            refused.add_metric([reason], f.refused.get(reason, 0))
        yield refused
        yield CounterMetricFamily(
            "heapscope_attach_failures",
            "Processes a selector chose that could not be attached (gone, no allocator found, ...).",
            value=f.attach_failures,
        )
        yield CounterMetricFamily(
            "heapscope_process_events", "exec, fork and exit events received from the kernel.", value=f.events
        )
        yield CounterMetricFamily(
            "heapscope_process_events_lost",
            "Process events the kernel could not deliver (each loss is followed by a scan of /proc).",
            value=f.events_lost,
        )
        yield CounterMetricFamily("heapscope_proc_scans", "Scans of /proc for selected processes.", value=f.scans)
        yield GaugeMetricFamily(
            "heapscope_sampling_limit",
            "Sampled mode: the samples a second all targets may take together (--total-samples; 0: no total).",
            value=f.total_samples,
        )
        yield GaugeMetricFamily(
            "heapscope_sampling_demand",
            "Sampled mode: the samples a second the targets would take together at their asked rates.",
            value=f.sample_demand,
        )
        yield GaugeMetricFamily(
            "heapscope_sampling_share",
            "Sampled mode: the most samples a second each target may take while the targets' demand exceeds "
            "the total (0: nobody held back).",
            value=f.sample_share,
        )
        yield CounterMetricFamily(
            "heapscope_store_expired_segments",
            "History segments of processes no longer profiled, deleted once older than --store-max-age.",
            value=f.expired_segments,
        )
        yield CounterMetricFamily(
            "heapscope_store_expired_histories",
            "Histories of processes no longer profiled, deleted whole once every segment was older than "
            "--store-max-age.",
            value=f.expired_histories,
        )
        forgotten = CounterMetricFamily(
            "heapscope_targets_forgotten",
            "Ended targets dropped from /targets (their files and histories stay): age (--keep-exited), count "
            "(--max-exited), room (made at a limit).",
            labels=("reason",),
        )
        for why in FORGET_REASONS:
            forgotten.add_metric([why], f.forgotten.get(why, 0))
        yield forgotten
        yield CounterMetricFamily(
            "heapscope_output_files_expired",
            "Output files of processes no longer profiled, deleted once older than --output-max-age.",
            value=f.expired_outputs,
        )
        yield GaugeMetricFamily(
            "heapscope_targets_waiting",
            "Processes sampled mode found no thread of at a safe point yet (in /targets as waiting): tried again.",
            value=f.waiting,
        )
        yield CounterMetricFamily(
            "heapscope_log_lines_lost",
            "Lines of the daemon's log that could not be written (a closed pipe, a full disk); profiling goes on.",
            value=f.log_lines_lost,
        )
        matches = CounterMetricFamily(
            "heapscope_selector_matches", "Processes each selector chose since it was added.", labels=("selector",)
        )
        current = GaugeMetricFamily(
            "heapscope_selector_targets", "Processes profiled now because of each selector.", labels=("selector",)
        )
        for s in f.selectors:
            matches.add_metric([str(s.id)], s.matched)
            current.add_metric([str(s.id)], len(s.targets))
        yield matches
        yield current
        limit = GaugeMetricFamily("heapscope_limit", "The daemon's limits that are set.", labels=("kind",))
        held = GaugeMetricFamily("heapscope_held", "What the daemon holds against its limits.", labels=("kind",))
        lim = f.limits
        for kind, value, now in (
            ("targets", lim.max_targets, f.profiling),
            ("sites", lim.max_sites, f.sites),
            ("memory", lim.max_memory, f.rss),
        ):
            if value is not None:
                limit.add_metric([kind], value)
            held.add_metric([kind], now)
        yield limit
        yield held
