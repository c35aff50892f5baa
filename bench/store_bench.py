"""The history store on the 10,000-site workload with every site changing at every snapshot.

    python bench/store_bench.py [--sites 10000] [--snapshots 3600] [--day] [--dir DIR] [--keep]

Writes a store of `--snapshots` 1 Hz snapshots (`--day`: 86,400, one real day) with the default writer
settings (sync at most 1 s after a write, 64 MiB segments, a checkpoint every 100 snapshots), then measures:
- bytes per snapshot (deltas, checkpoints, overall) and the projected size of one day at 1 Hz (goal <= 1 GB);
- the write cost per snapshot: append_columns (counters as arrays) and append (10,000 SiteCounts objects);
- reading one snapshot back, cold (a new reader: index, checkpoint, deltas), as columns and as
  dict[Stack, SiteCounts] (goal <= 50 ms);
- `heapscope report` (massif, xtree, json) and `heapscope diff` over the whole store (goal for a day <= 30 s).

Workloads (--workload): `poisson` (default, the harder one): every site allocates 1 + Poisson(4) blocks a
second and frees 1 + Poisson(4) (as many as it has), 90% of the sites with one block size s, 10% with three
(s, 2s, 3s: each block draws its own, and a free frees live blocks drawn at random, so the freed bytes are
those of real blocks); its heap grows slowly, so the peak moves at almost every snapshot. `poisson-mean`: the
same counts, but a three-size site's blocks of one second all take one size, and its frees free the mean
live size each (bytes no block has: the workload of the figures before subversion 3). `sites-c`:
bench/sites.c's traffic (round-robin over the sites, one size per site, a ring of 4,096 live blocks),
300,000 allocations a second.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.offline import commands
from agent.store import PeakState, StoreMeta, StoreReader, StoreSample, StoreWriter
from agent.store.files import segment_paths
from tests.support.store_workload import site_stack

S = 1_000_000_000


class SteadyWorkload:
    """Counters of n sites, all changing every step, generated as columns. The three-size sites' blocks of a
    step take one size, and their frees free the mean live size (`poisson-mean`)."""

    def __init__(self, n: int, seed: int = 3) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.size = 16 + 8 * (np.arange(n) % 64)
        self.varied = np.arange(n) % 10 == 0
        z = np.zeros(n, np.int64)
        self.tot_bk, self.tot_b, self.frd_bk, self.frd_b = z.copy(), z.copy(), z.copy(), z.copy()
        self.peak_total = -1
        self.peak_b = z.copy()
        self.peak_x = z.copy()
        self.peak: PeakState | None = None
        self.peak_moves = 0

    def step(self, t: int, wall_ns: int) -> tuple[StoreSample, np.ndarray]:
        rng, n = self.rng, self.n
        allocs = 1 + rng.poisson(4.0, n)
        live = self.tot_bk - self.frd_bk
        frees = np.minimum(live, 1 + rng.poisson(4.0, n))
        # varied sites: each block is 1, 2 or 3 times the site's size
        factor = np.where(self.varied, 1 + rng.integers(0, 3, n), 1)
        mean_live = np.where(live > 0, (self.tot_b - self.frd_b) // np.maximum(live, 1), self.size)
        self.tot_b += allocs * self.size * factor
        self.frd_b += np.where(self.varied, frees * mean_live, frees * self.size)
        return self._finish(t, wall_ns, allocs, frees)


    def _finish(self, t: int, wall_ns: int, allocs: np.ndarray, frees: np.ndarray) -> tuple[StoreSample, np.ndarray]:
        """After a step's bytes are counted: its blocks, the live state, the peak, and the sample with its counters."""
        self.tot_bk += allocs
        self.frd_bk += frees
        cur_bk = self.tot_bk - self.frd_bk
        cur_b = self.tot_b - self.frd_b
        cur_x = cur_bk * 8
        heap, extra = int(cur_b.sum()), int(cur_x.sum())
        if heap + extra > self.peak_total:
            self.peak_total = heap + extra
            self.peak_b, self.peak_x = cur_b.copy(), cur_x.copy()
            self.peak = PeakState(t * 1000, heap, extra, 0, wall_ns)
            self.peak_moves += 1
        counters = np.stack([self.tot_bk, self.tot_b, self.frd_bk, self.frd_b, cur_bk, cur_b, cur_x,
                             self.peak_b, self.peak_x])
        sample = StoreSample(wall_ns=wall_ns, time=t * 1000, heap_B=heap, extra_B=extra, stacks_B=0, sites={},
                             mapped_B=heap + extra + (64 << 20), rss_B=heap + (32 << 20), peak=self.peak)
        return sample, counters


