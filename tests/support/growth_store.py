"""Stores of known growth, written with the real StoreWriter, for the growth tests and bench/growth_bench.py: a
steady leak, a cache that fills then stops, a sawtooth, a flat site, and as many churning sites as asked (each
1 + Poisson(4) allocations and as many frees a second, as bench/store_bench.py's workload), with the mapped total
and RSS of a process whose memory outside malloc may grow too.

In sampled mode the counters are what the kernel would keep: each allocation of s bytes is sampled with
p = 1 - e^(-s/rate) and then stands for 1/p blocks (rounded at random, as probes/bpf/sampled.h rounds it); a free
takes back what its block was recorded at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.model.stack import Frame, Stack
from agent.store import Retention, StoreMeta, StoreSample, StoreWriter, SyncPolicy
from tests.support.store_workload import site_stack

S = 1_000_000_000
CHURN_FREE = 0.2
START_NS = 1_800_000_000 * S


def frame(address: int, function: str, line: int) -> Frame:
    return Frame(address, function, "service.c", line, "/opt/app/bin/service", "/src/service.c")


MAIN = Frame(0x401000, "main", "service.c", 200, "/opt/app/bin/service", "/src/service.c")


def stack(function: str, line: int, address: int) -> Stack:
    return (Frame(address - 0x100, "malloc", None, None, "/lib/libc.so.6"), frame(address, function, line),
            frame(address + 0x40, "serve", 150), MAIN)


@dataclass(frozen=True)
class Pattern:
    """A site whose live blocks follow `blocks(t)` (t in seconds from the start), each of `size` bytes."""

    name: str
    stack: Stack
    size: int
    blocks: Callable[[float], int]


def leak(per_s: float, size: int = 1000, name: str = "leak_one", line: int = 40) -> Pattern:
    """`per_s` blocks of `size` bytes a second, never freed."""
    return Pattern(name, stack(name, line, 0x401200 + 0x10 * line), size, lambda t: int(per_s * t))


def cache(per_s: float, stop_s: float, size: int = 10_000) -> Pattern:
    return Pattern("cache_fill", stack("cache_fill", 60, 0x401300), size, lambda t: int(per_s * min(t, stop_s)))


def sawtooth(per_s: float, period_s: float, size: int = 50_000) -> Pattern:
    return Pattern("saw_tooth", stack("saw_tooth", 80, 0x401400), size, lambda t: int(per_s * (t % period_s)))


def flat(n: int, size: int = 4096) -> Pattern:
    return Pattern("flat_table", stack("flat_table", 100, 0x401500), size, lambda t: n)


@dataclass
class GrowthStore:
    """What to write: the patterns, `churn` other sites, `seconds` of 1 Hz snapshots (every `step_s`)."""

    patterns: list[Pattern]
    seconds: int
    churn: int = 0
    step_s: float = 1.0
    rate: int | None = None  # sampled mode at this rate; None: exact
    in_force: int | None = None  # sampled mode: the rate stored as in force (the budget's), if not `rate`
    outside_per_s: int = 0  # bytes a second mapped (and touched) outside malloc
    pid: int = 4242
    start_ns: int = START_NS
    checkpoint_every: int = 100
    segment_seconds: float = 3600.0  # a segment closes when it holds this much history
    seed: int = 5

    def write(self, root: Path) -> Path:
        """The store's process directory, root/<pid>."""
        rng = np.random.default_rng(self.seed)
        pats = self.patterns
        n = len(pats) + self.churn
        size = np.array([p.size for p in pats] + [16 + 8 * (i % 64) for i in range(self.churn)], np.int64)
        stacks = {i: p.stack for i, p in enumerate(pats)}
        stacks.update({len(pats) + i: site_stack(i) for i in range(self.churn)})
        desc: tuple[str, ...] = ("--mode=exact",)
        if self.rate is not None:
            desc = ("--mode=sampled", f"--sample-rate={self.rate}")
        meta = StoreMeta(pid=self.pid, cmd="/opt/app/bin/service", desc=desc, options={"depth": 30},
                         start_wall_ns=self.start_ns)
        # Per site: blocks and bytes allocated and freed (as counted: estimates in sampled mode), and the weights
        # of the live sampled blocks (sampled mode), oldest first.
        tot_bk, tot_b, frd_bk, frd_b = (np.zeros(n, np.int64) for _ in range(4))
        true_live = np.zeros(n, np.int64)
        live_weights: list[list[int]] = [[] for _ in range(n)]
        ids = np.arange(n, dtype=np.int64)
        directory = root / str(self.pid)
        steps = int(self.seconds / self.step_s) + 1
        retention = Retention(max_bytes=None, max_age_s=None, segment_seconds=self.segment_seconds)
        with StoreWriter(directory, meta, sync=SyncPolicy("never"), retention=retention,
                         checkpoint_every=self.checkpoint_every) as w:
            for k in range(steps):
                t = k * self.step_s
                want = np.array([p.blocks(t) for p in pats] + [0] * self.churn, np.int64)
                churn_allocs = np.zeros(n, np.int64)
                churn_allocs[len(pats):] = 1 + rng.poisson(4.0 * self.step_s, self.churn)
                allocs = np.maximum(want - true_live, 0)
                allocs[len(pats):] = churn_allocs[len(pats):]
                frees = np.maximum(true_live - want, 0)
                # each live block of a churning site is freed with a chance of CHURN_FREE a second: a steady
                # level about 5 / CHURN_FREE blocks, as a pool's
                frees[len(pats):] = rng.binomial(true_live[len(pats):], min(1.0, CHURN_FREE * self.step_s))
                true_live += allocs - frees
                if self.rate is None:
                    tot_bk += allocs
                    tot_b += allocs * size
                    frd_bk += frees
                    frd_b += frees * size
                else:
                    self._sampled(rng, allocs, frees, size, live_weights, tot_bk, tot_b, frd_bk, frd_b)
                cur_bk, cur_b = tot_bk - frd_bk, tot_b - frd_b
                heap = int(cur_b.sum())
                counters = np.stack([tot_bk, tot_b, frd_bk, frd_b, cur_bk, cur_b, cur_bk * 8, cur_b, cur_bk * 8])
                outside = int(self.outside_per_s * t)
                wall = self.start_ns + int(t * S)
                sample = StoreSample(
                    wall_ns=wall, time=int(t * 1000), heap_B=heap, extra_B=int(cur_bk.sum()) * 8, stacks_B=0,
                    sites={}, new_stacks=stacks if k == 0 else {}, mapped_B=(64 << 20) + 2 * heap + outside,
                    rss_B=(16 << 20) + heap + outside,
                    rate=None if self.rate is None else self.in_force or self.rate,
                )
                w.append_columns(sample, ids, counters)
        return directory

    def _sampled(self, rng: np.random.Generator, allocs: np.ndarray, frees: np.ndarray, size: np.ndarray,
                 live: list[list[int]], tot_bk: np.ndarray, tot_b: np.ndarray, frd_bk: np.ndarray,
                 frd_b: np.ndarray) -> None:
        assert self.rate is not None
        p = np.where(size >= self.rate, 1.0, -np.expm1(-size / self.rate))
        for i in np.flatnonzero(allocs):
            # which of the site's allocations are sampled, each standing for 1/p blocks rounded at random
            sampled = rng.random(int(allocs[i])) < p[i]
            inv = 1.0 / p[i]
            weights = np.floor(inv + rng.random(int(sampled.sum()))).astype(np.int64)
            marks = np.zeros(int(allocs[i]), np.int64)
            marks[sampled] = weights
            live[i].extend(marks.tolist())
            tot_bk[i] += int(weights.sum())
            tot_b[i] += int(weights.sum()) * int(size[i])
        for i in np.flatnonzero(frees):
            gone = live[i][: int(frees[i])]  # the oldest blocks go first
            del live[i][: int(frees[i])]
            frd_bk[i] += sum(gone)
            frd_b[i] += sum(gone) * int(size[i])
