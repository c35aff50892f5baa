"""What is growing, at scale: a stored day of 10,000 sites judged by `heapscope growth`, and the daemon's /growth
over the last hour of it.

    python bench/growth_bench.py [--hours 24] [--sites 10000] [--dir DIR] [--keep]

Writes `--hours` of 1 Hz snapshots with the store's own writer (tests/support/growth_store.py): three leaks
(200,000, 2,000 and 20 B/s), a cache that fills for the first tenth of the run then stops, a sawtooth, and as
many churning pools as make `--sites` (each 1 + Poisson(4) allocations a second, each live block freed with a
chance of 0.2 a second: a steady level that wanders). Then measures, three times each, the fastest and the
slowest, on the wall clock and in CPU time (which other work on the machine does not add to):
- `heapscope growth STORE` over the whole run, as a command (a new process: Python, its imports, the store opened
  cold), goal <= 2 s for a day; and the same call in this process (`agent.offline.growth.report`);
- `GET /targets/PID/growth?window=3600` through the daemon's API (FastAPI's TestClient over `create_app`, the
  target's history read by the daemon's own code, agent.daemon.history), goal <= 1 s;
and checks that the three leaks are ranked first, as suspects, the largest first, in both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.offline import growth
from agent.store import StoreReader
from tests.support.growth_store import GrowthStore, cache, leak, sawtooth

REPO = Path(__file__).resolve().parents[1]
LEAKS = ["leak_big", "leak_mid", "leak_small"]


def workload(hours: float, sites: int) -> GrowthStore:
    seconds = int(hours * 3600)
    patterns = [
        leak(200, 1000, "leak_big", 40), leak(2, 1000, "leak_mid", 41), leak(0.02, 1000, "leak_small", 42),
        cache(4, seconds / 10), sawtooth(30, 3.3),
    ]
    return GrowthStore(patterns, seconds=seconds, churn=sites - len(patterns))


def check_ranking(sites: list[dict]) -> str:  # type: ignore[type-arg]
    top = [s["site"].split(" ")[0] for s in sites[:3]]
    assert top == LEAKS and all(s["suspect"] for s in sites[:3]), sites[:5]
    return ", ".join(f"{s['site'].split(' ')[0]} {s['bytes_per_s']:,.0f} B/s" for s in sites[:3])


def cpu_s() -> float:
    """CPU time of this process and of its children that ended: what other work on the machine does not add."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn, runs: int = 3):  # type: ignore[no-untyped-def]
    """(wall clock, CPU time) of the fastest and the slowest of `runs` calls as text, and the last result."""
    wall, cpu, out = [], [], None
    for _ in range(runs):
        t0, c0 = time.perf_counter(), cpu_s()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(cpu_s() - c0)
    return max(wall), f"{min(wall):.2f}-{max(wall):.2f} s (CPU {min(cpu):.2f}-{max(cpu):.2f} s)", out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--sites", type=int, default=10_000)
    ap.add_argument("--dir", default=None, help="where the store is (kept between runs: written once)")
    ap.add_argument("--keep", action="store_true", help="keep the store afterwards")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="growth-bench-"))
    wl = workload(args.hours, args.sites)
    directory = root / str(wl.pid)
    if not directory.exists():
        print(f"writing {args.hours:g} h of {args.sites:,} sites at 1 Hz into {root} ...", flush=True)
        t0 = time.perf_counter()
        wl.write(root)
        print(f"  written in {time.perf_counter() - t0:.0f} s", flush=True)
    size = sum(p.stat().st_size for p in directory.glob("seg-*.hss"))
    with StoreReader(directory) as reader:
        count, _, _ = reader.extent()
        n_segments = len(reader.segments)
    print(f"store: {count:,} snapshots in {n_segments} segments, {size / 1e9:.2f} GB; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    cli = [str(REPO / ".venv" / "bin" / "heapscope"), "growth", str(root), "--format", "json"]
    hi, said, done = timed(lambda: subprocess.run(cli, capture_output=True, text=True, check=True))
    doc = json.loads(done.stdout)
    goal = "met" if hi <= 2.0 else "NOT met"
    print(f"heapscope growth over {doc['window_s'] / 3600:.1f} h ({doc['points']} snapshots read of "
          f"{doc['snapshots']:,}, {doc['n_sites']:,} sites judged), as a command: {said} "
          f"(goal <= 2 s: {goal}); {check_ranking(doc['sites'])}")

    def in_process() -> dict:  # type: ignore[type-arg]
        with StoreReader(directory) as reader:
            return growth.report(reader).to_json()

    _, said, _ = timed(in_process)
    print(f"  the same in this process (the report alone): {said}")

    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import ApiSettings
    from tests.support.fake_daemon import FakeManager, FakeTarget

    manager = FakeManager([FakeTarget(pid=wl.pid, store_dir=directory)])
    with TestClient(create_app(ApiSettings(), manager)) as client:  # type: ignore[arg-type]
        def hour() -> dict:  # type: ignore[type-arg]
            r = client.get(f"/targets/{wl.pid}/growth", params={"window": 3600})
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]

        hi, said, doc = timed(hour)
    goal = "met" if hi <= 1.0 else "NOT met"
    print(f"GET /targets/{wl.pid}/growth?window=3600 ({doc['points']} snapshots read of {doc['snapshots']:,}): "
          f"{said} (goal <= 1 s: {goal}); {check_ranking(doc['sites'])}")
    print(f"  verdicts over the hour: {', '.join(f'{n} {v}' for v, n in doc['counts'].items() if n)}")
    if not args.keep and args.dir is None:
        shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