class BlockSizesWorkload(SteadyWorkload):
    """As SteadyWorkload (the same counts of allocations and frees), but each block of a three-size site draws
    its size (s, 2s or 3s) on its own, and frees take live blocks at random: the freed bytes are sums of the
    sizes of blocks that were allocated (`poisson`)."""

    def __init__(self, n: int, seed: int = 3) -> None:
        super().__init__(n, seed)
        self.vidx = np.flatnonzero(self.varied)
        self.live3 = np.zeros((len(self.vidx), 3), np.int64)  # live blocks of each size, per three-size site

    def step(self, t: int, wall_ns: int) -> tuple[StoreSample, np.ndarray]:
        rng, n, v = self.rng, self.n, self.vidx
        allocs = 1 + rng.poisson(4.0, n)
        live = self.tot_bk - self.frd_bk
        frees = np.minimum(live, 1 + rng.poisson(4.0, n))
        alloc_b = allocs * self.size
        free_b = frees * self.size
        # three-size sites: the sizes of the blocks freed (drawn among the live ones), then of those allocated
        l1, l2, l3 = self.live3.T
        f = frees[v]
        k1 = rng.hypergeometric(l1, l2 + l3, f)
        k2 = rng.hypergeometric(l2, l3, f - k1)
        freed3 = np.stack([k1, k2, f - k1 - k2], axis=1)
        alloc3 = rng.multinomial(allocs[v], [1 / 3, 1 / 3, 1 / 3])
        self.live3 += alloc3 - freed3
        mult = np.array([1, 2, 3])
        free_b[v] = (freed3 @ mult) * self.size[v]
        alloc_b[v] = (alloc3 @ mult) * self.size[v]
        self.tot_b += alloc_b
        self.frd_b += free_b
        return self._finish(t, wall_ns, allocs, frees)


WORKLOADS = {"poisson": BlockSizesWorkload, "poisson-mean": SteadyWorkload}


