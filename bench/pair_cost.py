#!/usr/bin/env python3
"""Where exact mode's time per malloc+free pair goes, beside Massif and heaptrack in the same run.

    sudo .venv/bin/python bench/pair_cost.py [--calls 2000000] [--repeats 3] [--json FILE]

bench/churn.c's loop (malloc then free, one site) runs native, under `heapscope run --mode=exact`, Massif and
heaptrack, interleaved, median of --repeats; each tool's cost is the loop's own time over native, per pair.
During heapscope's runs kernel.bpf_stats_enabled is on (restored after) and its BPF programs' run counts and
run times are read with bpftool while they are loaded: a pair's time splits into each program's run time
(ns a run x runs a pair) and the rest, which is the uprobe traps (int3, the kernel's entry and exit, the
uretprobe's return trampoline) and the cache misses the programs leave behind. Turning the statistics on adds
two clock reads a program run (0.3 µs a pair here, 2026-11-26), which the rest includes: the goal's figure is
heapscope-exact, timed with the statistics off, and heapscope-stats is the run they split.
Goal (issue: one kernel program for every target): exact mode at most 2.0 us a pair over native.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from run import (  # noqa: E402
    HEAPSCOPE,
    RESULTS_DIR,
    WORKLOADS,
    Measurement,
    ToolFailed,
    _massif,
    build,
    read_loop_time,
    require_output,
    run_heaptrack,
    run_native,
    timed_command,
)

STATS = "/proc/sys/kernel/bpf_stats_enabled"


def bpf_programs() -> dict[int, dict[str, object]]:
    """Every loaded BPF program by id, with its name, owner PIDs, run count and run time (bpftool's JSON)."""
    done = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True, check=False)
    try:
        return {p["id"]: p for p in json.loads(done.stdout or "[]")}
    except json.JSONDecodeError:
        return {}


class ProgramStats:
    """Reads heapscope's programs' counters every `period` while a run goes on; keeps the latest of each (a
    program's counters go with it when heapscope unloads it at the end)."""

    def __init__(self, before: set[int], period: float = 0.05) -> None:
        self.before = before
        self.latest: dict[int, dict[str, object]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(period,), daemon=True)
        self._thread.start()

    def _poll(self, period: float) -> None:
        while not self._stop.wait(period):
            for pid, p in bpf_programs().items():
                owners = {o.get("comm") for o in p.get("pids", [])}  # type: ignore[union-attr,attr-defined]
                if pid not in self.before and (not owners or owners & {"heapscope", "python3", "python"}):
                    self.latest[pid] = p

    def stop(self) -> dict[str, tuple[int, int]]:
        """Per program name: (runs, run time in ns), summed over programs of one name."""
        self._stop.set()
        self._thread.join()
        return totals_by_name(self.latest.values())


def totals_by_name(programs: Iterable[dict[str, object]]) -> dict[str, tuple[int, int]]:
    """(runs, run time in ns) per program name, summed over the programs of one name (bpftool's JSON)."""
    out: dict[str, tuple[int, int]] = {}
    for p in programs:
        runs, ns = out.get(str(p["name"]), (0, 0))
        out[str(p["name"])] = (runs + int(p.get("run_cnt", 0)), ns + int(p.get("run_time_ns", 0)))  # type: ignore[call-overload]
    return out


