"""MALT's profile model: its per-stack allocator statistics, timelines, scatter charts and run-level data, with
the accumulators the session fills them with (agent.session.maltrec) and the cross-checks of a profile. The JSON
writer is agent.export.malt.

What MALT means by the per-stack numbers (its CallStackInfo), which the profiler must follow when it fills
this model from the kernel's maps:
this model from the kernel's maps:
- `alloc`: count/min/max/sum of the non-zero sizes requested from this stack; a zero-size request only
  increments `countZeros`.
- `free`: count/min/max/sum of the sizes freed *by calls made from this stack* (MALT keys a free by the
  stack of the free() call, not by the stack that allocated the block); zero sizes are not counted.
- `lifetime`: ticks from allocation to free of the blocks *allocated* from this stack (0 is not counted).
- `aliveReq`: bytes allocated from this stack still alive; `maxAliveReq`: the largest aliveReq seen;
  `globalPeak`: aliveReq at the moment of the global peak of requested memory.
- `reallocCount`, `reallocSumDelta`: realloc calls from this stack and the sum of (new size - old size).
MALT keeps one entry per stack *and* allocation function: a stack's innermost frame is an address inside
the allocation function itself (the seed's leaf frame lies in MALT's malloc wrapper), so malloc() and free()
called from one line are two stacks. heapscope writes the allocation function's runtime address (given in
`MaltProfile.function_addresses`) as that leaf frame, and names it in `sites`.

Pure: no bcc, no I/O, no symbols (frames come filled in, or the writer's resolver names the addresses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agent import __version__
from agent.model.maps import Mapping as ProcMapping
from agent.model.stack import Stack

FormatVersion = Literal["1.1", "1.6"]
FORMAT_VERSIONS: tuple[str, ...] = ("1.1", "1.6")

# The allocation functions MALT tracks (its own names), in the order of the seed's `threads[].stats`.
MALT_FUNCTIONS: tuple[str, ...] = (
    "malloc",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "free",
    "calloc",
    "realloc",
)

# MALT's own mmap tracking (config c.mmap): stacks of mmap and munmap calls, with their infos' mmap/munmap.
PAGE_FUNCTIONS: tuple[str, ...] = ("mmap", "munmap")

UNKNOWN_STRING = "??"  # sites.strings[0]: unknown values
ROOT_STRING = "[0x1]"  # sites.strings[1]: the root of all call stacks
ROOT_ADDRESS = 0x1
# aslrOffset MALT writes when it did not compute one ((size_t)-1).
UNKNOWN_ASLR_OFFSET = 2**64 - 1

MEMORY_FIELDS: tuple[str, ...] = ("requestedMem", "physicalMem", "virtualMem", "internalMem", "segments")
SYSTEM_FIELDS: tuple[str, ...] = ("freeMemory", "cachedMemory", "swapMemory")
BANDWIDTH_FIELDS: tuple[str, ...] = ("allocMem", "allocCount", "freeMem", "freeCount")

DEFAULT_POINTS = 512  # MALT's time.points
DEFAULT_SCATTER_SIZE = 64  # MALT's scatter charts are 64 x 64


# ----------------------------------------------------------------------------------------------------------
# Per-stack statistics


@dataclass
class CountMinMaxSum:
    """count/min/max/sum of a quantity (MALT's SimpleQuantityHistory). All zero when nothing was counted."""

    count: int = 0
    min: int = 0
    max: int = 0
    sum: int = 0

    def add(self, value: int, times: int = 1) -> None:
        if times <= 0:
            return
        if self.count == 0:
            self.min = self.max = value
        else:
            self.min = min(self.min, value)
            self.max = max(self.max, value)
        self.count += times
        self.sum += value * times

    def merge(self, other: CountMinMaxSum) -> None:
        if other.count == 0:
            return
        if self.count == 0:
            self.min, self.max = other.min, other.max
        else:
            self.min = min(self.min, other.min)
            self.max = max(self.max, other.max)
        self.count += other.count
        self.sum += other.sum

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "min": self.min, "max": self.max, "sum": self.sum}

    def problems(self, what: str) -> list[str]:
        """Internal contradictions (e.g. a racy read of the kernel's counters)."""
        out: list[str] = []
        if self.count < 0 or self.sum < 0 or self.min < 0:
            out.append(f"{what}: negative value {self.to_json()}")
        elif self.count == 0:
            if self.min or self.max or self.sum:
                out.append(f"{what}: count is 0 but min/max/sum are not {self.to_json()}")
        elif not (self.min <= self.max and self.min * self.count <= self.sum <= self.max * self.count):
            out.append(f"{what}: min/max/sum do not fit count {self.to_json()}")
        return out


