"""Poisson sampling by bytes: which allocations a sampler reports, and what each report stands for.

Pure Python (no I/O, no bcc). The in-process sampler (probes/sampler/hs_sampler.c) follows the same rule:
every thread counts bytes down from a distance drawn from an exponential distribution with mean T (the
sample rate); an allocation of s < T bytes that crosses it is sampled, and the next distance is drawn
afresh from the end of that allocation. Because the exponential has no memory, each allocation of s < T
bytes is sampled independently with probability p(s) = 1 - e^(-s/T). Allocations of T bytes or more are
always sampled (p = 1) and do not move the counter.

Weighting each sample by 1/p (Horvitz-Thompson, as Go's `scaleHeapSample` does) makes every sum an unbiased
estimate: a sampled block of s bytes stands for s/p bytes and 1/p blocks. Weight each sample first, then sum.
The relative standard error of a site's bytes is about 1/sqrt(samples at that site) when its blocks are
small beside T; `SiteEstimate.relative_stderr` gives the figure estimated from the samples themselves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Literal

DEFAULT_SAMPLE_RATE = 524288  # bytes: jemalloc's lg_prof_sample 19, Go's MemProfileRate, gperftools' advice
MAX_SAMPLE_RATE = 1 << 40  # the sampler (probes/sampler/hs_sampler.c) refuses more
# The sampling budget: samples a second a process may take before its sampler raises the rate in force (0: none).
# A sample costs the service 8-20 us (two probe hits and two stack walks: docs/benchmarks.md), so 500 a second
# bound its cost to about 1% of a core, whatever it allocates; a service under that keeps the asked rate. Each
# sample keeps the weight of the rate it was drawn at, so the estimates stay unbiased (JFR throttles so too).
DEFAULT_MAX_SAMPLES = 500
MAX_MAX_SAMPLES = 1 << 32
# A daemon's total: the samples a second all its sampled targets take together (--total-samples), 500 a CPU by
# default, so that a prefork server's forty workers cost what one process at its budget costs a CPU, not forty
# times it. The daemon shares it max-min fairly (share_level) and moves each sampler's budget to the share.
DEFAULT_TOTAL_SAMPLES_PER_CPU = 500
# No target's share goes below this many samples a second: a busy worker among hundreds still shows its stacks
# (the total is then exceeded, and said).
MIN_SHARE = 10

Mode = Literal["exact", "sampled"]
MODES: tuple[Mode, ...] = ("exact", "sampled")
ESTIMATE_NOTE = "(sampled: heap sizes are estimates)"

# The kernel's tables for each mode when --max-blocks / --max-stacks are not given. Exact mode tracks every live
# block. Sampled mode tracks only the sampled ones, about heap / rate (2 per MiB of heap at the default rate:
# 65,536 cover a 32 GiB heap), and meets far fewer distinct stacks; its tables are what a target holds in the
# kernel however quiet it is (the site array is allocated whole: 200 bytes a site), so a daemon watching a
# fleet in the default mode keeps them small. A full table is counted and reported, never silent.
DEFAULT_CAPACITY: dict[Mode, tuple[int, int]] = {  # mode -> (max blocks, max stacks)
    "exact": (1 << 20, 1 << 16),
    "sampled": (1 << 16, 1 << 14),
}
# A daemon's exact-mode targets share one block table (probes/bpf/blocks.h): room for two targets at their limit,
# 80 MB of kernel memory however many targets there are; and each keeps half the sites a command's target does
# (13 MB of the kernel's a target at 65,536: agent.session.pipeline).
DEFAULT_NODE_BLOCKS = 2 << 20
# A daemon keeps a program shape loaded this long after its last target: a fleet's restarts and recycled workers,
# and repeated attaches, find it loaded (its compile and verification cost seconds of CPU; its maps, ~40 MB sampled
# and ~130 MB exact, stay meanwhile).
DEFAULT_KEEP_PROGRAMS = 600.0
DAEMON_EXACT_STACKS = 1 << 15


@dataclass(frozen=True)
class ProfileMode:
    """How a profile counts: every call (exact, Massif's figures) or a Poisson sample by bytes at `rate`
    (sampled: every byte and block figure is an estimate; the call counts the sampler keeps are exact)."""

    mode: Mode = "exact"
    rate: int = DEFAULT_SAMPLE_RATE
    max_samples: int = DEFAULT_MAX_SAMPLES  # sampled: the budget, samples a second a process (0: none)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        validate_rate(self.rate)
        if self.rate > MAX_SAMPLE_RATE:
            raise ValueError(f"sample rate must be at most {MAX_SAMPLE_RATE} bytes, not {self.rate}")
        if isinstance(self.max_samples, bool) or not 0 <= self.max_samples <= MAX_MAX_SAMPLES:
            raise ValueError(f"max samples must be from 0 to {MAX_MAX_SAMPLES} a second, not {self.max_samples!r}")

    @property
    def sampled(self) -> bool:
        return self.mode == "sampled"

    @property
    def max_blocks(self) -> int:
        """Live blocks the kernel tracks by default: every live block (exact), the sampled ones (sampled)."""
        return DEFAULT_CAPACITY[self.mode][0]

    @property
    def max_stacks(self) -> int:
        """Distinct allocation stacks the kernel keeps by default."""
        return DEFAULT_CAPACITY[self.mode][1]

    @property
    def period(self) -> int:
        """The mean bytes between counted allocations: the rate when sampled, 1 when every call counts."""
        return self.rate if self.sampled else 1

    def desc(self) -> tuple[str, ...]:
        """What massif.out's desc: line says of the mode (ms_print shows it as Massif's arguments)."""
        if not self.sampled:
            return ("--mode=exact",)
        return ("--mode=sampled", f"--sample-rate={self.rate}", f"--max-samples={self.max_samples}", ESTIMATE_NOTE)

    def label(self) -> str:
        """One line for a person: the summary, logs."""
        if not self.sampled:
            return "exact mode: every allocation call counted"
        return (f"sampled mode, one sample per {self.rate} bytes on average{self.budget_text()}: heap bytes and "
                "blocks are estimates, call counts exact")

    def budget_text(self) -> str:
        """The budget, for a line that gives the rate: "" without one."""
        return f" (at most {self.max_samples} a second: the rate rises to keep it)" if self.max_samples else ""


def validate_rate(rate: int) -> int:
    """The rate as the sampler takes it: a positive whole number of bytes."""
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
        raise ValueError(f"sample rate must be a positive number of bytes, not {rate!r}")
    return rate


def sample_probability(size: int, rate: int) -> float:
    """P(an allocation of `size` bytes is sampled) at mean distance `rate` between samples."""
    if size >= rate:
        return 1.0
    if size <= 0:
        return 0.0
    return -math.expm1(-size / rate)  # 1 - e^(-s/T) without cancellation for s << T


def weight_blocks(size: int, rate: int) -> float:
    """How many blocks one sampled block of `size` bytes stands for: 1/p."""
    p = sample_probability(size, rate)
    if p == 0.0:
        raise ValueError("an allocation of 0 bytes is never sampled, so it has no weight")
    return 1.0 if size >= rate else 1.0 / p


def weight_bytes(size: int, rate: int) -> float:
    """How many bytes one sampled block of `size` bytes stands for: s/p (exactly s at or above the rate)."""
    return float(size) if size >= rate else size * weight_blocks(size, rate)


def weight_hint(size: int, rate: int) -> int:
    """The byte weight the in-process sampler passes with each sample: weight_bytes rounded to an integer.
    (Rounding moves a weight of at least T by at most half a byte.)"""
    return size if size >= rate else math.floor(weight_bytes(size, rate) + 0.5)


def sampling_variance(size: int, rate: int) -> float:
    """Variance of the bytes estimate contributed by ONE allocation of `size` bytes: s^2 (1-p)/p."""
    p = sample_probability(size, rate)
    return 0.0 if p in (0.0, 1.0) else size * size * (1.0 - p) / p


@dataclass
class SiteEstimate:
    """The estimate for one call site (or any group of samples)."""

    samples: int = 0
    bytes: float = 0.0  # estimated bytes
    blocks: float = 0.0  # estimated blocks
    variance: float = 0.0  # unbiased estimate of the variance of `bytes`: sum over samples of s^2 (1-p)/p^2

    @property
    def relative_stderr(self) -> float:
        """Estimated standard error of `bytes`, relative to it (0 when every sample was certain)."""
        return math.sqrt(self.variance) / self.bytes if self.bytes > 0 else math.inf

    def add(self, size: int, rate: int) -> None:
        p = sample_probability(size, rate)
        self.samples += 1
        self.bytes += weight_bytes(size, rate)
        self.blocks += weight_blocks(size, rate)
        if p < 1.0:
            self.variance += size * size * (1.0 - p) / (p * p)


def estimate_sites(samples: Iterable[tuple[Hashable, int]], rate: int) -> dict[Hashable, SiteEstimate]:
    """Per-site estimates from (site, size) samples taken at `rate`."""
    validate_rate(rate)
    sites: dict[Hashable, SiteEstimate] = {}
    for site, size in samples:
        sites.setdefault(site, SiteEstimate()).add(size, rate)
    return sites


class PoissonSampler:
    """One thread's sampling decisions, step for step as hs_sampler.c takes them (the reference the
    Monte Carlo tests check, and a way to replay a size sequence)."""

    def __init__(self, rate: int, rng: random.Random) -> None:
        self.rate = validate_rate(rate)
        self._rng = rng
        self._remaining = self._draw()

    def _draw(self) -> float:
        return self._rng.expovariate(1.0 / self.rate)

    def sample(self, size: int) -> bool:
        """Whether an allocation of `size` bytes is reported."""
        if size >= self.rate:
            return True  # always sampled, at its true size; the countdown is left as it was
        self._remaining -= size
        if self._remaining > 0:
            return False
        self._remaining = self._draw()
        return size > 0


def share_level(demands: Iterable[float], total: float) -> float | None:
    """The level that shares `total` samples a second max-min fairly among targets that would take `demands`
    (samples a second at their asked rates): each wanting less keeps what it wants, each other may take the level,
    and together they take the total. None: together they want no more than the total (nobody is held back)."""
    wants = sorted(max(0.0, d) for d in demands)
    if sum(wants) <= total:
        return None
    left = float(total)
    for i, want in enumerate(wants):
        level = left / (len(wants) - i)
        if want >= level:
            return level
        left -= want
    raise AssertionError("the demands exceed the total, so some want at least the level")


def share_budget(level: float | None, cap: int) -> int:
    """A target's budget under a share's `level` (share_level) and the per-process `cap` (--max-samples, 0: none):
    0 means no budget."""
    if level is None:
        return cap
    share = max(MIN_SHARE, int(level))
    return min(share, cap) if cap else share
