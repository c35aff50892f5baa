#!/usr/bin/env python3
"""What a further target costs the daemon (issue 26): its CPU and the time from the attach request to the target's
first recorded call, for the 1st target and for the 2nd to Nth, and the kernel memory at 1, 10 and N targets, in
each mode.

    sudo .venv/bin/python bench/attach_cost.py                          # exact and sampled, 50 targets each
    sudo .venv/bin/python bench/attach_cost.py --modes exact --targets 10

For each mode: `heapscope serve --mode=MODE --no-store` on loopback, then targets one after another
(bench/idle_target.c `busy RATE`: a steady trickle of allocations from 64 sites). Each is attached with
POST /targets {"pid"}, and GET /targets is polled every 5 ms until the target's allocation calls are above 0: the
time to its first recorded call. The daemon's CPU (utime + stime of /proc/PID/stat) is read before the POST and a
second after that first call, less what the daemon spent in the same time before the POST (its work for the targets
already there): the attach's own CPU. Kernel memory is the memlock of the daemon's BPF maps and programs (fdinfo),
as bench/daemon_cost.py reads it. Goals (issue 26): at most 50 ms of CPU and 200 ms to the first call for a further
target; at most 1 GiB of kernel memory at 50 exact targets. Results: bench/results/attach_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from benchproc import build, cpu_seconds, daemon_client, free_port, stop_all
from daemon_cost import bpf_memlock, start

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SETTLE = 1.0  # seconds after the first call that still count as the attach's (its first samples)


def first_call(client: httpx.Client, pid: int, timeout: float = 60.0) -> float:
    """Seconds until GET /targets shows an allocation call of pid (or its error)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        for t in client.get("/targets").json():
            if t["pid"] != pid:
                continue
            if t.get("error"):
                raise SystemExit(f"target {pid}: {t['error']}")
            if t["heap"]["allocation_calls"] > 0:
                return time.monotonic() - started
        time.sleep(0.005)
    raise SystemExit(f"target {pid}: no call recorded in {timeout:.0f} s")


def run_mode(mode: str, program: Path, n: int, rate: int, tree: Path) -> dict[str, Any]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "HEAPSCOPE_TOKEN"}
    env["PYTHONPATH"] = str(tree)
    out_dir = BENCH / "build" / f"attach-cost-{mode}"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "serve", "--http", f"127.0.0.1:{port}", "--output-dir", str(out_dir),
         "--no-store", "-q", f"--mode={mode}"],
        env=env, cwd=tree,
    )  # fmt: skip
    targets: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, float]] = []
    memory: dict[int, dict[str, float]] = {}
    try:
        client = daemon_client(port, timeout=300)
        for i in range(n):
            p = start(program, "busy", str(rate))
            targets.append(p)
            # The daemon's rate of CPU with the targets already there, just before this one.
            c0, t0 = cpu_seconds(daemon.pid), time.monotonic()
            time.sleep(0.5)
            c1, t1 = cpu_seconds(daemon.pid), time.monotonic()
            background = (c1 - c0) / (t1 - t0)
            asked = time.monotonic()
            r = client.post("/targets", json={"pid": p.pid})
            assert r.status_code == 201, r.text
            first_call(client, p.pid)
            to_first = time.monotonic() - asked  # from the request: the POST answers once the target is attached
            time.sleep(SETTLE)
            c2, t2 = cpu_seconds(daemon.pid), time.monotonic()
            cpu = (c2 - c1) - background * (t2 - t1)
            rows.append({"target": i + 1, "to_first_call_s": to_first, "cpu_s": cpu, "raw_cpu_s": c2 - c1})
            print(f"{mode} target {i + 1:3d}: first call after {to_first * 1000:7.1f} ms, "
                  f"CPU {cpu * 1000:7.1f} ms (raw {(c2 - c1) * 1000:.1f})", flush=True)  # fmt: skip
            if i + 1 in (1, 10, n):
                memory[i + 1] = bpf_memlock(daemon.pid)
                print(f"{mode} at {i + 1} targets: BPF maps {memory[i + 1]['bpf_maps_mib']:.1f} MiB "
                      f"({memory[i + 1]['bpf_maps']:.0f}), programs {memory[i + 1]['bpf_progs_mib']:.1f} MiB "
                      f"({memory[i + 1]['bpf_progs']:.0f})", flush=True)  # fmt: skip
    finally:
        stop_all(daemon, targets)
    further = rows[1:]
    return {
        "first": rows[0],
        "further_median_cpu_s": statistics.median(r["cpu_s"] for r in further) if further else None,
        "further_max_cpu_s": max(r["cpu_s"] for r in further) if further else None,
        "further_median_to_first_call_s": statistics.median(r["to_first_call_s"] for r in further) if further else None,
        "further_max_to_first_call_s": max(r["to_first_call_s"] for r in further) if further else None,
        "memory": memory,
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="exact,sampled")
    ap.add_argument("--targets", type=int, default=50)
    ap.add_argument("--rate", type=int, default=200, help="each target's allocations a second")
    ap.add_argument("--tree", type=Path, default=REPO, help="the heapscope checkout to run (default: this one)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/attach_cost.py needs root (BPF)", file=sys.stderr)
        return 1
    program = build(BENCH / "idle_target.c", BENCH / "build" / "idle_target", opt="-O1")
    result = {mode: run_mode(mode, program, args.targets, args.rate, args.tree) for mode in args.modes.split(",")}
    for mode, r in result.items():
        first, ms = r["first"], {k: (v or 0) * 1000 for k, v in r.items() if k.startswith("further_")}
        print(f"{mode}: 1st target {first['cpu_s'] * 1000:.0f} ms CPU, first call after "
              f"{first['to_first_call_s'] * 1000:.0f} ms; 2nd..: median {ms['further_median_cpu_s']:.1f} ms CPU "
              f"(max {ms['further_max_cpu_s']:.1f}), first call after median "
              f"{ms['further_median_to_first_call_s']:.0f} ms "
              f"(max {ms['further_max_to_first_call_s']:.0f})")  # fmt: skip
    out = BENCH / "results" / "attach_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
