"""The end-of-run summary as a value: what the CLI prints, what `--summary-file` writes as JSON, what tests read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from agent.model.counters import Counters, PageCounters
from agent.model.pages import PageStats
from agent.model.stored import StoreStatus


@dataclass(frozen=True)
class PageSummary:
    """The page map at the end (--pages-as-heap, or the mapped total beside the heap)."""

    stats: PageStats
    mapped: int  # bytes mapped at the end
    peak_mapped: int
    kernel: PageCounters  # events the kernel sent and could not send
    traced: bool = True  # the page calls were traced (sampled mode: --page-calls=yes); else statm's total at each look


@dataclass(frozen=True)
class UnwindSummary:
    """The unwind tables the stack walk used (--unwind=cfi)."""

    rows_used: int
    rows_dropped: int  # rows that did not fit in the kernel table
    objects: int  # objects whose table was built or loaded
    seconds: float  # building or loading them
    problems: dict[str, str] = field(default_factory=dict)  # object path -> why it has no table
    rows_shared: int = 0  # of rows_used, rows of objects another target had in the kernel already (by build id)


@dataclass(frozen=True)
class ScheduleSummary:
    """Snapshots taken on Massif's schedule (the kernel's points)."""

    taken: int
    at_peaks: int
    cullings: int
    kept: int
    late: int = 0  # points that reached user space after a tick's later state: not kept, the file in time order
    trees: int = 0  # detailed and peak snapshots given the tree of their own instant (the snapshot log)
    trees_missed: int = 0  # the log had lost records: a later tick's tree in the latest one's place, else none


@dataclass(frozen=True)
class SamplingSummary:
    """Sampled mode: what the in-process sampler reported."""

    rate: int  # mean bytes between samples
    samples: int = 0  # allocations sampled
    sampled_frees: int = 0  # frees of sampled blocks
    unseen_frees: int = 0  # samples whose address did not fit the sampler's set: their frees are not seen
    max_samples: int = 0  # the budget at the end: samples a second (--max-samples, or a daemon's share; 0: none)
    rate_in_force: int = 0  # the rate as the sampler last had it (rate, or more under the budget)
    rate_changes: int = 0  # times the budget moved the rate in force


@dataclass(frozen=True)
class ProfileSummary:
    counters: Counters
    pages: PageSummary | None = None
    unwind: UnwindSummary | None = None
    schedule: ScheduleSummary | None = None
    sampling: SamplingSummary | None = None  # None: exact mode
    store: StoreStatus | None = None  # the history store's writer, when one was kept

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        c = self.counters
        lines = []
        sm = self.sampling
        if sm is not None:
            lines.append(
                f"sampled mode, one sample per {sm.rate} bytes on average ({sm.samples} samples, {sm.sampled_frees} "
                "of their frees): the peak, the live blocks and bytes are ESTIMATES; call counts are exact"
            )
            if sm.rate_changes:
                lines.append(f"the sampling budget ({sm.max_samples} samples a second) moved the rate "
                             f"{sm.rate_changes} times; one sample per {sm.rate_in_force} bytes at the end (each "
                             "sample weighted at the rate it was drawn at)")
            if sm.unseen_frees:
                lines.append(f"{sm.unseen_frees} samples did not fit the sampler's address set: their frees "
                             "were not seen (those blocks stay in the estimate)")
        est = "~" if sm is not None else ""
        lines.append(
            f"{c.n_allocs} allocations, {c.n_frees} frees, {c.n_reallocs} reallocs; "
            f"peak {est}{c.peak_heap} B useful + {est}{c.peak_extra} B extra; {est}{c.blocks} blocks "
            f"({est}{c.heap} B) live at the end"
        )
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
        if c.dropped_sizes or c.dropped_threads:
            lines.append(
                f"NOT COUNTED in MALT's statistics: {c.dropped_sizes} request sizes or realloc jumps (size table "
                f"full), {c.dropped_threads} calls of threads (thread table full)"
            )
        if c.lost_returns:
            lines.append(f"{c.lost_returns} allocation calls whose return was not seen")
        if self.schedule is not None:
            sc = self.schedule
            lines.append(
                f"snapshots: {sc.taken} taken on Massif's schedule ({sc.at_peaks} at peaks), "
                f"{sc.cullings} cullings, {sc.kept} kept"
                + (f"; {sc.late} points not kept, read after a later state was recorded" if sc.late else "")
            )
        if c.sched_lost:
            lines.append(
                f"NOT COUNTED: {c.sched_lost} of the snapshot schedule's points (their ring buffer was full): "
                "the graph has fewer snapshots than Massif's"
            )
        if self.schedule is not None and (c.snap_lost or self.schedule.trees_missed):
            lines.append(
                f"NOT EXACT: {self.schedule.trees_missed} detailed snapshots' trees, not of their own instant: the "
                f"snapshot log's ring buffer was full ({c.snap_lost} records lost); the latest took a later "
                "state's tree, the others have none"
            )
        if c.walks_interrupted:
            lines.append(
                f"{c.walks_interrupted} stack walks overtaken by another thread's on the same CPU (a preemptible "
                "kernel): their calls are charged to [stack not recorded] (or, at a tail call, not seen)"
            )
        if self.pages is not None:
            lines.extend(_page_lines(self.pages))
        if self.unwind is not None:
            lines.extend(_unwind_lines(self.unwind, c))
        if self.store is not None:
            st = self.store
            lines.append(
                f"history: {st.snapshots_written} samples stored in {st.directory} ({st.bytes_written} B); "
                f"{st.quiet_skipped} looks at a target that had not moved kept as a step, not stored"
                + (f"; NOT STORED: {st.write_errors} samples ({st.last_error})" if st.write_errors else "")
            )
        return lines


    def massif_stats(self) -> list[str]:
        """--stats=yes: Massif's statistics (ms_main.c's print_stats), from heapscope's own counts where it has
        them. Stack allocations are not counted (heapscope records stack depth at allocator calls)."""
        c, sc = self.counters, self.schedule
        rows = [("heap allocs", c.n_allocs), ("heap reallocs", c.n_reallocs), ("heap frees", c.n_frees)]
        if sc is not None:
            rows += [("real snapshots", sc.taken), ("peak snapshots", sc.at_peaks), ("cullings", sc.cullings),
                     ("kept snapshots", sc.kept)]
        rows += [("XPt sites", c.n_sites)]
        return [f"stats: {name + ':':<22}{value:>10}" for name, value in rows]


def _page_lines(p: PageSummary) -> list[str]:
    st, kc = p.stats, p.kernel
    if not p.traced:
        return [f"pages: mapped {p.mapped} B at the end, {p.peak_mapped} B at the highest look (read from statm: "
                "sampled mode traces no page call without --page-calls=yes)"]
    lines = [
        f"pages: {st.applied} mmap/munmap/mremap/brk calls applied ({st.failed} failed); mapped "
        f"{p.mapped} B at the end, {p.peak_mapped} B at the peak"
        + (f" (at the end, {st.mapped_over_bytes} B of pages mapped over with MAP_FIXED, which Massif still "
           "counts)" if st.mapped_over_bytes else "")
    ]
    if kc.brk_folded or kc.unsampled:
        lines.append(f"pages: {kc.brk_folded} brk and {kc.unsampled} other calls folded in the kernel (sampled mode: "
                     "the mapped total's last and highest values a sample; the calls above are those it sampled)")
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


def _unwind_lines(u: UnwindSummary, c: Counters) -> list[str]:
    lines = [
        f"unwind: {u.rows_used} table rows ({u.rows_used * 12 // 1024} KiB) for "
        f"{u.objects} objects, built or loaded in {u.seconds:.2f} s; "
        f"frames: {c.unwind_frames} by table, {c.unwind_fp} by frame pointer (no table), "
        f"{c.unwind_no_rule} with no rule, {c.unwind_bad_read} bad reads "
        f"({c.unwind_short_reads} runs read again to a page end), {c.unwind_depth_cut} stacks cut "
        f"at the depth limit; {c.unwind_searched} rules searched in the tables (the others from the CPUs' rule caches)"
    ]
    if u.rows_shared:
        lines.append(f"unwind: {u.rows_shared} of those rows were in the kernel already for other targets with the "
                     "same objects (shared by build id, written once)")
    if u.rows_dropped:
        lines.append(f"unwind: {u.rows_dropped} rows did not fit in the kernel table")
    for path, problem in u.problems.items():
        lines.append(f"unwind: no table for {path}: {problem}")
    return lines
