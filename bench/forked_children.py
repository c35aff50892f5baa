#!/usr/bin/env python3
"""What a new process of a followed service costs heapscope's daemon: postgres forks a backend for every
connection, and `heapscope serve` with a selector of its postmaster attaches each one (sampler started again in
the child, probes, unwind tables), profiles it, and builds its MALT profile when it exits.

    sudo .venv/bin/python bench/forked_children.py [--sessions 20] [--hold 0.4] [--json FILE]

--sessions psql sessions, one after the other, each a new backend that holds for --hold seconds (pg_sleep) and
then reads the pgbench table; first with no heapscope, then with the daemon following the postmaster (sampled
mode, its defaults). Measured: the daemon's CPU from the first session until it is quiet again, less its idle
CPU over the same time (its other targets' ticks), divided by the backends it profiled; and the sessions' wall
time, untraced and traced (a backend's attach stops one of its threads for a call into it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchproc import cpu_seconds
from service_panel import Daemon, attach_all

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.services import SERVICES  # noqa: E402

QUIET_CPU_S = 0.03  # the daemon's CPU over QUIET_S below which it is done with the last backend
QUIET_S = 2.0


def sessions(svc: object, n: int, hold: float) -> list[float]:
    """Each session's wall time, in seconds."""
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run(
            svc._psql("-c", f"select pg_sleep({hold})", "-c", "select sum(abalance) from pgbench_accounts"),  # type: ignore[attr-defined]
            capture_output=True, check=True, timeout=60,
        )  # fmt: skip
        out.append(time.monotonic() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--hold", type=float, default=0.4, help="seconds each backend lives before its query")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/forked_children.py needs root")
    with tempfile.TemporaryDirectory() as tmp, SERVICES["postgres"]() as svc:
        svc.load(1.0)  # pgbench's tables, and a warm server
        untraced = sessions(svc, args.sessions, args.hold)
        daemon = Daemon(Path(tmp))
        try:
            attach_all(daemon, svc)
            before = set(daemon.targets())
            idle0, t0 = cpu_seconds(daemon.proc.pid), time.monotonic()
            time.sleep(5.0)
            idle_rate = (cpu_seconds(daemon.proc.pid) - idle0) / (time.monotonic() - t0)
            cpu0, t0 = cpu_seconds(daemon.proc.pid), time.monotonic()
            traced = sessions(svc, args.sessions, args.hold)
            while True:
                c = cpu_seconds(daemon.proc.pid)
                time.sleep(QUIET_S)
                if cpu_seconds(daemon.proc.pid) - c < QUIET_CPU_S:
                    break
            elapsed = time.monotonic() - t0
            spent = cpu_seconds(daemon.proc.pid) - cpu0 - idle_rate * elapsed
            profiled = [t for p, t in daemon.targets().items() if p not in before]
            done = [t for t in profiled if t["state"] in ("exited", "detached")]
        finally:
            daemon.stop()
    result = {
        "sessions": args.sessions,
        "hold_s": args.hold,
        "backends_profiled": len(done),
        "daemon_cpu_per_backend_ms": 1000 * spent / len(done) if done else None,
        "daemon_idle_cpu_percent": 100 * idle_rate,
        "session_untraced_s": statistics.median(untraced),
        "session_traced_s": statistics.median(traced),
    }
    per = result["daemon_cpu_per_backend_ms"]
    print(f"backends profiled: {len(done)} of {args.sessions} sessions; daemon CPU a backend "
          f"{'-' if per is None else f'{per:.0f} ms'} (idle {100 * idle_rate:.1f}% of a core beside); "
          f"session median {result['session_untraced_s']:.3f} s untraced, {result['session_traced_s']:.3f} s traced")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
