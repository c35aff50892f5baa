"""What is growing: each site's trend over a window of its live bytes, a verdict per site, and the process's heap
set against its mapped memory and RSS. Pure (numpy): agent.offline.growth reads the series from the store; the
command line, the daemon's API, its metrics and its web page show what is decided here.

The window is W seconds, read at m points t_0 < ... < t_end (at most MAX_POINTS; the reader spreads them over
the window). Each site has its live bytes L at those points.

- **bytes_per_s**: Theil-Sen's slope of L, the median of the slopes between every two points. A sawtooth or a
  burst moves it little, where a least-squares line follows them. With at most MAX_POINTS points a site costs
  at most MAX_POINTS^2 / 2 slopes however long the window: a day of 10,000 sites is 11 million slopes.
- **kept level**: K(t) = the least L from t to the end of the window, the bytes the site held at t and never gave
  back since. For a leak K = L; for a sawtooth K stays at its lowest trough until the last one.
- **steadiness**: the share of SUBWINDOWS equal sub-windows in which the kept level rose by more than the
  tolerance (K at the sub-window's end above K at its start): steady growth made of blocks that stay. A leak
  scores 1; a cache that filled then stopped scores the share of the window it filled in; a sawtooth, only its
  last tooth.
- **age_s**: the bytes-weighted mean age of the live bytes at the end, read from the kept level: the bytes K
  gained between two points count from the middle of those points, those it had at t_0 count the whole
  window (so it is at most W). The store keeps no block's allocation time: a site that replaces its blocks at
  a steady level keeps that level, and its bytes count as old.
- **tolerance**: a change of at most TOLERANCE (0.1%) of the most the site held in the window, and at least one
  byte, is no change.
- **samples** (sampled mode): how many samples were taken at the site over the window, estimated from the
  blocks it allocated there (a sample stands for 1/p blocks of its size, p = 1 - e^(-size/rate)).
- **verdict**, the first that applies:
  1. *flat*: L stayed within the tolerance.
  2. *too few samples* (sampled mode): fewer than MIN_SAMPLES samples at the site over the window, and blocks
     smaller than the rate (a block of the rate or more is always sampled: its figures are exact).
  3. *grew then stopped*: it added more than the tolerance over the window, and over the last TAIL (quarter) of
     it moved by no more than the tolerance or STOPPED_SHARE (5%) of its range over the window: a cache that
     filled (and may replace its entries since).
  4. *leak suspect*: its slope over the window makes at least half of its range (the trend, not a rise and
     fall, is what moved it) and more than the tolerance, and its steadiness is at least STEADY (6 sub-windows
     of 8).
  5. *growing*: it added more than the tolerance, and its slope over the window makes at least half of its
     range (or it never fell), but not steadily: in bursts, or only lately.
  6. *shrinking*: it lost more than the tolerance, and its falling slope makes at least half of its range.
  7. *churn*: it rose and fell with no trend (a sawtooth, a pool, a sawtooth caught high).
- **ranking**: suspects first, then the others, each by the bytes added over the window, most first.

The process as a whole: the useful heap, the mapped total and RSS each *grow*, are *flat* or *shrink* (their
slope and their net change both beyond PROCESS_TOLERANCE of their largest value, and at least PROCESS_MIN_B), and
the verdict sets them against each other: "the heap is flat but RSS grows" (memory outside malloc, or freed
memory the allocator keeps) is said as such.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_WINDOW_S = 600.0  # the daemon's window for /growth, its metrics and its page
MAX_POINTS = 48  # points of a window: 1,128 slopes a site
SUBWINDOWS = 8
STEADY = 0.75  # share of sub-windows in which the kept level rose, for a leak suspect
TAIL = 0.25  # the last part of the window, flat for "grew then stopped"
TOLERANCE = 0.001  # of the most a site held in the window
STOPPED_SHARE = 0.05  # of a site's range over the window: what its last part may move once it stopped
MIN_SAMPLES = 32  # sampled mode: fewer samples at a site over the window than this cannot be judged
PROCESS_TOLERANCE = 0.02  # of a process line's largest value
PROCESS_MIN_B = 256 << 10  # RSS moves by pages as a matter of course

LEAK = "leak suspect"
STOPPED = "grew then stopped"
GROWING = "growing"
CHURN = "churn"
SHRINKING = "shrinking"
FLAT = "flat"
FEW = "too few samples"
VERDICTS = (LEAK, STOPPED, GROWING, CHURN, SHRINKING, FLAT, FEW)

_CHUNK = 1 << 21  # slopes computed at once (8 MiB of float32)


@dataclass(frozen=True)
class Sampling:
    """Sampled mode's figures for the sites: the blocks and bytes each allocated over the window (estimates),
    and the sample rate."""

    rate: int
    alloc_blocks: np.ndarray  # (n,)
    alloc_bytes: np.ndarray  # (n,)


@dataclass(frozen=True)
class Trends:
    """Every site's figures, one array entry a site (the rows of the series judged)."""

    bytes_per_s: np.ndarray
    steadiness: np.ndarray
    age_s: np.ndarray
    added_B: np.ndarray
    live_B: np.ndarray
    verdict: np.ndarray  # index into VERDICTS
    samples: np.ndarray | None  # sampled mode: samples taken at the site over the window

    @property
    def suspect(self) -> np.ndarray:
        return self.verdict == VERDICTS.index(LEAK)

    def ranked(self) -> np.ndarray:
        """Site rows, suspects first, then by bytes added over the window (most first)."""
        return np.lexsort((-self.added_B, ~self.suspect))

    def counts(self) -> dict[str, int]:
        got = np.bincount(self.verdict, minlength=len(VERDICTS))
        return {v: int(n) for v, n in zip(VERDICTS, got, strict=True)}


