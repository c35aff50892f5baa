#!/usr/bin/env python3
"""What sampled mode costs one request of a panel service, and where: the machine's CPU a request, heapscope's
daemon's, and each of heapscope's BPF programs' (issue 31: a service that forks its workers as it serves).

    sudo .venv/bin/python bench/request_cost.py [--service apache2] [--seconds 10] [--perf] [--json FILE]

One instance of the service (tests/support/services.py) under its load tool, measured in turn: untraced; with only
its main process attached by PID (its workers unprofiled: what heapscope costs processes it does not profile; with
--serve-args=--page-calls=yes, the machine-wide syscall tracepoints);
with `heapscope serve` following all of it through a selector, as the panel does (sampled mode, serve's defaults:
the history store and MALT on, unless --serve-args says otherwise); and after the daemon is stopped. Each state is
measured twice. A request's CPU is the machine's busy time (/proc/stat) over the requests served, so the load tool's
share is in it; the daemon's is its own CPU over the same requests; the BPF programs' is their run time with
kernel.bpf_stats_enabled on (restored after), which leaves out the uprobe traps around them. With --perf, the
whole machine is also sampled during each measure (bench/perfshare.py): the service's own CPU a request, and of it
what its processes spent inside heapscope's probes (the uprobe's way into the kernel with the BPF programs) and in
the injected sampler's code: what the profiled service itself pays, which the throughput ratio follows, apart from
the daemon's CPU, which the machine pays. bench/service_panel.py measures the throughput this costs; this says where
it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import perfshare
import psutil
from benchproc import cpu_seconds, wait_idle
from pair_cost import STATS, bpf_programs, totals_by_name
from service_panel import Daemon, follow_all, one_service_options

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.services import SERVICES, Service  # noqa: E402


@dataclass
class Measure:
    state: str
    rate: float  # requests a second
    machine_us: float  # the machine's CPU a request, in µs
    daemon_us: float  # heapscope's daemon's
    bpf_us: dict[str, float] = field(default_factory=dict)  # each BPF program's run time a request, by name
    bpf_runs: dict[str, float] = field(default_factory=dict)  # its runs a request (a sampled call: a sample)
    perf: dict[str, float] = field(default_factory=dict)  # --perf: µs a request by where perf's samples fell

    def line(self) -> str:
        top = sorted(self.bpf_us.items(), key=lambda kv: -kv[1])[:6]
        progs = ", ".join(f"{name} {us:.2f}" + self._per_run(name, us) for name, us in top)
        return (f"{self.state:12s} {self.rate:9,.0f}/s  machine {self.machine_us:6.1f} µs  daemon "
                f"{self.daemon_us:5.1f} µs  BPF {sum(self.bpf_us.values()):5.2f} µs" + (f" ({progs})" if progs else "")
                + self._perf_line())

    def _perf_line(self) -> str:
        p = self.perf
        if not p:
            return ""
        share = 100 / p["service"] if p["service"] else 0.0
        return (f"\n{'':12s} perf: the service {p['service']:.1f} µs a request, of which heapscope's probes "
                f"{p['probes']:.2f} µs ({share * p['probes']:.1f}%: BPF {p['bpf']:.2f}, the way in "
                f"{p['probes'] - p['bpf']:.2f}) and the sampler's code {p['sampler']:.2f} µs "
                f"({share * p['sampler']:.1f}%)")

    def _per_run(self, name: str, us: float) -> str:
        """A program's runs a request and time a run: what a sample costs, apart from how many there are."""
        runs = self.bpf_runs.get(name, 0.0)
        return f" [{runs:.2f} runs, {1000 * us / runs:,.0f} ns a run]" if runs >= 0.01 else ""


def busy_seconds() -> float:
    """The machine's busy CPU time so far (all CPUs; idle and iowait left out)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def bpf_runs_and_ns() -> dict[str, tuple[int, int]]:
    """Every loaded BPF program's runs and run time so far (ns), by name."""
    return totals_by_name(bpf_programs().values())


def measure(svc: Service, state: str, seconds: float, daemon_pid: int | None, perf_dir: Path | None = None) -> Measure:
    busy0, bpf0 = busy_seconds(), bpf_runs_and_ns()
    cpu0 = cpu_seconds(daemon_pid) if daemon_pid else 0.0
    data = perf_dir / f"{state.replace(' ', '-')}.data" if perf_dir is not None else None
    sampling = perfshare.record(seconds, data) if data is not None else None
    got = svc.load(seconds)
    busy1, bpf1 = busy_seconds(), bpf_runs_and_ns()
    cpu1 = cpu_seconds(daemon_pid) if daemon_pid else 0.0
    if sampling is not None:
        sampling.wait()
    if not got.ok:
        raise SystemExit(f"{state}: the load failed: {got.error}")
    n = got.rate * seconds
    bpf: dict[str, float] = {}
    runs: dict[str, float] = {}
    for name, (runs1, ns1) in bpf1.items():
        runs0, ns0 = bpf0.get(name, (0, 0))
        if ns1 > ns0:  # the programs that ran during the load: µs and runs a request
            bpf[name] = (ns1 - ns0) / n / 1000
            runs[name] = (runs1 - runs0) / n
    m = Measure(state, got.rate, 1e6 * (busy1 - busy0) / n, 1e6 * (cpu1 - cpu0) / n, bpf, runs)
    if data is not None:
        # perf samples for as long as the load runs, not for exactly its requests: the rate scales them
        sh = perfshare.attribute(data, psutil.Process(svc.main_pid).name())
        m.perf = {k: sh.us(getattr(sh, k), got.rate * seconds) for k in ("service", "probes", "bpf", "sampler")}
        data.unlink()
    print(m.line(), flush=True)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_service_options(ap, 10.0, "each measure's load run")
    ap.add_argument("--perf", action="store_true", help="also sample the machine with perf: where its CPU goes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/request_cost.py needs root (BPF statistics, attaching)")
    if args.perf and (why := perfshare.available()):
        raise SystemExit(f"--perf: {why}")
    with open(STATS) as f:
        stats_before = f.read().strip()
    out: list[Measure] = []
    try:
        with open(STATS, "w") as f:
            f.write("1")
        with tempfile.TemporaryDirectory(prefix="heapscope-request-cost-") as tmp, SERVICES[args.service]() as svc:
            perf_dir = Path(tmp) if args.perf else None
            svc.load(3.0)
            out += [measure(svc, "untraced", args.seconds, None, perf_dir) for _ in range(2)]
            daemon = Daemon(Path(tmp), store=True, serve_args=shlex.split(args.serve_args))
            try:
                got = daemon.client.post("/targets", json={"pid": svc.main_pid})
                if got.status_code >= 300:
                    raise SystemExit(f"cannot attach {svc.main_pid}: {got.text}")
                svc.load(3.0)
                wait_idle(daemon.proc.pid)
                out += [measure(svc, "main only", args.seconds, daemon.proc.pid, perf_dir) for _ in range(2)]
                daemon.client.delete(f"/targets/{svc.main_pid}")
                follow_all(daemon, svc)
                out += [measure(svc, "all followed", args.seconds, daemon.proc.pid, perf_dir) for _ in range(2)]
            finally:
                daemon.stop()
            svc.load(3.0)
            out += [measure(svc, "detached", args.seconds, None, perf_dir) for _ in range(2)]
    finally:
        with open(STATS, "w") as f:
            f.write(stats_before)
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for m in out], indent=2) + "\n")


if __name__ == "__main__":
    main()
