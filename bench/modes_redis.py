#!/usr/bin/env python3
"""heapscope's modes against Debian's redis-server (jemalloc), through the real CLI, in one run.

    sudo .venv/bin/python bench/modes_redis.py [--requests 200000] [--repeats 3] [--modes sampled,exact]

1. Throughput: redis-benchmark SET, GET and LPUSH (-n --requests, 8 times as many with -P 16, -r 1000000
   -d 200), each with and without -P 16: one redis-server untraced and one under `heapscope attach --mode=M`
   (its defaults otherwise) for each mode asked for, all up at once. heapscope is attached once and left
   attached, as on a service left for Prometheus to scrape; every server gets the same warm-up, and the timed
   runs start once heapscope is idle (its one-time work at the attach, symbolizing the first stacks, is not
   what a service left attached pays). Requests per second and p99 latency (redis-benchmark's own), the ratio
   to untraced; runs alternate between the servers, median of --repeats; and heapscope's own CPU during its
   server's runs (on a 2-core machine redis-server and redis-benchmark take both cores, so the daemon's CPU
   comes out of their throughput).
2. The live heap after `DEBUG POPULATE` (redis started with --enable-debug-command local): on a fresh redis,
   heapscope attached, `DEBUG POPULATE N key 200`, then heapscope's live heap at the end (its summary) in
   sampled mode against exact mode, and redis's own used_memory beside them.

Goals (issue "Production mode"): at least 0.97x throughput on every test in sampled mode; the live heap
within 10% of exact mode's after DEBUG POPULATE. Other work on the machine moves these figures: run it when
`uptime` shows a load below 1 and repeat a noisy run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchproc import cpu_seconds, wait_idle

REPO = Path(__file__).resolve().parents[1]
HEAPSCOPE = REPO / ".venv" / "bin" / "heapscope"
PORT = 16410
READY_TIMEOUT = 60.0
PIPELINED_REQUESTS = 8  # -P 16 runs take this many times --requests: each lasts about as long as a -P 1 run


def start_redis(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--enable-debug-command", "local"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while redis_cli(port, "PING") != "PONG":
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("redis-server did not start")
        time.sleep(0.05)
    return proc


def redis_cli(port: int, *args: str) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    except OSError:
        return ""
    done = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait()


class Heapscope:
    """`heapscope attach` in the background; returns once it says the profile is live."""

    def __init__(self, pid: int, mode: str, scratch: Path, *options: str) -> None:
        self.summary = scratch / f"summary-{mode}.json"
        cmd = [str(HEAPSCOPE), "attach", f"--mode={mode}", f"--summary-file={self.summary}",
               f"--massif-out-file={scratch / f'massif-{mode}.out'}", *options, str(pid)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=scratch)
        self.lines: list[str] = []
        ready = threading.Event()
        wanted = "sampler armed" if mode == "sampled" else "probes attached"

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                if wanted in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(READY_TIMEOUT) or self.proc.poll() is not None:
            self.proc.kill()
            raise SystemExit(f"heapscope did not start:\n{''.join(self.lines)}")

    def end(self) -> dict[str, object]:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(120)
        if self.proc.returncode != 0:
            raise SystemExit(f"heapscope failed:\n{''.join(self.lines)}")
        return json.loads(self.summary.read_text())  # type: ignore[no-any-return]


@dataclass
class Result:
    rps: float
    p99_ms: float



def run_benchmark(port: int, test: str, pipeline: int, requests: int) -> Result:
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-n", str(requests), "-r", "1000000", "-d", "200", "-t", test,
         "-P", str(pipeline), "--csv"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    row = next(ln for ln in out.splitlines() if ln.startswith('"' + test.upper()))
    cells = [c.strip('"') for c in row.split(",")]
    return Result(float(cells[1]), float(cells[6]))


@dataclass
class Server:
    """One redis-server of the comparison, untraced or with heapscope attached for the whole run."""

    config: str
    port: int
    redis: subprocess.Popen[bytes]
    profiler: Heapscope | None = None
    cpu_s: float = 0.0  # heapscope's CPU time during this server's timed runs
    wall_s: float = 0.0  # the timed runs' wall time

    def run(self, test: str, pipeline: int, requests: int) -> Result:
        cpu = cpu_seconds(self.profiler.proc.pid) if self.profiler else 0.0
        start = time.monotonic()
        res = run_benchmark(self.port, test, pipeline, requests)
        self.wall_s += time.monotonic() - start
        if self.profiler:
            self.cpu_s += cpu_seconds(self.profiler.proc.pid) - cpu
        return res


def throughput(configs: list[str], tests: list[str], requests: int, repeats: int, scratch: Path) -> None:
    """Every configuration's server up at once, each heapscope attached once and left attached, as on a service
    left for Prometheus to scrape (the attach's one-time work is not the steady cost measured here). Every server
    gets the same warm-up (its keys, heapscope's first stacks); then each test's runs alternate between the
    servers, the order turned round every repeat, so drift on the machine falls on all of them alike."""
    servers: list[Server] = []
    try:
        for i, config in enumerate(configs):
            port = PORT + 10 + i
            server = Server(config, port, start_redis(port))
            servers.append(server)
            if config != "untraced":
                server.profiler = Heapscope(server.redis.pid, config, scratch)
        for server in servers:
            for test in tests:
                run_benchmark(server.port, test, 16, requests * 4)
        for server in servers:
            if server.profiler is not None:
                wait_idle(server.profiler.proc.pid)
        for test in tests:
            for pipeline in (1, 16):
                n = requests if pipeline == 1 else requests * PIPELINED_REQUESTS
                got: dict[str, list[Result]] = {c: [] for c in configs}
                for rep in range(repeats):
                    for server in servers if rep % 2 == 0 else reversed(servers):
                        got[server.config].append(server.run(test, pipeline, n))
                base = statistics.median(r.rps for r in got["untraced"])
                base_p99 = statistics.median(r.p99_ms for r in got["untraced"])
                cells = [f"untraced {base:,.0f} req/s p99 {base_p99:.3f} ms"]
                for c in configs[1:]:
                    rps = statistics.median(r.rps for r in got[c])
                    p99 = statistics.median(r.p99_ms for r in got[c])
                    cells.append(f"{c} {rps / base:.3f}x p99 {p99:.3f} ms")
                runs = " ".join(f"{c}=[{', '.join(f'{r.rps:,.0f}' for r in got[c])}]" for c in configs)
                print(f"{test.upper():5s} -P {pipeline:2d}: " + "   ".join(cells) + f"   ({runs})", flush=True)
        for server in servers:
            if server.profiler is not None and server.wall_s:
                print(f"heapscope ({server.config}) CPU during its server's timed runs: "
                      f"{100 * server.cpu_s / server.wall_s:.1f}% of a core", flush=True)
            if server.profiler is not None:
                server.profiler.end()
                server.profiler = None
    finally:
        for server in servers:
            if server.profiler is not None:
                server.profiler.proc.kill()
            stop_redis(server.redis)


def populate(mode: str, keys: int, scratch: Path) -> tuple[int, int]:
    """heapscope's live heap at the end and redis's used_memory, after DEBUG POPULATE on a fresh redis."""
    redis = start_redis(PORT + 1)
    try:
        # Exact mode tracks every live block in a kernel table: room for all of them (DEBUG POPULATE makes about
        # five per key), so that none is dropped. Sampled mode tracks only its samples.
        room = 1 << (8 * keys).bit_length()
        profiler = Heapscope(redis.pid, mode, scratch, *([f"--max-blocks={room}"] if mode == "exact" else []))
        before = int(_info(PORT + 1, "used_memory"))
        reply = redis_cli(PORT + 1, "DEBUG", "POPULATE", str(keys), "key", "200")
        if reply != "OK":
            raise SystemExit(f"DEBUG POPULATE failed: {reply}")
        used = int(_info(PORT + 1, "used_memory")) - before
        time.sleep(0.3)
        summary = profiler.end()
        counters = summary["counters"]
        assert isinstance(counters, dict)
        if counters["dropped_blocks"]:
            raise SystemExit(f"{mode}: {counters['dropped_blocks']} blocks dropped (block table full)")
        return int(counters["heap"]), used
    finally:
        stop_redis(redis)


def _info(port: int, field: str) -> str:
    for line in redis_cli(port, "INFO", "memory").splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise SystemExit(f"redis INFO has no {field}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="sampled", help="comma-separated: sampled, exact")
    ap.add_argument("--tests", default="set,get,lpush")
    ap.add_argument("--keys", type=int, default=1_000_000, help="DEBUG POPULATE's key count")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("warning: not root: heapscope cannot attach", file=sys.stderr)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    modes = [m for m in args.modes.split(",") if m]
    configs = ["untraced", *modes]
    with tempfile.TemporaryDirectory(prefix="heapscope-modes-redis-") as tmp:
        scratch = Path(tmp)
        if not args.skip_throughput:
            throughput(configs, args.tests.split(","), args.requests, args.repeats, scratch)
        heaps: dict[str, tuple[int, int]] = {}
        for mode in ("exact", "sampled"):
            heaps[mode] = populate(mode, args.keys, scratch)
            print(f"DEBUG POPULATE {args.keys} key 200, {mode}: live heap {heaps[mode][0]:,} B "
                  f"(redis used_memory grew {heaps[mode][1]:,} B)", flush=True)
        ratio = heaps["sampled"][0] / heaps["exact"][0] if heaps["exact"][0] else float("nan")
        print(f"sampled / exact live heap after DEBUG POPULATE: {ratio:.4f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