def thin(m: int, most: int = MAX_POINTS) -> np.ndarray:
    """At most `most` indices of 0..m-1, evenly spread, the first and the last among them."""
    if m <= most:
        return np.arange(m)
    return np.unique(np.linspace(0, m - 1, most).round().astype(np.int64))


def theil_sen(times: np.ndarray, series: np.ndarray) -> np.ndarray:
    """The median of the pairwise slopes of each row of `series` (n, m) over `times` (m,), in units a second.
    More than MAX_POINTS points are thinned first, so a row costs at most MAX_POINTS^2 / 2 slopes."""
    t = np.asarray(times, dtype=np.float64)
    y = np.asarray(series, dtype=np.float64)
    keep = thin(len(t))
    t, y = t[keep], y[:, keep]
    n = y.shape[0]
    out = np.zeros(n)
    i, j = np.triu_indices(len(t), 1)
    dt = t[j] - t[i]
    pos = dt > 0
    i, j, dt = i[pos], j[pos], dt[pos]
    if not len(dt) or not n:
        return out
    moving = np.flatnonzero(y.max(axis=1) != y.min(axis=1))  # a constant row's slope is 0
    rows = max(1, _CHUNK // len(dt))
    half = len(dt) // 2
    mid = [half - 1, half] if len(dt) % 2 == 0 else [half]
    dt32 = dt.astype(np.float32)
    for start in range(0, len(moving), rows):
        r = moving[start : start + rows]
        yr = y[r]
        # float32: half the memory traffic, and 7 digits are plenty for a rate (the differences are exact in
        # float64 first)
        slopes = (yr[:, j] - yr[:, i]).astype(np.float32) / dt32
        slopes.partition(mid, axis=1)  # in place: np.median would copy them first
        out[r] = slopes[:, mid].astype(np.float64).mean(axis=1)
    return out


def _at(times: np.ndarray, moments: np.ndarray) -> np.ndarray:
    """The point in effect at each moment: the last at or before it (a stored history is a step)."""
    return np.clip(np.searchsorted(times, moments, side="right") - 1, 0, len(times) - 1)


def kept_level(series: np.ndarray) -> np.ndarray:
    """K[:, k] = the least of series[:, k:]: what each row held at point k and still held at every later one."""
    return np.minimum.accumulate(series[:, ::-1], axis=1)[:, ::-1]


def judge(times: np.ndarray, series: np.ndarray, sampling: Sampling | None = None) -> Trends:
    """The figures and verdicts of every row of `series` (n sites, m points of live bytes) at `times` (m seconds,
    increasing). See the module's docstring for how each is decided."""
    t = np.asarray(times, dtype=np.float64)
    y = np.maximum(np.asarray(series, dtype=np.float64), 0.0)
    n, m = y.shape
    if m != len(t) or m < 1:
        raise ValueError(f"{m} points of series for {len(t)} times")
    span = float(t[-1] - t[0])
    slope = theil_sen(t, y) if m > 1 else np.zeros(n)
    trend = slope * span
    first, last = y[:, 0], y[:, -1]
    added = last - first
    peak = y.max(axis=1)
    tol = np.maximum(TOLERANCE * peak, 1.0)
    spread = peak - y.min(axis=1)
    moved = spread > tol
    kept = kept_level(y)
    bounds = _at(t, t[0] + span * np.arange(SUBWINDOWS + 1) / SUBWINDOWS)
    rises = np.diff(kept[:, bounds], axis=1) > tol[:, None]
    steadiness = rises.mean(axis=1) if span > 0 else np.zeros(n)
    tail = t >= t[-1] - TAIL * span
    tail[_at(t, np.array([t[-1] - TAIL * span]))[0]] = True  # the level in effect where the tail starts
    tail_range = y[:, tail].max(axis=1) - y[:, tail].min(axis=1)
    fell = np.maximum.accumulate(y, axis=1) - y  # how far below its highest so far, at each point
    ever_fell = fell.max(axis=1) > tol
    age = _age(t, kept)

    verdict = np.full(n, VERDICTS.index(CHURN), dtype=np.int64)
    undecided = moved.copy()

    def decide(mask: np.ndarray, name: str) -> None:
        hit = undecided & mask
        verdict[hit] = VERDICTS.index(name)
        undecided[hit] = False

    verdict[~moved] = VERDICTS.index(FLAT)
    samples = None
    if sampling is not None:
        samples = _samples(sampling)
        blocks = np.maximum(sampling.alloc_blocks, 1)
        small = sampling.alloc_bytes / blocks < sampling.rate
        decide((samples < MIN_SAMPLES) & small, FEW)
    grew = added > tol
    decide(grew & (tail_range <= np.maximum(tol, STOPPED_SHARE * spread)), STOPPED)
    dominant = np.maximum(tol, spread / 2)  # a slope that makes most of the movement
    decide((trend >= dominant) & (steadiness >= STEADY), LEAK)
    decide(grew & ((trend >= dominant) | ~ever_fell), GROWING)
    decide((added < -tol) & (-trend >= dominant), SHRINKING)
    return Trends(bytes_per_s=slope, steadiness=steadiness, age_s=age, added_B=added, live_B=last,
                  verdict=verdict, samples=samples)


def _age(t: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Bytes-weighted mean age at the end of the bytes of the kept level (see the module's docstring)."""
    end = t[-1]
    gained = np.diff(kept, axis=1)  # >= 0: the kept level never falls
    born = (t[1:] + t[:-1]) / 2
    total = kept[:, 0] * (end - t[0]) + gained @ (end - born)
    live = kept[:, -1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(live > 0, total / np.where(live > 0, live, 1.0), 0.0)


def _samples(s: Sampling) -> np.ndarray:
    """Samples taken at each site: its estimated blocks times the chance that a block of its mean size is
    sampled."""
    blocks = np.maximum(np.asarray(s.alloc_blocks, dtype=np.float64), 0.0)
    size = np.asarray(s.alloc_bytes, dtype=np.float64) / np.maximum(blocks, 1.0)
    p = np.where(size >= s.rate, 1.0, -np.expm1(-size / s.rate))
    return blocks * p


# ---- the process ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineTrend:
    """One of the process's lines over the window: heap, mapped or RSS."""

    start_B: int
    end_B: int
    bytes_per_s: float
    trend: str  # grows, flat or shrinks

    def to_json(self) -> dict[str, object]:
        return {"start_B": self.start_B, "end_B": self.end_B, "bytes_per_s": round(self.bytes_per_s, 1),
                "trend": self.trend}


def line_trend(times: np.ndarray, values: Sequence[int | None]) -> LineTrend | None:
    """The trend of a process line; None when it was not measured at every point."""
    if not values or any(v is None for v in values):
        return None
    t = np.asarray(times, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    slope = float(theil_sen(t, y[None, :])[0]) if len(t) > 1 else 0.0
    span = float(t[-1] - t[0])
    tol = max(PROCESS_TOLERANCE * float(np.abs(y).max()), PROCESS_MIN_B)
    net = float(y[-1] - y[0])
    trend = "flat"
    if slope * span > tol and net > tol:
        trend = "grows"
    elif slope * span < -tol and net < -tol:
        trend = "shrinks"
    return LineTrend(int(y[0]), int(y[-1]), slope, trend)


@dataclass(frozen=True)
class ProcessGrowth:
    heap: LineTrend
    mapped: LineTrend | None
    rss: LineTrend | None
    verdict: str  # heap grows, grows outside the heap, heap shrinks, flat
    said: str  # the verdict in a sentence

    def to_json(self) -> dict[str, object]:
        return {"verdict": self.verdict, "said": self.said, "heap": self.heap.to_json(),
                "mapped": None if self.mapped is None else self.mapped.to_json(),
                "rss": None if self.rss is None else self.rss.to_json()}


def bytes_text(n: float) -> str:
    """`1.2 MiB`, `-300 B`."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def rate_text(bytes_per_s: float) -> str:
    """`1.2 MiB/s`, `-300 B/s`."""
    return bytes_text(bytes_per_s) + "/s"


def judge_process(heap: LineTrend, mapped: LineTrend | None, rss: LineTrend | None,
                  estimate: bool = False) -> ProcessGrowth:
    """The process's verdict: what grows, the heap or memory beside it."""
    the_heap = "the heap (estimated)" if estimate else "the heap"
    outside = [(name, line) for name, line in (("RSS", rss), ("mapped memory", mapped))
               if line is not None and line.trend == "grows"]
    grows = ", ".join(f"{name} by {rate_text(line.bytes_per_s)}" for name, line in outside)
    if heap.trend == "grows":
        follows = f"; {grows}" if outside else ("; RSS does not follow (yet)" if rss is not None else "")
        return ProcessGrowth(heap, mapped, rss, "heap grows",
                             f"{the_heap} grows by {rate_text(heap.bytes_per_s)}{follows}")
    if outside:
        state = "flat" if heap.trend == "flat" else "shrinking"
        if mapped is not None and mapped.trend == "grows":
            why = "memory mapped outside malloc (mmap of its own, thread stacks, a leak outside malloc)"
        else:
            why = ("within memory already mapped: freed memory the allocator keeps (fragmentation), or pages "
                   "mapped earlier being touched")
        first = "RSS" if rss is not None and rss.trend == "grows" else "mapped memory"
        return ProcessGrowth(heap, mapped, rss, "grows outside the heap",
                             f"{the_heap} is {state} but {first} grows ({grows}): {why}")
    if heap.trend == "shrinks":
        return ProcessGrowth(heap, mapped, rss, "heap shrinks",
                             f"{the_heap} shrinks by {rate_text(-heap.bytes_per_s)}")
    return ProcessGrowth(heap, mapped, rss, "flat", f"{the_heap}, mapped memory and RSS are flat")


# ---- the report -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteGrowth:
    """One site's row of the report."""

    site: str  # `fn (file:line)`
    stack: tuple[str, ...]  # its biggest stack: the site, then its callers outwards
    bytes_per_s: float
    steadiness: float
    age_s: float
    added_B: int
    live_B: int
    verdict: str
    samples: int | None  # sampled mode: samples taken at the site over the window
    line: tuple[int, ...]  # live bytes at the report's points

    @property
    def suspect(self) -> bool:
        return self.verdict == LEAK

    def to_json(self) -> dict[str, object]:
        return {
            "site": self.site, "verdict": self.verdict, "suspect": self.suspect,
            "bytes_per_s": round(self.bytes_per_s, 1), "steadiness": round(self.steadiness, 3),
            "age_s": round(self.age_s, 1), "added_B": self.added_B, "live_B": self.live_B,
            "samples": self.samples, "stack": list(self.stack), "line": list(self.line),
        }


@dataclass(frozen=True)
class GrowthReport:
    """What is growing in one process over a window of its stored history."""

    pid: int
    cmd: str
    mode: str  # exact, or sampled (the bytes are estimates)
    sample_rate: int  # 1 in exact mode
    start_wall_ns: int
    end_wall_ns: int
    times_s: tuple[float, ...]  # the points, seconds from the window's start
    process: ProcessGrowth
    sites: tuple[SiteGrowth, ...]  # the top sites, ranked
    n_sites: int  # sites judged
    counts: Mapping[str, int]  # sites of each verdict, of all judged
    snapshots: int  # stored snapshots in the window
    rest_bytes_per_s: float = 0.0  # the sites not listed, their slopes summed
    notes: tuple[str, ...] = field(default=())

    @property
    def window_s(self) -> float:
        return (self.end_wall_ns - self.start_wall_ns) / 1e9

    @property
    def suspects(self) -> int:
        return self.counts.get(LEAK, 0)

    def to_json(self) -> dict[str, object]:
        return {
            "pid": self.pid, "cmd": self.cmd, "mode": self.mode, "sample_rate": self.sample_rate,
            "window_s": round(self.window_s, 3), "start_wall_ns": self.start_wall_ns,
            "end_wall_ns": self.end_wall_ns, "snapshots": self.snapshots, "points": len(self.times_s),
            "times_s": [round(t, 3) for t in self.times_s], "process": self.process.to_json(),
            "n_sites": self.n_sites, "counts": dict(self.counts), "suspects": self.suspects,
            "sites": [s.to_json() for s in self.sites], "rest_bytes_per_s": round(self.rest_bytes_per_s, 1),
            "notes": list(self.notes),
        }
