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
   attached, as a service left for Prometheus); redis-benchmark SET and GET (-n --requests), as redis-benchmark
   runs by default (50 clients, one request at a time each) and pipelined (-P 16: ten times the requests a
   second, the allocator's worst case), the runs alternating between the two. Two containers of one image are
   not equal on two shared cores (the --control ratio of two untraced ones was 0.85-0.96 on 2026-11-30), so the
   two swap roles half way (a crossover): the first is traced for the first half of the repeats, then heapscope
   leaves it and attaches to the second for the rest. The ratio is the geometric mean of the two halves' median
   ratios, in which a container's own advantage cancels. Goal: at least 0.97x. Beside it, the ratio of
   redis-server's CPU time a request (its user and system time over the run): the cost heapscope adds, less
   disturbed than the rate by other load on a shared machine. --control attaches nothing: the same ratios with
   neither traced are the bench's own spread.
"""

from __future__ import annotations

import argparse
import json
import os
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


PIPELINES = (1, 16)
# On a machine of two CPUs the scheduler puts a server and its client on one CPU or on two from run to run, which
# moves the rate by more than the goal's 3% (the --control ratio reached 1.15 on 2026-11-27): the servers are held
# on the last CPU, the client on the first; heapscope runs where the scheduler puts it.
SERVER_CPU = (os.cpu_count() or 1) - 1
CLIENT_CPU = ["taskset", "-c", "0"] if SERVER_CPU else []


def cpu_seconds(pid: int) -> float:
    """The process's time on a CPU, in nanoseconds summed over its threads by the scheduler (/proc/PID/stat's
    ticks are 10 ms: a tenth of a pipelined run)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def rates(port: int, pid: int, requests: int, pipeline: int) -> dict[str, tuple[float, float]]:
    """{test: (requests a second, redis-server's CPU microseconds a request)}, one redis-benchmark run a test."""
    out = {}
    for test in ("set", "get"):
        before = cpu_seconds(pid)
        done = subprocess.run([*CLIENT_CPU, "redis-benchmark", "-p", str(port), "-q", "-n", str(requests),
                               "-P", str(pipeline), "-t", test, "-r", "100000", "-d", "200"],
                              capture_output=True, text=True, check=True)
        rate = float(re.findall(r"[A-Z]+: ([\d.]+) requests per second", done.stdout)[0])
        out[test.upper()] = (rate, (cpu_seconds(pid) - before) * 1e6 / requests)
    return out


def crossover(halves: list[list[float]]) -> float:
    """The geometric mean of each half's median ratio (one half alone where there is only one)."""
    return statistics.geometric_mean([statistics.median(h) for h in halves if h])


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
    ports = {"host": 16431, "container": 16432, "first": 16433, "second": 16434}
    host = subprocess.Popen(["redis-server", *REDIS[1:], "--port", str(ports["host"])], stdout=subprocess.DEVNULL)
    boxes = {name: Container(runner, root, [*REDIS, "--port", str(ports[name])])
             for name in ("container", "first", "second")}
    attached = None
    # (test, pipeline) -> per half: the traced one's figure over the untraced one's, per repeat (rate, CPU)
    halves: dict[str, list[list[tuple[float, float]]]] = {}
    try:
        for port in ports.values():
            wait_redis(port)
        for box in boxes.values():
            os.sched_setaffinity(box.pid, {SERVER_CPU})
        recording = {} if ns.control else time_to_recording(
            {"host": host.pid, "container": boxes["container"].pid}, ns.repeats, work)
        for half, (traced, plain) in enumerate((("first", "second"), ("second", "first"))):
            if attached is not None:
                stop(attached)
                attached = None
            if not ns.control:
                _, attached = attach_until(boxes[traced].pid, "sampled", "sampler armed", work)
                time.sleep(2)  # its one-time work at the attach is done
            for name in (plain, traced):
                rates(ports[name], boxes[name].pid, ns.requests // 4, 16)  # warm-up
            for pipeline in PIPELINES:
                for i in range((ns.repeats + 1 - half) // 2):
                    got = {}
                    # Which goes first alternates, and the other way round in the second half: an odd count of
                    # repeats in a half then favours neither role over the two halves.
                    for name in (plain, traced) if (i + half) % 2 == 0 else (traced, plain):
                        got[name] = rates(ports[name], boxes[name].pid, ns.requests, pipeline)
                    for t in ("SET", "GET"):
                        pair = halves.setdefault(f"{t} -P {pipeline}", [[], []])[half]
                        pair.append((got[traced][t][0] / got[plain][t][0], got[traced][t][1] / got[plain][t][1]))
            if ns.repeats == 1:
                break
    finally:
        if attached is not None:
            stop(attached)
        for box in boxes.values():
            box.stop()
        host.kill()
        host.wait()
    ratio = {key: crossover([[r for r, _ in h] for h in hs]) for key, hs in halves.items()}
    cpu_ratio = {key: crossover([[c for _, c in h] for h in hs]) for key, hs in halves.items()}
    print("time to recording (median of", ns.repeats, "attaches):")
    for mode, by in recording.items():
        print(f"  {mode:8} host {by['host']:.2f} s   container {by['container']:.2f} s")
    what = "with neither container traced (--control)" if ns.control else "under sampled mode"
    print(f"containerized redis-server {what}, {ns.requests} requests a run, {ns.repeats} repeats in two halves:")
    for test, r in ratio.items():
        print(f"  {test:9} throughput {r:.3f}x untraced (goal >= 0.97); CPU a request {cpu_ratio[test]:.3f}x")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"time_to_recording_s": recording, "throughput_ratio": ratio,
                                             "cpu_per_request_ratio": cpu_ratio}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
