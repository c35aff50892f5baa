"""The kernel's counters as plain values: copies of probes/heap.h's struct hs_global and enum hs_page_counter
(tests/unit/test_contract.py checks the fields against the header)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counters:
    """A copy of struct hs_global (probes/heap.h)."""

    execs: int = 0
    n_sites: int = 0
    heap: int = 0
    extra: int = 0
    blocks: int = 0
    time_b: int = 0
    peak_total: int = 0
    peak_heap: int = 0
    peak_extra: int = 0
    peak_time_b: int = 0
    peak_ns: int = 0
    peak_gen: int = 0
    n_allocs: int = 0
    n_frees: int = 0
    n_reallocs: int = 0
    alloc_bytes: int = 0
    freed_bytes: int = 0
    untracked_frees: int = 0
    failed_allocs: int = 0
    nested_calls: int = 0
    dropped_blocks: int = 0
    dropped_stacks: int = 0
    dropped_sites: int = 0
    dropped_pending: int = 0
    overflow_pending: int = 0  # calls held in the overflow table now (their slot was taken)
    lost_returns: int = 0
    unwind_frames: int = 0
    unwind_fp: int = 0
    unwind_no_rule: int = 0
    unwind_searched: int = 0  # frames whose rule the walk searched in the tables (its CPU's rule cache missed)
    unwind_bad_read: int = 0
    unwind_depth_cut: int = 0
    dropped_sizes: int = 0
    dropped_threads: int = 0
    zero_allocs: int = 0
    hashed_blocks: int = 0
    unwind_short_reads: int = 0
    walks_interrupted: int = 0
    sched_points: int = 0  # the snapshot schedule's points sent
    sched_lost: int = 0  # points its ring buffer could not take
    sched_signalled: int = 0  # the point count at which the last cull was signalled
    sched_wakes: int = 0  # wake-ups sent for the schedule's cullings (sampled mode: fewer than its cullings)
    snap_records: int = 0  # records sent to the snapshot log (a site's value before its first change after a point)
    snap_lost: int = 0  # records the snapshot log's ring could not take

    @property
    def dropped(self) -> int:
        return self.dropped_blocks + self.dropped_stacks + self.dropped_sites + self.dropped_pending


@dataclass(frozen=True)
class PageCounters:
    """probes/heap.h enum hs_page_counter."""

    events: int = 0  # events sent
    lost: int = 0  # ring buffer full: not sent
    calls_full: int = 0  # per-thread call table full at entry: not sent
    unpaired: int = 0  # an exit without its entry (the call began before the probes were armed)
    brk_folded: int = 0  # sampled mode: brk calls folded into the mapped total's last and highest value, not sent
    code_maps: int = 0  # mmap calls with PROT_EXEC, and mremap calls: those that can map new code
    unsampled: int = 0  # sampled mode: mmap, munmap and mremap calls not sampled (folded as brk is, not sent)

    @property
    def dropped(self) -> int:
        return self.lost + self.calls_full
