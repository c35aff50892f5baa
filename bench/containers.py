#!/usr/bin/env python3
"""heapscope across the container wall: attach time into a container against the host, and a containerized
redis-server's throughput under sampled mode, side by side in one run.

    sudo .venv/bin/python bench/containers.py [--requests 100000] [--repeats 5] [--json FILE]

The container is a Debian 12 root made by debootstrap from the package registry (cached, as the tests make it:
tests/support/containers.py), started as a runtime starts a process (its own mount and PID namespaces, its own
/proc, pivot_root). Its redis-server is the image's own (the same Debian package as the host's).

1. Time to recording: `heapscope attach PID` from its start to "sampler armed" (sampled, the default) and to
   "probes attached" (exact), for the host's redis-server and the container's; median of --repeats.
2. Throughput: two containers of the image, one untraced and one with heapscope attached in sampled mode (left
   attached, as a service left for Prometheus); redis-benchmark SET and GET (-n --requests, -P 16), the runs
   alternating between the two; the ratio of the medians. Goal: at least 0.97x. --control attaches nothing:
   the same ratio with neither traced is the bench's own spread (0.96-1.01 on 2026-11-26).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.containers import Container, build_runner, debian_root, wait_redis  # noqa: E402

HEAPSCOPE = REPO / ".venv" / "bin" / "heapscope"
REDIS = ["/usr/bin/redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def attach_until(pid: int, mode: str, line: str, cwd: str) -> tuple[float, subprocess.Popen[str]]:
    """Seconds from `heapscope attach` to `line` in its log; the heapscope still running."""
    started = time.monotonic()
    proc = subprocess.Popen([str(HEAPSCOPE), "attach", f"--mode={mode}", str(pid)], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for text in proc.stderr:
        if line in text:
            return time.monotonic() - started, proc
    raise SystemExit(f"heapscope never said {line!r} for {pid}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)


def time_to_recording(pids: dict[str, int], repeats: int, cwd: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for mode, line in (("sampled", "sampler armed"), ("exact", "probes attached")):
        for where, pid in pids.items():
            times = []
            for _ in range(repeats):
                seconds, proc = attach_until(pid, mode, line, cwd)
                times.append(seconds)
                stop(proc)
            out.setdefault(mode, {})[where] = statistics.median(times)
    return out


def rates(port: int, requests: int) -> dict[str, float]:
    done = subprocess.run(["redis-benchmark", "-p", str(port), "-q", "-n", str(requests), "-P", "16",
                           "-t", "set,get", "-r", "100000", "-d", "200"],
                          capture_output=True, text=True, check=True)
    return {name: float(rate) for name, rate in re.findall(r"([A-Z]+): ([\d.]+) requests per second", done.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--control", action="store_true",
                    help="attach nothing: the two containers' ratio with neither traced, the bench's own spread")
    ns = ap.parse_args()
    root = debian_root("bookworm", ("redis-server",))
    work = tempfile.mkdtemp(prefix="hs-bench-containers-")
    runner = build_runner(Path(work))
    ports = {"host": 16431, "container": 16432, "untraced": 16433, "sampled": 16434}
    host = subprocess.Popen(["redis-server", *REDIS[1:], "--port", str(ports["host"])], stdout=subprocess.DEVNULL)
    boxes = {name: Container(runner, root, [*REDIS, "--port", str(ports[name])])
             for name in ("container", "untraced", "sampled")}
    attached = None
    try:
        for port in ports.values():
            wait_redis(port)
        recording = {} if ns.control else time_to_recording(
            {"host": host.pid, "container": boxes["container"].pid}, ns.repeats, work)
        if not ns.control:
            _, attached = attach_until(boxes["sampled"].pid, "sampled", "sampler armed", work)
            time.sleep(2)  # its one-time work at the attach is done
        for port in (ports["untraced"], ports["sampled"]):
            rates(port, ns.requests // 4)  # warm-up
        runs: dict[str, list[dict[str, float]]] = {"untraced": [], "sampled": []}
        for _ in range(ns.repeats):
            for name in ("untraced", "sampled"):
                runs[name].append(rates(ports[name], ns.requests))
        ratio = {t: statistics.median(r[t] for r in runs["sampled"]) / statistics.median(r[t] for r in runs["untraced"])
                 for t in ("SET", "GET")}
    finally:
        if attached is not None:
            stop(attached)
        for box in boxes.values():
            box.stop()
        host.kill()
        host.wait()
    print("time to recording (median of", ns.repeats, "attaches):")
    for mode, by in recording.items():
        print(f"  {mode:8} host {by['host']:.2f} s   container {by['container']:.2f} s")
    what = "with neither container traced (--control)" if ns.control else "under sampled mode"
    print(f"containerized redis-server {what}, -P 16, {ns.requests} requests a run, median of {ns.repeats}:")
    for test, r in ratio.items():
        print(f"  {test}: {r:.3f}x untraced (goal >= 0.97)")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"time_to_recording_s": recording, "throughput_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
