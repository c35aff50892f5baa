#!/usr/bin/env python3
"""The daemon's memory over a long profile: does it grow with the length of the history?

    sudo .venv/bin/python bench/daemon_rss.py                       # 10,000 sites, 10 minutes, with the store
    sudo .venv/bin/python bench/daemon_rss.py --minutes 30 --no-store
    sudo .venv/bin/python bench/daemon_rss.py --mode sampled      # the daemon's default mode

`heapscope serve` (its default store under --output-dir, 1 Hz; or --no-store) profiles bench/sites.c (N distinct
allocation stacks, allocating as fast as it can) for the given time. Every --every seconds the daemon's RSS is
read from /proc, with the store's size and the samples written; every 30 s a client reads the history as a user
would (/diff over the last minute, /snapshot?at=-30s, /all_snapshots of the last two minutes) and the live
/detailed_snapshot, so that what reading costs is counted too. Prints the RSS over time and the slope of a line
fitted through the second half (MiB per hour); results go to bench/results/daemon_rss-MODE[-no-store].json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from benchproc import build, daemon_client, free_port, heapscope_cmd, rss_mib

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def slope_mib_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time, in MiB per hour."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 3600 * sum((t - mt) * (r - mr) for t, r in points) / var if var else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, default=10_000)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between RSS readings (default 10)")
    ap.add_argument("--no-store", action="store_true", help="the daemon without its store, for comparison")
    ap.add_argument("--mode", choices=("exact", "sampled"), default="exact",
                    help="the daemon's profiling mode (default exact: every allocation counted)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/daemon_rss.py needs root (BPF)", file=sys.stderr)
        return 1
    sites = build(BENCH / "sites.c", BENCH / "build" / "sites")
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="daemon-rss-"))
    out_dir = work / "out"
    seconds = args.minutes * 60
    cmd = [*heapscope_cmd(), "serve", "--http", f"127.0.0.1:{port}", "--output-dir", str(out_dir), "-q",
           f"--mode={args.mode}"]
    if args.no_store:
        cmd.append("--no-store")
    env = {k: v for k, v in os.environ.items() if k != "HEAPSCOPE_TOKEN"}
    env.setdefault("PYTHONPATH", str(REPO))
    daemon = subprocess.Popen(cmd, env=env)
    readings: list[dict[str, float]] = []
    reads: list[dict[str, float]] = []
    try:
        client = daemon_client(port, timeout=120)
        rss_idle = rss_mib(daemon.pid)
        proc = subprocess.Popen([str(sites), str(args.sites), str(int(seconds) + 120)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, env={**os.environ, "SITES_WAIT": "1"})
        r = client.post("/targets", json={"pid": proc.pid})
        assert r.status_code == 201, r.text
        assert proc.stdin is not None
        proc.stdin.write(b"g")
        proc.stdin.flush()
        store = out_dir / "store" / str(proc.pid)
        stop = threading.Event()

        def reader() -> None:  # a user reading the history now and then, once there is a minute of it
            if stop.wait(70):
                return
            while not stop.wait(30):
                t0 = time.perf_counter()
                got = {}
                for name, path, params in (
                    ("diff_last_minute", "/diff", {"from": "-60s", "to": "now"}),
                    ("snapshot_at_30s_ago", "/detailed_snapshot", {"at": "-30s"}),
                    ("all_snapshots_last_2_minutes", "/all_snapshots", {"from": "-120s"}),
                    ("live_detailed_snapshot", "/detailed_snapshot", {}),
                ):
                    if args.no_store and params:
                        continue
                    s = time.perf_counter()
                    try:
                        resp = client.get(path, params=params)
                    except httpx.TransportError:  # the daemon is shutting down
                        return
                    got[name] = (time.perf_counter() - s) * 1000
                    if resp.status_code != 200:
                        print(f"  {path} {params}: {resp.status_code} {resp.text}", flush=True)
                got["t"] = time.perf_counter() - t0
                reads.append(got)

        threading.Thread(target=reader, daemon=True).start()
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            time.sleep(args.every)
            t = time.monotonic() - start
            h = client.get("/history").json()
            readings.append({
                "t_s": round(t, 1), "rss_mib": round(rss_mib(daemon.pid), 1),
                "store_bytes": dir_bytes(store), "snapshots_written": h["snapshots_written"],
                "write_errors": h["write_errors"],
            })
            last = readings[-1]
            print(f"  {t:7.0f} s  daemon RSS {last['rss_mib']:7.1f} MiB  store {last['store_bytes'] / 2**20:7.1f} MiB"
                  f"  {last['snapshots_written']:6d} samples stored", flush=True)
        stop.set()
        proc.kill()
        proc.wait()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(300)
        shutil.rmtree(work, ignore_errors=True)  # the store and the daemon's files
    second_half = [(r["t_s"], r["rss_mib"]) for r in readings[len(readings) // 2 :]]
    result = {
        "sites": args.sites, "minutes": args.minutes, "store": not args.no_store, "mode": args.mode,
        "rss_idle_mib": rss_idle,
        "readings": readings, "reads_ms": reads,
        "rss_first_mib": readings[0]["rss_mib"], "rss_last_mib": readings[-1]["rss_mib"],
        "rss_max_mib": max(r["rss_mib"] for r in readings),
        "slope_second_half_mib_per_hour": slope_mib_per_hour(second_half),
    }
    print(f"daemon RSS: {rss_idle:.0f} MiB idle; with the {args.sites}-site target {result['rss_first_mib']:.0f} MiB "
          f"after {readings[0]['t_s']:.0f} s, {result['rss_last_mib']:.0f} MiB after {readings[-1]['t_s']:.0f} s "
          f"(max {result['rss_max_mib']:.0f}); slope over the second half "
          f"{result['slope_second_half_mib_per_hour']:+.1f} MiB/h")
    if reads:
        keys = [k for k in reads[0] if k != "t"]
        print("history reads (ms, median over the run): " + ", ".join(
            f"{k} {sorted(r[k] for r in reads)[len(reads) // 2]:.0f}" for k in keys))
    (BENCH / "results").mkdir(exist_ok=True)
    name = f"daemon_rss-{args.mode}{'-no-store' if args.no_store else ''}.json"
    (BENCH / "results" / name).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