def heapscope_exact(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
    out = scratch / "massif.out.heapscope"
    wall = timed_command([str(HEAPSCOPE), "run", "-q", "--mode=exact", "--time-unit=B",
                          f"--massif-out-file={out}", "--", str(binary), *args], env, scratch)
    require_output(scratch, out.name, "heapscope")
    return Measurement(wall, read_loop_time(scratch / "loop_time"))


def heapscope_without_stats(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
    """The figure the goal is about: kernel.bpf_stats_enabled off for this run (its clock reads are the
    statistics' cost, not heapscope's)."""
    Path(STATS).write_text("0\n")
    try:
        return heapscope_exact(binary, args, env, scratch)
    finally:
        Path(STATS).write_text("1\n")


def heapscope_with_stats(sink: list[dict[str, tuple[int, int]]]) -> Callable[..., Measurement]:
    def run(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
        stats = ProgramStats(set(bpf_programs()))
        try:
            return heapscope_exact(binary, args, env, scratch)
        finally:
            sink.append(stats.stop())

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=RESULTS_DIR / "pair_cost.json")
    ns = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("pair_cost: run as root (BPF programs, kernel.bpf_stats_enabled)", file=sys.stderr)
        return 2
    binary = build(WORKLOADS["churn"])
    stats: list[dict[str, tuple[int, int]]] = []
    tools: dict[str, Callable[..., Measurement]] = {
        "native": run_native, "heapscope-exact": heapscope_without_stats,
        "heapscope-stats": heapscope_with_stats(stats), "massif": _massif(), "heaptrack": run_heaptrack,
    }
    loops: dict[str, list[float]] = {name: [] for name in tools}
    saved = Path(STATS).read_text().strip()
    Path(STATS).write_text("1\n")
    try:
        for rep in range(ns.repeats):
            for name, tool in tools.items():
                scratch = Path(tempfile.mkdtemp(prefix=f"heapscope-pair-{name}-"))
                env = {**os.environ, "CHURN_TIME_FILE": str(scratch / "loop_time")}
                try:
                    loops[name].append(tool(binary, [str(ns.calls)], env, scratch).loop_s)
                    print(f"  [{rep + 1}/{ns.repeats}] {name:<16} loop {loops[name][-1]:7.3f} s", flush=True)
                except ToolFailed as exc:
                    print(f"  [{rep + 1}/{ns.repeats}] {name:<16} FAILED: {exc}", flush=True)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
    finally:
        Path(STATS).write_text(saved + "\n")
    if not loops["native"]:
        print("pair_cost: the native runs failed", file=sys.stderr)
        return 1
    native_us = statistics.median(loops["native"]) / ns.calls * 1e6
    result: dict[str, object] = {"calls": ns.calls, "repeats": ns.repeats, "native_us_per_pair": native_us}
    print(f"\nchurn, {ns.calls:,} malloc+free pairs, median of {ns.repeats}")
    print(f"{'tool':<16} {'us/pair':>8} {'over native':>12}")
    for name, values in loops.items():
        if not values:
            continue
        us = statistics.median(values) / ns.calls * 1e6
        result[name] = {"us_per_pair": us, "over_native_us": us - native_us}
        print(f"{name:<16} {us:8.3f} {us - native_us:12.3f}")
    if stats and loops["heapscope-stats"]:
        over_ns = (statistics.median(loops["heapscope-stats"]) / ns.calls * 1e6 - native_us) * 1000
        print("\nheapscope exact with kernel.bpf_stats_enabled (heapscope-stats), a pair's time over native, by"
              " part (median run of each program):")
        rows = {}
        for prog in sorted({p for s in stats for p in s}):
            ran = [s[prog] for s in stats if s.get(prog, (0, 0))[0]]
            runs = statistics.median(r[0] / ns.calls for r in ran) if ran else 0.0
            if runs < 0.01:
                continue  # programs that do not run per call (exec, exit, mmap...)
            per_run = statistics.median(r[1] / r[0] for r in ran)
            rows[prog] = {"ns_per_run": per_run, "runs_per_pair": runs, "ns_per_pair": per_run * runs}
        in_bpf = sum(r["ns_per_pair"] for r in rows.values())
        for prog, r in sorted(rows.items(), key=lambda kv: -kv[1]["ns_per_pair"]):
            print(f"  {prog:<16} {r['ns_per_run']:7.0f} ns a run x {r['runs_per_pair']:.2f} = "
                  f"{r['ns_per_pair']:7.0f} ns")
        print(f"  {'in BPF programs':<16} {in_bpf:38.0f} ns")
        print(f"  {'traps and rest':<16} {over_ns - in_bpf:38.0f} ns")
        result["heapscope_programs"] = rows
        result["heapscope_traps_and_rest_ns"] = over_ns - in_bpf
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
