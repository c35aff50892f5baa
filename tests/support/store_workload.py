"""A synthetic, seeded allocation workload for the store's tests and bench: many sites, each with one block
size (the common case) or a few, allocating and freeing a random (Poisson) number of blocks every step.

The same seed gives the same samples in any process, so a test can check what another process wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from agent.model.stack import Frame, SiteCounts, Stack
from agent.store import StoreMeta, StoreWriter, SyncPolicy
from agent.store.sample import PeakState, StoreSample

EXTRA_PER_BLOCK = 8
S = 1_000_000_000


def site_stack(i: int, depth: int = 6) -> Stack:
    """A distinct stack per site: its own allocation site, then a shared path of callers to main."""
    own = Frame(0x401000 + 16 * i, f"alloc_site_{i}", "sites.c", 100 + i % 500, "/opt/app/bin/app", "/src/sites.c")
    callers = tuple(
        Frame(0x402000 + 64 * level + (i >> (2 * level)) % 4, f"layer_{level}_{(i >> (2 * level)) % 4}", "sites.c",
              20 + level, "/opt/app/bin/app", "/src/sites.c")
        for level in range(depth - 2)
    )
    return (own, *callers, Frame(0x401000, "main", "main.c", 9, "/opt/app/bin/app", "/src/main.c"))


@dataclass
class Workload:
    n_sites: int = 1000
    rate: float = 5.0  # mean allocations per site per step
    seed: int = 1
    varied_every: int = 10  # every Nth site allocates three different sizes, the rest one size
    new_sites_per_step: int = 0  # sites that appear after the first step (0: all from the start)
    step_s: float = 1.0
    start_ns: int = 1_700_000_000_000_000_000

    def samples(self, steps: int) -> Iterator[tuple[StoreSample, dict[Stack, SiteCounts]]]:
        """(sample, the expected sites() of the snapshot it makes) per step."""
        rng = np.random.default_rng(self.seed)
        n = self.n_sites
        size = 16 + 8 * (np.arange(n) % 64)
        varied = np.arange(n) % self.varied_every == 0
        tot_bk = np.zeros(n, np.int64)
        tot_b = np.zeros(n, np.int64)
        frd_bk = np.zeros(n, np.int64)
        frd_b = np.zeros(n, np.int64)
        cur_sizes: list[list[int]] = [[] for _ in range(n)]  # live block sizes of the varied sites
        stacks = {i: site_stack(i) for i in range(n)}
        peak: PeakState | None = None
        peak_cur = np.zeros(n, np.int64)
        peak_x = np.zeros(n, np.int64)
        active = n if not self.new_sites_per_step else max(1, n // 2)
        given = 0
        for step in range(steps):
            allocs = rng.poisson(self.rate, n)
            allocs[active:] = 0
            live = tot_bk - frd_bk
            frees = np.minimum(live, rng.poisson(self.rate * 0.98, n))
            for i in np.flatnonzero(varied & ((allocs > 0) | (frees > 0))):
                got = [int(size[i] * (1 + rng.integers(0, 3))) for _ in range(int(allocs[i]))]
                cur_sizes[i].extend(got)
                tot_b[i] += sum(got)
                gone = [cur_sizes[i].pop(0) for _ in range(int(frees[i]))]
                frd_b[i] += sum(gone)
            plain = ~varied
            tot_b[plain] += allocs[plain] * size[plain]
            frd_b[plain] += frees[plain] * size[plain]
            tot_bk += allocs
            frd_bk += frees
            cur_bk = tot_bk - frd_bk
            cur_b = tot_b - frd_b
            cur_x = cur_bk * EXTRA_PER_BLOCK
            heap = int(cur_b.sum())
            extra = int(cur_x.sum())
            wall = self.start_ns + int(step * self.step_s * 1e9)
            t_ms = int(step * self.step_s * 1000)
            if peak is None or heap + extra > peak.total_B:
                peak = PeakState(t_ms, heap, extra, 0, wall)
                peak_cur, peak_x = cur_b.copy(), cur_x.copy()
            new_stacks = {i: stacks[i] for i in range(given, active)}
            given = active
            sites = {
                i: SiteCounts(
                    cur_bytes=int(cur_b[i]), cur_blocks=int(cur_bk[i]), tot_bytes=int(tot_b[i]),
                    tot_blocks=int(tot_bk[i]), freed_bytes=int(frd_b[i]), freed_blocks=int(frd_bk[i]),
                    peak_bytes=int(peak_cur[i]), cur_extra=int(cur_x[i]), peak_extra=int(peak_x[i]),
                )
                for i in range(active)
            }
            sample = StoreSample(
                wall_ns=wall, time=t_ms, heap_B=heap, extra_B=extra, stacks_B=0, sites=sites,
                new_stacks=new_stacks, mapped_B=heap * 2 + 4096, rss_B=heap + (1 << 20), peak=peak,
            )
            expected = {stacks[i]: replace(c) for i, c in sites.items()}
            yield sample, expected
            active = min(n, active + self.new_sites_per_step)


# A stored history for the offline commands' tests (report, diff, view).

META = StoreMeta(pid=4242, cmd="./app --serve", desc=("--threshold=0.5",),
                 options={"depth": 30, "threshold": 0.5, "max_snapshots": 100, "detailed_freq": 10})


def make_store(root: Path, steps: int = 400, n_sites: int = 200) -> Workload:
    """A store of process 4242 under `root` holding `steps` samples of the workload; the workload."""
    wl = Workload(n_sites=n_sites, start_ns=1_800_000_000 * S)
    with StoreWriter(root / "4242", META, sync=SyncPolicy("never"), checkpoint_every=50) as w:
        for sample, _ in wl.samples(steps):
            w.append(sample)
    return wl


def iso_of(ns: int) -> str:
    return datetime.fromtimestamp(ns / S).astimezone().isoformat(timespec="seconds")