@dataclass
class MaltStackStats:
    """MALT's `infos` of one stack. Sizes in bytes, lifetimes in ticks (globals.ticksPerSecond)."""

    alloc: CountMinMaxSum = field(default_factory=CountMinMaxSum)
    free: CountMinMaxSum = field(default_factory=CountMinMaxSum)
    lifetime: CountMinMaxSum = field(default_factory=CountMinMaxSum)
    mmap: CountMinMaxSum = field(default_factory=CountMinMaxSum)  # written in format 1.6 only
    munmap: CountMinMaxSum = field(default_factory=CountMinMaxSum)  # written in format 1.6 only
    count_zeros: int = 0
    max_alive_req: int = 0
    alive_req: int = 0
    global_peak: int = 0
    realloc_count: int = 0
    realloc_sum_delta: int = 0  # may be negative: realloc shrinks count too

    def to_json(self, version: FormatVersion) -> dict[str, Any]:
        out: dict[str, Any] = {
            "countZeros": self.count_zeros,
            "maxAliveReq": self.max_alive_req,
            "aliveReq": self.alive_req,
            "alloc": self.alloc.to_json(),
            "free": self.free.to_json(),
        }
        if version == "1.6":
            out["mmap"] = self.mmap.to_json()
            out["munmap"] = self.munmap.to_json()
        out["lifetime"] = self.lifetime.to_json()
        out["globalPeak"] = self.global_peak
        out["reallocCount"] = self.realloc_count
        out["reallocSumDelta"] = self.realloc_sum_delta
        return out


@dataclass(frozen=True)
class StackKey:
    """What MALT keys its statistics by: a call stack and the allocation function called from it.

    `addresses` are the raw return addresses of the stack, innermost first (the first one is in the
    function that called `function`)."""

    addresses: tuple[int, ...]
    function: str = "malloc"

    def __post_init__(self) -> None:
        if self.function not in MALT_FUNCTIONS and self.function not in PAGE_FUNCTIONS:
            raise ValueError(f"unknown allocation function {self.function!r}; MALT knows {', '.join(MALT_FUNCTIONS)}")


@dataclass
class MaltStack:
    """One entry of `stacks.stats`. `frames` (optional) are the symbolized frames of `key.addresses`, as
    agent.symbols.symbolizer gives them (inlined calls as extra frames at one address); without them the writer asks
    its resolver. `stack_id` (optional, e.g. the kernel's stack id) becomes `stackId`; by default the
    entry's position is used."""

    key: StackKey
    stats: MaltStackStats = field(default_factory=MaltStackStats)
    frames: Stack = ()
    stack_id: int | None = None


@dataclass(frozen=True)
class MaltLeak:
    """Blocks allocated from one stack and still alive at exit."""

    key: StackKey
    count: int
    memory: int


# ----------------------------------------------------------------------------------------------------------
# Timelines


@dataclass
class TimelineSeries:
    """One binned timeline as MALT writes it: `values[i]` covers ticks [start + i*perPoints, start +
    (i+1)*perPoints). `callsites[i]` is the stack (or address) that set interval i's maximum, or None."""

    fields: tuple[str, ...]
    start: int = 0
    per_points: int = 0
    peak: tuple[int, ...] = ()
    values: list[tuple[int, ...]] = field(default_factory=list)
    callsites: list[StackKey | int | None] = field(default_factory=list)

    @classmethod
    def empty(cls, fields: Sequence[str]) -> TimelineSeries:
        return cls(tuple(fields), peak=tuple(0 for _ in fields))


