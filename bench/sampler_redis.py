#!/usr/bin/env python3
"""Sampled mode's sampler against Debian's redis-server (jemalloc, BIND_NOW, full RELRO), in one run.

    sudo .venv/bin/python bench/sampler_redis.py [--cycles 1000] [--requests 200000]

1. Soak: a redis-server on a private loopback port, loaded by redis-benchmark in a loop, and a checker
   thread that SETs and GETs its own keys and compares every reply. The sampler is injected once, then
   armed and disarmed --cycles times (half the disarms by request, half by dropping the lease, as a killed
   heapscope does). At the end: crashes (redis must still answer PING), wrong or failed replies (must be 0).
2. Throughput: redis-benchmark SET/GET (-n --requests -r 1000000 -d 200), with and without -P 16, on a fresh
   redis each time: untraced, sampler armed at 512 KiB without a probe, and armed with tracefs uprobes on
   the probe functions (a stand-in for the eBPF programs, which are not wired to a command yet).
   Interleaved, median of --repeats.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.process.inject import inject  # noqa: E402
from agent.process.sampler import SamplerControl, build_sampler  # noqa: E402
from tests.support.sampler_probes import sample_trace  # noqa: E402

PORT = 16400


def start_redis(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--enable-debug-command", "local"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while ping(port) != b"+PONG":
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("redis-server did not start")
        time.sleep(0.05)
    return proc


def command(sock: socket.socket, *args: bytes) -> bytes:
    sock.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        data += chunk
        if data.startswith((b"+", b"-", b":")) and data.endswith(b"\r\n"):
            return data[:-2]
        if data.startswith(b"$-1\r\n"):
            return b"(nil)"
        if data.startswith(b"$"):
            head, _, rest = data.partition(b"\r\n")
            if len(rest) >= int(head[1:]) + 2:
                return rest[: int(head[1:])]


def ping(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            return command(s, b"PING")
    except OSError:
        return b""


class Checker(threading.Thread):
    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.checked = 0
        self.wrong = 0
        self.failed = 0

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            i = 0
            while not self.stop.is_set():
                key, value = b"check:%d" % (i % 5000), b"v%d-" % i * 8
                try:
                    if command(s, b"SET", key, value) != b"+OK":
                        self.wrong += 1
                    if command(s, b"GET", key) != value:
                        self.wrong += 1
                except OSError:
                    self.failed += 1
                    return
                self.checked += 1
                i += 1


def soak(lib: Path, cycles: int) -> None:
    redis = start_redis(PORT)
    load = None
    try:
        load = subprocess.Popen(
            ["sh", "-c", f"while true; do redis-benchmark -p {PORT} -n 100000 -r 1000000 -d 200 -t set,get,lpush "
             "-q >/dev/null 2>&1; done"],
            start_new_session=True,
        )  # fmt: skip
        checker = Checker(PORT)
        checker.start()
        time.sleep(0.5)
        done = inject(redis.pid, lib)
        print(f"soak: injected in {done.seconds * 1e3:.1f} ms (thread {done.tid})")
        samples = 0
        for cycle in range(cycles):
            ctl = SamplerControl(redis.pid, lib)
            ctl.arm(524288)
            time.sleep(0.05)
            if cycle % 2:
                st = ctl.disarm()
            else:
                ctl.close()
                watch = SamplerControl(redis.pid, lib)
                while (st := watch.read()).state == "armed":
                    time.sleep(0.002)
                watch.close()
            samples = st["samples"]
            if redis.poll() is not None:
                break
        checker.stop.set()
        checker.join(10)
        alive = ping(PORT) == b"+PONG" and redis.poll() is None
        print(
            f"soak: {cycles} arm/disarm cycles, redis alive: {alive}, checked replies: {checker.checked}, wrong: "
            f"{checker.wrong}, failed: {checker.failed}, samples taken: {samples}"
        )
    finally:
        if load is not None:
            os.killpg(load.pid, signal.SIGTERM)  # the loop and the redis-benchmark it runs
            load.wait()
        redis.terminate()
        redis.wait()


def benchmark(lib: Path, config: str, tests: str, pipeline: int, requests: int) -> float:
    redis = start_redis(PORT + 1)
    try:
        with ExitStack() as stack:
            if config != "untraced":
                inject(redis.pid, lib)
                ctl = SamplerControl(redis.pid, lib)
                stack.callback(ctl.close)
                if config.endswith("uprobe"):
                    stack.enter_context(sample_trace(lib))
                ctl.arm(524288)
            out = subprocess.run(
                ["redis-benchmark", "-p", str(PORT + 1), "-n", str(requests), "-r", "1000000", "-d", "200", "-t",
                 tests, "-P", str(pipeline), "--csv"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
        line = next(ln for ln in out.splitlines() if ln.startswith('"' + tests.upper()))
        return float(line.split(",")[1].strip('"'))
    finally:
        redis.terminate()
        redis.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=200000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        os.chmod(cache, 0o755)
        lib = build_sampler(cache)
        soak(lib, args.cycles)
        configs = ("untraced", "armed", "armed + uprobe")
        for tests in ("set", "get", "lpush"):
            for pipeline in (1, 16):
                rps: dict[str, list[float]] = {c: [] for c in configs}
                for _ in range(args.repeats):
                    for config in configs:
                        rps[config].append(benchmark(lib, config, tests, pipeline, args.requests))
                base = statistics.median(rps["untraced"])
                cells = "   ".join(f"{c}: {statistics.median(rps[c]) / base:.3f}x" for c in configs[1:])
                print(f"{tests.upper():5s} -P {pipeline:2d}: untraced {base:,.0f} req/s   {cells}")


if __name__ == "__main__":
    main()