class SitesCWorkload(SteadyWorkload):
    """bench/sites.c's traffic, modelled: allocation i is made at site i % n with the site's one size, and
    frees the block of allocation i - 4096 (a ring of 4096 live blocks); `rate` allocations a second, give or
    take 5% (the rate a profiled process keeps varies with scheduling)."""

    RING = 4096

    def __init__(self, n: int, rate: int = 300_000, seed: int = 3) -> None:
        super().__init__(n, seed)
        self.rate = rate
        self.next_i = 0

    def _per_site(self, start: int, count: int) -> np.ndarray:
        """How many of the allocation indices start..start+count-1 fall on each site."""
        if count <= 0:
            return np.zeros(self.n, np.int64)
        full, rest = divmod(count, self.n)
        out = np.full(self.n, full, np.int64)
        first = start % self.n
        idx = (first + np.arange(rest)) % self.n
        out[idx] += 1
        return out

    def step(self, t: int, wall_ns: int) -> tuple[StoreSample, np.ndarray]:
        count = int(self.rate * (0.95 + 0.1 * self.rng.random()))
        i0 = self.next_i
        self.next_i += count
        allocs = self._per_site(i0, count)
        f0 = max(0, i0 - self.RING)
        frees = self._per_site(f0, max(0, i0 + count - self.RING) - f0)
        self.tot_bk += allocs
        self.tot_b += allocs * self.size
        self.frd_bk += frees
        self.frd_b += frees * self.size
        cur_bk = self.tot_bk - self.frd_bk
        cur_b = self.tot_b - self.frd_b
        cur_x = cur_bk * 8
        heap, extra = int(cur_b.sum()), int(cur_x.sum())
        if heap + extra > self.peak_total:
            self.peak_total = heap + extra
            self.peak_b, self.peak_x = cur_b.copy(), cur_x.copy()
            self.peak = PeakState(t * 1000, heap, extra, 0, wall_ns)
            self.peak_moves += 1
        counters = np.stack([self.tot_bk, self.tot_b, self.frd_bk, self.frd_b, cur_bk, cur_b, cur_x,
                             self.peak_b, self.peak_x])
        sample = StoreSample(wall_ns=wall_ns, time=t * 1000, heap_B=heap, extra_B=extra, stacks_B=0, sites={},
                             mapped_B=heap + extra + (64 << 20), rss_B=heap + (32 << 20), peak=self.peak)
        return sample, counters


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def timed(fn, *args):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, default=10_000)
    ap.add_argument("--snapshots", type=int, default=3600)
    ap.add_argument("--day", action="store_true", help="86,400 snapshots: one real day at 1 Hz")
    ap.add_argument("--dir", default=None, help="where to write the store (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the store afterwards")
    ap.add_argument("--workload", choices=("poisson", "poisson-mean", "sites-c"), default="poisson",
                    help="poisson (default): every site allocates 1+Poisson(4) blocks a second and frees as many, "
                         "10%% of sites with three sizes; poisson-mean: the same, a three-size site's frees freeing "
                         "its mean live size; sites-c: bench/sites.c's round-robin traffic, modelled")
    args = ap.parse_args()
    n_snap = 86_400 if args.day else args.snapshots
    root = Path(args.dir or tempfile.mkdtemp(prefix="store-bench-"))
    target = root / "4242"
    shutil.rmtree(target, ignore_errors=True)
    n = args.sites
    wl = WORKLOADS[args.workload](n) if args.workload in WORKLOADS else SitesCWorkload(n)
    start_ns = time.time_ns() - n_snap * S
    stacks = {i: site_stack(i, depth=12) for i in range(n)}
    meta = StoreMeta(pid=4242, cmd="bench/sites", options={"depth": 30, "threshold": 1.0, "max_snapshots": 100})
    ids = np.arange(n, dtype=np.int64)
    print(f"store bench: {n:,} sites, {args.workload} workload, {n_snap:,} snapshots at 1 Hz "
          f"({n_snap / 3600:.2f} h), in {root}")

    append_s: list[float] = []
    changed = 0
    prev = None
    with StoreWriter(target, meta) as w:
        for t in range(n_snap):
            sample, counters = wl.step(t, start_ns + t * S)
            if t == 0:
                sample.new_stacks = stacks
            if prev is not None:
                changed += int(np.any(counters != prev, axis=0).sum())
            prev = counters
            dt, _ = timed(w.append_columns, sample, ids, counters)
            append_s.append(dt)
            if t and t % 10_000 == 0:
                print(f"  ... {t:,} snapshots, {fmt_bytes(w.stats.bytes_written)}", flush=True)
        stats = w.stats
    # append() with SiteCounts objects, as a session holding dicts would call it (on a copy of the store)
    from agent.model.stack import SiteCounts

    obj_dir = root / "objects"
    shutil.rmtree(obj_dir, ignore_errors=True)
    wl2 = WORKLOADS.get(args.workload, SteadyWorkload)(n, seed=9)
    obj_s = []
    with StoreWriter(obj_dir, meta) as w2:
        for t in range(60):
            sample, counters = wl2.step(t, start_ns + t * S)
            sample.new_stacks = stacks if t == 0 else {}
            cols = counters.T.tolist()
            sample.sites = {
                i: SiteCounts(tot_blocks=r[0], tot_bytes=r[1], freed_blocks=r[2], freed_bytes=r[3], cur_blocks=r[4],
                              cur_bytes=r[5], cur_extra=r[6], peak_bytes=r[7], peak_extra=r[8])
                for i, r in enumerate(cols)
            }
            dt, _ = timed(w2.append, sample)
            obj_s.append(dt)
    shutil.rmtree(obj_dir)

    total = sum(p.stat().st_size for p in segment_paths(target))
    reader = StoreReader(target)
    refs = reader.snapshots()
    assert len(refs) == n_snap, (len(refs), reader.skipped)
    spans = []  # bytes of each snapshot within its segment (blocks, its TOC, outer TOC, offset)
    for seg in reader.segments:
        srefs = seg.snapshots()
        for a, b in itertools.pairwise(srefs):
            spans.append((b.seq, b.toc.end - a.toc.end, b.seq % seg.checkpoint_every == 0))
    delta = [s for _, s, cp in spans if not cp]
    checkp = [s for _, s, cp in spans if cp]
    per_snap = total / n_snap
    day = per_snap * 86_400
    reader.close()
    print()
    print(f"sites changing per snapshot: {changed / max(1, n_snap - 1):,.0f} of {n:,} (mean); "
          f"the peak moved {wl.peak_moves} times")
    print(f"segments: {len(reader.segments)}, on disk {fmt_bytes(total)}")
    print(f"bytes per snapshot: {per_snap:,.0f} overall; delta median {statistics.median(delta):,.0f}, "
          f"checkpoint median {statistics.median(checkp) if checkp else 0:,.0f}; first (tables) "
          f"{refs[0].toc.end:,}")
    print(f"one day at 1 Hz: {fmt_bytes(day)} ({day / 1e9:.2f} GB; goal <= 1 GB: "
          f"{'met' if day <= 1e9 else 'NOT met'})" + ("  (measured, not projected)" if args.day else "  (projected)"))
    a_ms = sorted(x * 1000 for x in append_s)
    print(f"write cost per snapshot, append_columns: median {statistics.median(a_ms):.2f} ms, "
          f"p99 {a_ms[int(0.99 * len(a_ms))]:.2f} ms, max {a_ms[-1]:.2f} ms; fsyncs {stats.syncs}")
    o_ms = sorted(x * 1000 for x in obj_s[1:])
    print(f"write cost per snapshot, append (10,000 SiteCounts): median {statistics.median(o_ms):.2f} ms "
          f"(ratio to columns {statistics.median(o_ms) / statistics.median(a_ms):.1f}x)")

    rnd = random.Random(4)
    picks = rnd.sample(range(n_snap), 15)
    cold_cols, cold_sites, warm_next = [], [], []
    cpu_cols, cpu_sites = [], []  # the same reads in this process's CPU time: what other work on the machine
    # adds to the wall clock is not in it
    for k in picks:
        at_ns = start_ns + k * S  # by time, as `diff` and /snapshot?at= ask
        c0, t0 = time.process_time(), time.perf_counter()
        r = StoreReader(target)
        snap = r.at(at_ns, stacks=False)
        cold_cols.append(time.perf_counter() - t0)
        cpu_cols.append(time.process_time() - c0)
        assert snap is not None and snap.wall_ns == at_ns
        r.close()
        c0, t0 = time.process_time(), time.perf_counter()
        r = StoreReader(target)
        snap = r.at(at_ns)
        assert snap is not None
        snap.sites()
        cold_sites.append(time.perf_counter() - t0)
        cpu_sites.append(time.process_time() - c0)
        t3 = time.perf_counter()
        r.at(at_ns + S)
        warm_next.append(time.perf_counter() - t3)
        r.close()
    ms = lambda xs: f"median {statistics.median(xs) * 1000:.1f} ms, max {max(xs) * 1000:.1f} ms"  # noqa: E731
    print(f"read the snapshot at a time, cold (open the store, find its segment, roll from its checkpoint): counters "
          f"{ms(cold_cols)}; as dict[Stack, SiteCounts] (stack tables and 10,000 SiteCounts too) {ms(cold_sites)} "
          "(goal <= 50 ms)")
    print(f"  the same in CPU time: counters {ms(cpu_cols)}; as a dict {ms(cpu_sites)}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"read the next snapshot (warm): {ms(warm_next)}")

    def run_cli(argv: list[str]) -> float:
        ns = commands_parser().parse_args(argv)
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            rc = {c.name: c for c in (commands.Report, commands.Diff)}[ns.command](out=io.StringIO()).run(ns)
        assert rc == 0
        return time.perf_counter() - t0

    out = root / "m.out"
    span = f"{n_snap / 3600:.2f} h"
    t_m = run_cli(["report", str(root), "--pid", "4242", "--format=massif", "-o", str(out)])
    print(f"report --format=massif over {span}: {t_m:.1f} s" + _day_goal(t_m, n_snap))
    t_x = run_cli(["report", str(root), "--pid", "4242", "--format=xtree", "-o", str(root / "x.kcg")])
    print(f"report --format=xtree over {span}: {t_x:.1f} s")
    t_j = run_cli(["report", str(root), "--pid", "4242", "--format=json", "-o", str(root / "r.json")])
    print(f"report --format=json over {span}: {t_j:.1f} s")
    t_d = run_cli(["diff", str(root), "--pid", "4242", "--from", f"-{n_snap}s", "--to", "now"])
    print(f"diff first..last: {t_d:.1f} s")
    if not args.keep and args.dir is None:
        shutil.rmtree(root)
    return 0


def _day_goal(seconds: float, n_snap: int) -> str:
    if n_snap >= 86_400:
        return f" (a real day; goal <= 30 s: {'met' if seconds <= 30 else 'NOT met'})"
    per_day = seconds * 86_400 / n_snap
    return f" (extrapolated linearly to a day: {per_day:.0f} s; goal <= 30 s)"


def commands_parser() -> argparse.ArgumentParser:
    from agent.cli import build_parser

    return build_parser()


if __name__ == "__main__":
    os.environ.setdefault("TZ", "UTC")
    sys.exit(main())