class TimelineBinner:
    """Samples over time -> at most `points` intervals, for a run of any length (MALT's ProfiledValue).

    The first sample sets `start`. Intervals are `per_points` ticks wide; when a sample falls beyond the
    last interval, the width doubles and neighbouring intervals merge pairwise, as often as needed. So after
    a run of D ticks, per_points is the initial width times the smallest power of two that fits D into
    `points` intervals.

    State timelines (memory, system) keep, per interval, the maximum of each field (the seed: "on each
    interval we kept the max observed values"), plus the callsite of the sample that set the maximum of the
    first field; an interval without samples repeats the previous one. Bandwidth timelines
    (`bandwidth=True`) sum each field over the interval; an interval without samples is zero.
    """

    def __init__(
        self,
        fields: Sequence[str],
        *,
        points: int = DEFAULT_POINTS,
        bandwidth: bool = False,
        start: int | None = None,
        per_points: int = 1,
    ) -> None:
        if not fields:
            raise ValueError("a timeline needs at least one field")
        if points < 2:
            raise ValueError(f"points must be at least 2, got {points}")
        if per_points < 1:
            raise ValueError(f"per_points must be at least 1, got {per_points}")
        self.fields = tuple(fields)
        self.points = points
        self.bandwidth = bandwidth
        self.start = start
        self.per_points = per_points
        self.n_samples = 0
        self._bins: list[list[int] | None] = [None] * points
        self._callsites: list[StackKey | int | None] = [None] * points
        self._peak = [0] * len(self.fields)
        self._last_time: int | None = None

    def push(self, time: int, values: Sequence[int], callsite: StackKey | int | None = None) -> None:
        """Add one sample (ticks, one value per field). Samples must come in time order."""
        if len(values) != len(self.fields):
            raise ValueError(f"expected {len(self.fields)} values ({', '.join(self.fields)}), got {len(values)}")
        if self.start is None:
            self.start = time
        if time < self.start or (self._last_time is not None and time < self._last_time):
            raise ValueError(f"sample at {time} is before the previous one or the start")
        self._last_time = time
        index = (time - self.start) // self.per_points
        if index >= self.points:
            # The width doubles as often as needed, in one pass over the intervals: a timeline that starts one tick
            # wide reaches a run's seconds of nanoseconds in some 30 doublings, most of them at its first samples.
            factor = 1 << ((index // self.points).bit_length())
            self._widen(factor)
            index = (time - self.start) // self.per_points
        self._merge_into(index, list(values), callsite)
        if not self.bandwidth:
            self._peak = [max(p, v) for p, v in zip(self._peak, values, strict=True)]
        self.n_samples += 1

    def _merge_into(self, index: int, values: list[int], callsite: StackKey | int | None) -> None:
        cur = self._bins[index]
        if cur is None:
            self._bins[index] = values
            self._callsites[index] = callsite
            return
        self._bins[index], self._callsites[index] = self._merged(cur, self._callsites[index], values, callsite)

    def _merged(
        self, cur: list[int], cur_site: StackKey | int | None, values: list[int], callsite: StackKey | int | None
    ) -> tuple[list[int], StackKey | int | None]:
        """An interval's values and callsite with a later sample's (or a later interval's) merged in."""
        if self.bandwidth:
            return [a + b for a, b in zip(cur, values, strict=True)], cur_site
        # The callsite is the one that raised the first field's maximum (the earlier one on a tie).
        site = callsite if values[0] > cur[0] or cur_site is None else cur_site
        return [max(a, b) for a, b in zip(cur, values, strict=True)], site

    def _widen(self, factor: int) -> None:
        """Intervals `factor` (a power of two) times as wide: the width doubled as often, neighbours merged pairwise
        each time (a merge keeps a callsite by the order it meets them in), going only over the intervals that
        hold samples."""
        bins = {i: (b, self._callsites[i]) for i, b in enumerate(self._bins) if b is not None}
        while factor > 1:
            factor //= 2
            self.per_points *= 2
            merged: dict[int, tuple[list[int], StackKey | int | None]] = {}
            for i, (values, site) in bins.items():  # in time order
                cur = merged.get(i // 2)
                merged[i // 2] = (values, site) if cur is None else self._merged(*cur, values, site)
            bins = merged
        self._bins = [None] * self.points
        self._callsites = [None] * self.points
        for i, (values, site) in bins.items():
            self._bins[i], self._callsites[i] = values, site

    def series(self) -> TimelineSeries:
        """The timeline up to its last interval with a sample."""
        last = max((i for i, b in enumerate(self._bins) if b is not None), default=-1)
        values: list[tuple[int, ...]] = []
        callsites: list[StackKey | int | None] = []
        previous = tuple(0 for _ in self.fields)
        for i in range(last + 1):
            b = self._bins[i]
            if b is None:
                values.append(previous if not self.bandwidth else tuple(0 for _ in self.fields))
                callsites.append(None)
                continue
            previous = tuple(b)
            values.append(previous)
            callsites.append(self._callsites[i])
        if self.bandwidth:
            peak = tuple(max((v[f] for v in values), default=0) for f in range(len(self.fields)))
        else:
            peak = tuple(self._peak)
        return TimelineSeries(self.fields, self.start or 0, self.per_points, peak, values, callsites)


# ----------------------------------------------------------------------------------------------------------
# Scatter charts


def log2_bin(value: int) -> int:
    """The log2 bin of a value: bin i holds [2**i, 2**(i+1)); 0 and 1 are both in bin 0."""
    return max(int(value), 1).bit_length() - 1


@dataclass
class ScatterAxis:
    """One axis of a scatter chart. Log axes: bin i is log2_bin's i, written as 2**i, `max` is 2**(highest
    bin + 1). Linear axes: `size` bins of max/size each over [0, max), bin i written as i*max/size; `max`
    doubles (bins merging pairwise) when a larger value comes."""

    log: bool
    size: int = DEFAULT_SCATTER_SIZE
    max: int = 0  # 0: set from the data

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"a scatter axis needs at least 2 bins, got {self.size}")
        if not self.log:
            if self.max == 0:
                self.max = self.size
            if self.max % self.size:
                raise ValueError(f"a linear axis max ({self.max}) must be a multiple of its size ({self.size})")

    def value_of(self, index: int) -> int:
        return 2**index if self.log else index * (self.max // self.size)


class ScatterChart:
    """A 2-D histogram over (x, y) bins with counts, as MALT's `sizeOverTime` / `lifetimeOverSize`."""

    def __init__(self, x: ScatterAxis, y: ScatterAxis) -> None:
        self.x = x
        self.y = y
        self.points: dict[tuple[int, int], int] = {}

    @classmethod
    def size_over_time(cls) -> ScatterChart:
        """x: time since start in ticks (linear), y: requested size (log2), as MALT's chart."""
        return cls(ScatterAxis(log=False), ScatterAxis(log=True))

    @classmethod
    def lifetime_over_size(cls) -> ScatterChart:
        """x: requested size (log2), y: lifetime in ticks (log2), as MALT's chart."""
        return cls(ScatterAxis(log=True), ScatterAxis(log=True))

    def _linear_index(self, axis: ScatterAxis, value: int, which: int) -> int:
        if value < 0:
            raise ValueError(f"scatter values are not negative, got {value}")
        while value >= axis.max:
            axis.max *= 2
            merged: dict[tuple[int, int], int] = {}
            for (bx, by), v in self.points.items():
                k = (bx // 2, by) if which == 0 else (bx, by // 2)
                merged[k] = merged.get(k, 0) + v
            self.points = merged
        return value // (axis.max // axis.size)

    def _log_index(self, axis: ScatterAxis, index: int) -> int:
        index = min(index, axis.size - 1)
        axis.max = max(axis.max, 2 ** (index + 1))
        return index

    def add(self, x: int, y: int, count: int = 1) -> None:
        """Count `count` events at raw values (x, y)."""
        bx = self._log_index(self.x, log2_bin(x)) if self.x.log else self._linear_index(self.x, x, 0)
        by = self._log_index(self.y, log2_bin(y)) if self.y.log else self._linear_index(self.y, y, 1)
        self.points[(bx, by)] = self.points.get((bx, by), 0) + count

    def add_log2_bins(self, x: int, y: int, count: int) -> None:
        """Count events already binned by the kernel: a log axis takes its log2 bin, a linear axis the raw
        value."""
        bx = self._log_index(self.x, x) if self.x.log else self._linear_index(self.x, x, 0)
        by = self._log_index(self.y, y) if self.y.log else self._linear_index(self.y, y, 1)
        self.points[(bx, by)] = self.points.get((bx, by), 0) + count

    def to_json(self) -> dict[str, Any]:
        def axis(a: ScatterAxis) -> dict[str, Any]:
            return {"max": a.max, "size": a.size, "log": a.log}

        return {
            "infos": {"xAxis": axis(self.x), "yAxis": axis(self.y)},
            "points": [
                {"x": self.x.value_of(bx), "y": self.y.value_of(by), "v": v}
                for (bx, by), v in sorted(self.points.items())
                if v > 0
            ],
        }


# ----------------------------------------------------------------------------------------------------------
# Run-level data


@dataclass
class ThreadFunctionStats:
    count: int = 0
    sum: int = 0  # bytes (0 for free, as MALT writes it)
    time: int = 0  # ticks spent inside the function, entry to return


@dataclass
class MaltThread:
    tid: int
    stats: dict[str, ThreadFunctionStats] = field(default_factory=dict)  # by MALT_FUNCTIONS name
    cnt_mem_ops: int | None = None  # None: the sum of the functions' counts

    @property
    def mem_ops(self) -> int:
        return self.cnt_mem_ops if self.cnt_mem_ops is not None else sum(s.count for s in self.stats.values())


@dataclass
class MaltRun:
    exe: str
    command: str
    hostname: str
    allocator: str  # path of the object whose malloc the target uses
    date: str  # profile generation time, "YYYY-MM-DD HH:MM"
    runtime: int  # ticks from start to profile dump
    tool: str = f"heapscope-{__version__}"


@dataclass
class MaltConfig:
    """What heapscope was asked to do, in MALT's config sections."""

    points: int = DEFAULT_POINTS
    time_enabled: bool = True
    stack_enabled: bool = True
    stack_mode: str = "ebpf"
    output_name: str = ""
    mmap: bool = False  # the profile has the stacks of mmap and munmap calls
    mode: str = "exact"  # heapscope's mode: exact (every call) or sampled (estimates from Poisson samples)
    sample_rate: int = 0  # sampled: the mean bytes between samples
    exact: tuple[str, ...] = ()  # sampled: the figures that are exact counts all the same (JSON paths)


@dataclass
class MaltGlobals:
    ticks_per_second: int
    total_memory: int = 0
    free_memory_at_start: int = 0
    cached_memory_at_start: int = 0
    max_thread_count: int = 0


@dataclass
class MaltTotals:
    """Run totals from the kernel's global counters (kept apart from the per-stack maps, so that the two can
    be cross-checked). Allocations count every call that returned a block, zero sizes included."""

    alloc_count: int = 0
    alloc_bytes: int = 0
    free_count: int = 0
    free_bytes: int = 0
    peak_bytes: int = 0  # the global peak of requested (live) bytes
    mmap_count: int = 0
    mmap_bytes: int = 0


@dataclass(frozen=True)
class GlobalVariable:
    """One global or thread-local variable of an ELF object (agent.symbols.globalvars reads them), for MALT's
    `memStats.globalVariables`."""

    name: str  # demangled, without `@VERSION`
    size: int  # bytes (one copy; a TLS variable has one per thread)
    tls: bool
    section: str  # .data, .bss, .tdata or .tbss
    symbol: str  # the symbol name as stored
    offset: int  # st_value: the link-time address (for TLS: the offset in the TLS block)
    section_offset: int  # sh_offset of the section in the file (MALT 1.6's `secOffset`)
    binary: str  # path of the ELF object


@dataclass
class MaltProfile:
    run: MaltRun
    globals: MaltGlobals
    totals: MaltTotals = field(default_factory=MaltTotals)
    config: MaltConfig = field(default_factory=MaltConfig)
    stacks: list[MaltStack] = field(default_factory=list)
    # Runtime address of each allocation function in the target: the leaf frame of its stacks.
    function_addresses: dict[str, int] = field(default_factory=dict)
    mappings: Sequence[ProcMapping] = ()
    size_map: dict[int, int] = field(default_factory=dict)  # requested size -> number of allocations
    realloc_jump: dict[tuple[int, int], int] = field(default_factory=dict)  # (old, new) -> count
    global_variables: Mapping[str, Sequence[GlobalVariable]] = field(default_factory=dict)
    threads: list[MaltThread] = field(default_factory=list)
    memory_timeline: TimelineSeries = field(default_factory=lambda: TimelineSeries.empty(MEMORY_FIELDS))
    system_timeline: TimelineSeries = field(default_factory=lambda: TimelineSeries.empty(SYSTEM_FIELDS))
    memory_bandwidth: TimelineSeries = field(default_factory=lambda: TimelineSeries.empty(BANDWIDTH_FIELDS))
    size_over_time: ScatterChart = field(default_factory=ScatterChart.size_over_time)
    lifetime_over_size: ScatterChart = field(default_factory=ScatterChart.lifetime_over_size)
    leaks: list[MaltLeak] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------
# Cross-checks


def check_consistency(profile: MaltProfile) -> list[str]:
    """What does not add up in a profile; empty when consistent.

    - the stacks' alloc.sum add up to the allocated bytes, and alloc.count + countZeros to the allocations;
    - sizeMap's counts add up to the number of allocations;
    - every count/min/max/sum is coherent, 0 <= aliveReq <= maxAliveReq;
    - the leaks add up to the stacks' aliveReq.
    """
    problems: list[str] = []
    totals = profile.totals
    alloc_sum = sum(s.stats.alloc.sum for s in profile.stacks)
    if alloc_sum != totals.alloc_bytes:
        problems.append(f"the stacks' alloc.sum add up to {alloc_sum}, the allocated bytes are {totals.alloc_bytes}")
    n_allocs = sum(s.stats.alloc.count + s.stats.count_zeros for s in profile.stacks)
    if n_allocs != totals.alloc_count:
        problems.append(
            f"the stacks' alloc.count + countZeros add up to {n_allocs}, the allocations are {totals.alloc_count}"
        )
    size_map_count = sum(profile.size_map.values())
    if size_map_count != totals.alloc_count:
        problems.append(f"sizeMap counts add up to {size_map_count}, the allocations are {totals.alloc_count}")
    if any(size < 0 or n < 0 for size, n in profile.size_map.items()):
        problems.append("sizeMap has a negative size or count")
    for i, s in enumerate(profile.stacks):
        what = f"stack {i} ({s.key.function})"
        st = s.stats
        for name in ("alloc", "free", "lifetime", "mmap", "munmap"):
            problems.extend(getattr(st, name).problems(f"{what} {name}"))
        if st.alloc.count and st.alloc.min == 0:
            problems.append(f"{what}: alloc counts a zero size (zero sizes belong in countZeros)")
        if not 0 <= st.alive_req <= st.max_alive_req:
            problems.append(f"{what}: aliveReq {st.alive_req} is not within [0, maxAliveReq {st.max_alive_req}]")
        if st.max_alive_req > st.alloc.sum:
            problems.append(f"{what}: maxAliveReq {st.max_alive_req} exceeds alloc.sum {st.alloc.sum}")
        if st.global_peak < 0 or st.global_peak > st.max_alive_req:
            problems.append(f"{what}: globalPeak {st.global_peak} is not within [0, maxAliveReq]")
    alive = sum(s.stats.alive_req for s in profile.stacks)
    leaked = sum(lk.memory for lk in profile.leaks)
    if alive != leaked:
        problems.append(f"the leaks add up to {leaked} bytes, the stacks' aliveReq to {alive}")
    return problems

