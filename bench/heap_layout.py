#!/usr/bin/env python3
"""How much of a service's slowdown under sampled mode is its heap's layout, not heapscope's work: the apache2 of the
service panel, untraced, before and after its master's heap is moved by a few bytes with no profiler in sight.

    sudo .venv/bin/python bench/heap_layout.py [--shift 2000] [--seconds 3]

glibc's malloc gives the top of its heap back to the kernel once the free top passes M_TRIM_THRESHOLD; a worker
that allocates and frees zlib's state at every gzipped response sits, in this configuration, a few hundred bytes
below that line. Anything that stays in the master's heap moves every worker forked from it: above the line, it
trims and grows its heap again at every request, and the pages it grows into are faulted in again: same requests,
same code, more system time. Sampled mode loads a library into the master; it did move the workers over the line
until its dlopen ran on a thread of its own (the loader's blocks then come from that thread's arena) and the
library stopped linking libm (whose loading alone did it: docs/benchmarks.md, "The service panel").

The runs, on the panel's apache2 (tests/support/services.py, its workers never replaced here so the pool is the
same throughout):
1. untraced: ab's rate and the workers' minor page faults a request;
2. the master's heap moved by --shift bytes (gdb calls malloc in the master once), the workers replaced by new
   forks of it: the same figures, still with nothing attached;
3. with --heapscope: a fresh instance, profiled by `heapscope serve` in sampled mode through a selector, then
   detached (the library stays loaded, the hooks restored): the same figures at each step.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from service_panel import Daemon

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.services import SERVICES, Service  # noqa: E402

TOKEN = "heap-layout-bench"


class Apache(SERVICES["apache2"]):  # type: ignore[misc,valid-type]
    MAX_CONNECTIONS_PER_CHILD = 0  # never replaced by the master: the same workers through a run


def measure(svc: Service, seconds: float, label: str) -> None:
    before = svc.minor_faults()
    got = svc.load(seconds)
    faults = svc.minor_faults() - before
    per_request = faults / max(1.0, got.rate * seconds)
    print(f"{label:<48} {got.rate:>9,.0f} requests/s {per_request:6.1f} minor faults a request", flush=True)


def shift_master(svc: Service, nbytes: int) -> None:
    """One malloc in the master, by gdb; then every worker replaced by a fresh fork of it."""
    subprocess.run(["gdb", "-p", str(svc.main_pid), "-batch", "-ex", f"call (void *) malloc({nbytes})"],
                   capture_output=True, check=True, timeout=60)
    for pid in svc.workers_now():
        os.kill(pid, signal.SIGKILL)
    time.sleep(2 * svc.MAINTENANCE_INTERVAL)
    svc.settled_workers()


def with_heapscope(seconds: float) -> None:
    with tempfile.TemporaryDirectory(prefix="heapscope-layout-bench-") as tmp, Apache() as svc:
        daemon = Daemon(Path(tmp))
        try:
            svc.load(1.0)
            measure(svc, seconds, "untraced (a fresh instance)")
            chosen = daemon.client.post("/targets", json={"cmdline": svc.selector}).json()
            time.sleep(6)  # every process armed (the service panel times it: 3-4 s)
            svc.load(1.0)
            measure(svc, seconds, "sampled mode, armed")
            daemon.client.delete(f"/selectors/{chosen['id']}")
            for pid in svc.pids():
                daemon.client.delete(f"/targets/{pid}")
            time.sleep(1)
            measure(svc, seconds, "detached (the library loaded, hooks restored)")
        finally:
            daemon.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shift", type=int, default=2000, help="bytes malloc'd in the master (default 2000)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds of ab a measure (default 3)")
    p.add_argument("--heapscope", action="store_true", help="also a run attached and detached in sampled mode")
    a = p.parse_args()
    with Apache() as svc:
        svc.load(1.0)
        measure(svc, a.seconds, "untraced")
        shift_master(svc, a.shift)
        svc.load(1.0)
        measure(svc, a.seconds, f"untraced, the master's heap moved by {a.shift} B")
    if a.heapscope:
        with_heapscope(a.seconds)


if __name__ == "__main__":
    main()
