#!/usr/bin/env python3
"""How long heapscope holds a served process's threads stopped (ptrace) while the daemon follows it under its load:
each stop from the scheduler's view, with the kernel's sched_switch tracepoint.

    sudo .venv/bin/python bench/target_stops.py                          # postgres and apache2, 5 runs of 4 s
    sudo .venv/bin/python bench/target_stops.py --services postgres --runs 10

A stop starts when a thread leaves the CPU in the traced state (__TASK_TRACED: seized by heapscope's injection, or
single-stepped through one of its system calls) and ends when it is back on a CPU. Sampled mode seizes a thread of
each new process forked from an armed one (a prefork server's worker, a database's backend) to start its sampler
again, and any process whose sampler runs without a thread of its own at each request: a stopped backend may hold a
lock every client waits for, so this time is a stall of the service, not of one thread. Unlike a throughput ratio,
it does not move with the machine's noise: the figure is the target's own stopped time.

For each service of tests/support/services.py: one instance, `heapscope serve` (sampled mode, its defaults, with
its history store) attached through a selector of its main process, a warm-up, then --runs runs of the service's
load tool, traced. The table: the processes stopped in the runs (new ones: the load tool's connections), the stops,
their total and longest, and the total per stopped process.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bcc import BPF
from benchproc import wait_idle
from service_panel import Daemon, Row, attach

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.services import SERVICES  # noqa: E402

TRACED = 0x8  # __TASK_TRACED in sched_switch's prev_state

PROGRAM = r"""
struct stop { u64 at; u32 tgid; };
struct total { u64 stops; u64 ns; u64 longest; };
BPF_HASH(stopped, u32, struct stop);    /* thread id -> when it left the CPU traced, and its process */
BPF_HASH(totals, u32, struct total);    /* process id -> its stops */

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid, next = args->next_pid;
    if (args->prev_state & TRACED) {
        struct stop s = {.at = now, .tgid = bpf_get_current_pid_tgid() >> 32};
        stopped.update(&prev, &s);
    }
    struct stop *s = stopped.lookup(&next);
    if (!s)
        return 0;
    u64 ns = now - s->at;
    u32 tgid = s->tgid;
    stopped.delete(&next);
    struct total zero = {}, *t = totals.lookup_or_try_init(&tgid, &zero);
    if (t) {
        __sync_fetch_and_add(&t->stops, 1);
        __sync_fetch_and_add(&t->ns, ns);
        if (ns > t->longest)
            t->longest = ns;
    }
    return 0;
}
"""


@dataclass
class Stops:
    service: str
    runs: int
    processes: int = 0
    stops: int = 0
    total_ms: float = 0.0
    longest_ms: float = 0.0
    rate: float = 0.0  # the load tool's median rate over the runs

    def line(self) -> str:
        per = self.total_ms / self.processes if self.processes else 0.0
        return (f"| {self.service} | {self.runs} | {self.rate:,.0f} | {self.processes} | {self.stops} | "
                f"{self.total_ms:.1f} ms | {self.longest_ms:.2f} ms | {per:.2f} ms |")  # fmt: skip


def measure(name: str, runs: int, seconds: float) -> Stops:
    cls = SERVICES[name]
    missing = cls.missing()
    if missing:
        raise SystemExit(f"{name}: not installed: {', '.join(missing)}")
    out = Stops(name, runs)
    with tempfile.TemporaryDirectory(prefix=f"heapscope-stops-{name}-") as tmp, cls() as svc:
        daemon = Daemon(Path(tmp), store=True)
        try:
            row = Row(name, cls.tool)
            if attach(daemon, svc, 120, row) is None:
                raise SystemExit(f"{name}: not every process armed: {'; '.join(row.errors)}")
            svc.load(min(seconds, 2.0))
            wait_idle(daemon.proc.pid)
            bpf = BPF(text=PROGRAM, cflags=[f"-DTRACED={TRACED}"])
            rates = []
            for _ in range(runs):
                svc.settle()
                got = svc.load(seconds)
                if not got.ok:
                    raise SystemExit(f"{name}: {got.tool}: {got.error}")
                rates.append(got.rate)
            time.sleep(0.5)  # a stop that began at the end of the last run ends
            for _, t in bpf["totals"].items():
                out.processes += 1
                out.stops += t.stops
                out.total_ms += t.ns / 1e6
                out.longest_ms = max(out.longest_ms, t.longest / 1e6)
            bpf.cleanup()
            out.rate = sorted(rates)[len(rates) // 2]
        finally:
            daemon.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", default="postgres,apache2", help="comma-separated names (tests/support/services.py)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    print("| service | runs | rate /s | processes stopped | stops | stopped in all | longest stop | per process |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.services.split(","):
        print(measure(name, args.runs, args.seconds).line(), flush=True)


if __name__ == "__main__":
    main()
