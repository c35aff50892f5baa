#!/usr/bin/env python3
"""Sampled mode on the panel of real servers (issue 31): each service's own load tool untraced and with heapscope
attached, side by side, and the time from the attach to every sampler armed.

    sudo .venv/bin/python bench/service_panel.py                  # every service, 5 s runs, 3 repeats
    sudo .venv/bin/python bench/service_panel.py --quick          # 2 s runs, 2 repeats
    sudo .venv/bin/python bench/service_panel.py --services nginx,redis --json out.json

For each service of tests/support/services.py, two instances run at once: one untraced, one profiled by `heapscope
serve` (sampled mode, its defaults) through a selector of its main process, so that its workers are followed as
the daemon follows them in production. The time to armed runs from the POST of the selector (the daemon is up and
idle) to the moment every process of the instance has its sampler armed, read from the sampler's control block in
each process; a process not armed within --armed-timeout is counted and its /targets error shown. Each instance gets
the same warm-up (a run's length: warm_up) and, before every pair of runs, is settled (Service.settle: postgres
vacuums and checkpoints, so that one instance's autovacuum and checkpointer do not run in the other's next run); the
load runs alternate between them, the order turned round every repeat, so that drift on the machine falls on both
alike (the two runs of a repeat are next to each other, so slow drift cancels in each repeat's ratio of the
profiled rate over the untraced one).

Two instances of one service on two shared cores are not equal either (one's processes may sit on the CPU that
takes the interrupts): the instances swap roles half way (a crossover). The first is profiled for the first half
of the repeats, then detached (selector and targets deleted) and the second profiled for the rest. The ratio is
the geometric mean of the repeats' ratios, each half and each order weighing alike: an instance's own advantage
cancels across the halves, the order's within each (Row.ratio). Its 95% interval (±, Row.spread) comes from the
repeats' scatter. --control attaches nothing, with the same crossover: its ratio is the bench's own spread. The load
tools run on the same two cores as the servers and heapscope, so heapscope's CPU comes out of the throughput. The
daemon keeps no history store (--no-store) unless --store is given: serve's default keeps one. --serve-args adds
options of `heapscope serve` (what one costs: --serve-args="--malt=no").

Goal (issue 31): a ratio of at least 0.97 on every service. Run it when `uptime` shows a load below 1. A service
that replaces its workers as they serve (apache2's MaxConnectionsPerChild) needs runs of several of their lives:
with 4 s runs, apache2's run after the other instance's was 20% slower than the one after its own, and a repeat's
ratio scattered by 17% (untraced against untraced); with 10 s runs by 6.5%, and the order no longer showed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from benchproc import cpu_seconds, free_port, heapscope_cmd, wait_idle

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.armed import sampler_state  # noqa: E402
from tests.support.services import SERVICES, Service, ServiceError  # noqa: E402

TOKEN = "service-panel-bench"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START_TIMEOUT = 60.0


@dataclass
class Row:
    service: str
    tool: str
    processes: int = 0
    armed: int = 0
    time_to_first_armed_s: float | None = None
    time_to_armed_s: float | None = None  # every process armed; None: not all were
    untraced: list[float] = field(default_factory=list)  # the load tool's rate, per run
    profiled: list[float] = field(default_factory=list)
    swapped_at: int | None = None  # the first run with the other instance profiled (the crossover)
    time_to_armed_swapped_s: float | None = None  # the second instance's
    errors: list[str] = field(default_factory=list)  # load runs that failed, processes not armed
    exited: int = 0  # processes that exited before they were armed (a prefork server reaps its idle workers)
    daemon_cpu_percent: float | None = None  # heapscope's CPU during the profiled runs, % of a core

    def _groups(self) -> dict[int, list[float]]:
        """The repeats' log ratios (profiled rate over untraced) by group: half (before or after the swap) and order
        (which instance ran first), 0-3."""
        cut = len(self.profiled) if self.swapped_at is None else self.swapped_at
        groups: dict[int, list[float]] = {}
        for i, (u, p) in enumerate(zip(self.untraced, self.profiled, strict=False)):
            if u > 0 and p > 0:
                groups.setdefault((i >= cut) * 2 + i % 2, []).append(math.log(p / u))
        return groups

    @property
    def ratio(self) -> float | None:
        """The geometric mean of the ratios, each order of each half weighing alike: the run that follows the other
        instance's is the slower by up to 20% (apache2's, with either profiled), so a median of the repeats of both
        orders could fall in either. An instance's own advantage cancels across the halves, the order's within."""
        groups = self._groups()
        return math.exp(statistics.fmean(statistics.fmean(xs) for xs in groups.values())) if groups else None

    @property
    def spread(self) -> float | None:
        """The ratio's 95% interval, as a factor's distance from 1 (0.05: the ratio is known to ±5%): from the
        repeats' scatter about their group's mean."""
        groups = self._groups()
        free = sum(len(xs) for xs in groups.values()) - len(groups)
        if free < 2:
            return None
        means = {g: statistics.fmean(xs) for g, xs in groups.items()}
        var = sum((x - means[g]) ** 2 for g, xs in groups.items() for x in xs) / free
        # Each group's mean carries var/n; the ratio is the mean of the groups' means.
        se = math.sqrt(sum(var / len(xs) for xs in groups.values())) / len(groups)
        return math.exp(1.96 * se) - 1


class Daemon:
    """`heapscope serve` in sampled mode (its default), on a free loopback port; with no history store unless
    `store` (serve's default: each target's history under the output directory)."""

    def __init__(self, scratch: Path, store: bool = False, serve_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.log = scratch / "daemon.log"
        env = {**os.environ, "HEAPSCOPE_TOKEN": TOKEN}
        cmd = [*heapscope_cmd(), "serve", "--http", f"127.0.0.1:{self.port}", "--output-dir", str(scratch / "out"),
               *(() if store else ("--no-store",)), *serve_args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"), env=env)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", headers=AUTH, timeout=60)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"heapscope serve exited with {self.proc.returncode}: {self.last_line()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"heapscope serve did not answer in {START_TIMEOUT:.0f} s: {self.last_line()}")
            time.sleep(0.1)

    def last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def lines_about(self, pid: int) -> list[str]:
        """The daemon's last log lines about the process (a refusal says why)."""
        about = [ln for ln in self.log.read_text(errors="replace").splitlines() if re.search(rf"\b{pid}\b", ln)]
        trouble = [ln for ln in about if re.search(r"cannot|refus|waiting|error|fail", ln)]
        return (trouble or about)[-3:]

    def targets(self) -> dict[int, dict[str, Any]]:
        return {t["pid"]: t for t in self.client.get("/targets").json()}

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def detach(daemon: Daemon, svc: Service, timeout: float) -> None:
    """DELETE every selector and target, and wait until no process of the instance has its sampler armed."""
    for sel in daemon.client.get("/selectors").json():
        daemon.client.delete(f"/selectors/{sel['id']}")
    for pid in daemon.targets():
        daemon.client.delete(f"/targets/{pid}")
    deadline = time.monotonic() + timeout
    while any(sampler_state(p) == "armed" for p in svc.pids()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{svc.name}: still armed {timeout:.0f} s after the detach")
        time.sleep(0.05)


def attach(daemon: Daemon, svc: Service, timeout: float, row: Row) -> float | None:
    """POST the selector and time every process of the instance to armed: the time, None if not all were."""
    pids = svc.pids()
    row.processes = len(pids)
    start = time.monotonic()
    r = daemon.client.post("/targets", json={"cmdline": svc.selector})
    if r.status_code != 201:
        raise SystemExit(f"{svc.name}: POST /targets: {r.status_code} {r.text}")
    armed: dict[int, float] = {}
    exited: set[int] = set()  # gone before they were armed: nothing of theirs left to profile
    looked = start
    while len(armed) + len(exited) < len(pids) and time.monotonic() - start < timeout:
        for pid in pids:
            if pid in armed or pid in exited:
                continue
            state = sampler_state(pid)
            if state == "armed":
                armed[pid] = time.monotonic() - start
            elif state == "gone" and not os.path.exists(f"/proc/{pid}"):
                exited.add(pid)
        if time.monotonic() - looked > 1.0:  # every one left refused for good: no need to wait on
            looked = time.monotonic()
            have = daemon.targets()
            if all(have.get(p, {}).get("state") == "refused" for p in pids if p not in armed and p not in exited):
                break
        time.sleep(0.02)
    row.armed = len(armed)
    row.exited = len(exited)
    if armed:
        row.time_to_first_armed_s = min(armed.values())
    everyone = max(armed.values()) if armed and len(armed) + len(exited) == len(pids) else None
    roles = svc.processes()
    have = daemon.targets()
    for pid in pids:
        if pid not in armed and pid not in exited:
            t = have.get(pid)
            why = "not in /targets" if t is None else f"{t['state']}: {t['error']}"
            row.errors.append(f"{pid} ({roles.get(pid, '?')}) not armed after {time.monotonic() - start:.0f} s: "
                              f"sampler {sampler_state(pid)}; {why}")
            if t is None or not t["error"]:  # else /targets said why
                row.errors += [f"  daemon: {ln}" for ln in daemon.lines_about(pid)]
    return everyone


def attach_all(daemon: Daemon, svc: Service) -> None:
    """Follow every process of the instance through its selector; exit, saying why, if any is not armed."""
    row = Row(svc.name, svc.tool)
    attach(daemon, svc, 60.0, row)
    if row.errors:
        raise SystemExit("; ".join(row.errors))


def follow_all(daemon: Daemon, svc: Service) -> None:
    """attach_all, then warm the instance up under its load until the daemon is idle again (its one-time work after
    the attach left out of what is measured next)."""
    attach_all(daemon, svc)
    svc.load(3.0)
    wait_idle(daemon.proc.pid)


def one_service_options(ap: argparse.ArgumentParser, seconds: float, seconds_help: str) -> None:
    """The options of a bench of one panel service under `heapscope serve`: --service, --seconds, --serve-args."""
    ap.add_argument("--service", default="apache2", choices=sorted(SERVICES))
    ap.add_argument("--seconds", type=float, default=seconds, help=seconds_help)
    ap.add_argument("--serve-args", default="", metavar="ARGS", help="more options of `heapscope serve`")


def warm_up(seconds: float) -> float:
    """The load after each attach, before the count: a run's length, at least 2 s. A prefork server's workers are
    replaced several times over in it (apache2's live about 3 s under ab), so that the daemon's one-time work for
    the service's objects and stacks, done when the first generation of followed workers ends, is not counted in
    the first measured run: with 2 s, the first pair after each attach scored 0.92-0.93 against 0.95 overall."""
    return max(seconds, 2.0)


def measure(name: str, seconds: float, repeats: int, armed_timeout: float, store: bool = False,
            control: bool = False, serve_args: Sequence[str] = ()) -> Row:  # fmt: skip
    cls = SERVICES[name]
    row = Row(name, cls.tool)
    missing = cls.missing()
    if missing:
        row.errors.append(f"not installed: {', '.join(missing)}")
        return row
    with tempfile.TemporaryDirectory(prefix=f"heapscope-panel-bench-{name}-") as tmp, cls() as first, \
            cls() as second:  # fmt: skip
        daemon = Daemon(Path(tmp), store, serve_args)
        plain, profiled = second, first
        try:
            if not control:
                row.time_to_armed_s = attach(daemon, profiled, armed_timeout, row)
            for svc in (plain, profiled):  # the same warm-up for both (and heapscope's first stacks)
                svc.load(warm_up(seconds))
            wait_idle(daemon.proc.pid)
            cpu = wall = 0.0
            for rep in range(repeats):
                if rep == (repeats + 1) // 2 and repeats > 1:  # the crossover: the other instance profiled
                    row.swapped_at = len(row.profiled)
                    plain, profiled = first, second
                    if not control:
                        detach(daemon, plain, armed_timeout)
                        swapped = Row(name, cls.tool)  # the table shows the first instance's counts
                        row.time_to_armed_swapped_s = attach(daemon, profiled, armed_timeout, swapped)
                        row.errors += swapped.errors
                        profiled.load(warm_up(seconds))
                        wait_idle(daemon.proc.pid)
                for svc in (plain, profiled):  # what the runs before left in the background, done before these
                    svc.settle()
                for svc in (plain, profiled) if rep % 2 == 0 else (profiled, plain):
                    cpu0, t0 = cpu_seconds(daemon.proc.pid), time.monotonic()
                    got = svc.load(seconds)
                    if svc is profiled:
                        cpu += cpu_seconds(daemon.proc.pid) - cpu0
                        wall += time.monotonic() - t0
                    label = "profiled" if svc is profiled else "untraced"
                    if not got.ok:
                        row.errors.append(f"{label} run {rep + 1}: {got.error}")
                    (row.profiled if svc is profiled else row.untraced).append(got.rate)
            row.daemon_cpu_percent = 100 * cpu / wall if wall else None
            for svc in (first, second):
                if not svc.answers():
                    row.errors.append(f"the {'first' if svc is first else 'second'} instance stopped answering")
        finally:
            daemon.stop()
    return row


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def table(rows: list[Row]) -> str:
    head = ("service", "tool", "processes", "armed", "time to armed", "untraced /s", "profiled /s", "ratio",
            "heapscope CPU")  # fmt: skip
    lines = []
    for r in rows:
        ratio = r.ratio
        # Not all armed: the time the first one took, if any was.
        to_armed = fmt_s(r.time_to_armed_s) if r.time_to_armed_s is not None else (
            f"- (first {fmt_s(r.time_to_first_armed_s)})" if r.armed else "-")
        if r.swapped_at is not None and r.time_to_armed_s is not None:  # and the second instance's, after the swap
            to_armed += f" / {fmt_s(r.time_to_armed_swapped_s)}"
        armed = f"{r.armed}/{r.processes}" + (f" ({r.exited} exited)" if r.exited else "")
        lines.append((
            r.service, r.tool, str(r.processes), armed, to_armed,
            f"{statistics.median(r.untraced):,.0f}" if r.untraced else "-",
            f"{statistics.median(r.profiled):,.0f}" if r.profiled else "-",
            "-" if ratio is None else f"{ratio:.3f}" + (f" ±{100 * r.spread:.1f}%" if r.spread is not None else "")
            + ("" if ratio >= 0.97 else " (<0.97)"),
            "-" if r.daemon_cpu_percent is None else f"{r.daemon_cpu_percent:.1f}%",
        ))  # fmt: skip
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]  # fmt: skip
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(ln, widths, strict=True)) + " |" for ln in lines]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 s runs, 2 repeats")
    ap.add_argument("--services", default=",".join(SERVICES), help=f"comma-separated (default: {','.join(SERVICES)})")
    ap.add_argument("--seconds", type=float, default=None, help="each load run (default 5, --quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per instance (default 3, --quick 2)")
    ap.add_argument("--armed-timeout", type=float, default=60.0, help="seconds to wait for every sampler armed")
    ap.add_argument("--json", type=Path, help="write the rows there as JSON")
    ap.add_argument("--store", action="store_true",
                    help="the daemon keeps its history, as serve does by default (else --no-store)")
    ap.add_argument("--control", action="store_true",
                    help="attach nothing: the ratio of two untraced instances (the bench's own spread)")
    ap.add_argument("--serve-args", default="", metavar="ARGS",
                    help="more options of `heapscope serve`, as one string (e.g. \"--malt=no\": what an option costs)")
    args = ap.parse_args()
    names = [n for n in args.services.split(",") if n]
    unknown = [n for n in names if n not in SERVICES]
    if unknown:
        ap.error(f"unknown service {', '.join(unknown)} (services: {', '.join(SERVICES)})")
    seconds = args.seconds if args.seconds is not None else 2.0 if args.quick else 5.0
    repeats = args.repeats if args.repeats is not None else 2 if args.quick else 3
    if os.geteuid() != 0:
        raise SystemExit("bench/service_panel.py needs root (heapscope attaches, the services switch users)")
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {seconds:g} s runs, {repeats} repeats; history store "
          f"{'on' if args.store else 'off'}{'; control: nothing attached' if args.control else ''}"
          f"{f'; serve {args.serve_args}' if args.serve_args else ''}", flush=True)
    rows = []
    for name in names:
        try:
            row = measure(name, seconds, repeats, args.armed_timeout, args.store, args.control,
                          shlex.split(args.serve_args))
        except ServiceError as e:
            row = Row(name, SERVICES[name].tool, errors=[str(e)])
        rows.append(row)
        ratio = row.ratio
        print(f"{name}: {row.armed}/{row.processes} armed ({row.exited} exited before), time to armed "
              f"{fmt_s(row.time_to_armed_s)} (the second instance {fmt_s(row.time_to_armed_swapped_s)}, from run "
              f"{row.swapped_at}), ratio "
              f"{'-' if ratio is None else f'{ratio:.3f}'} (untraced {row.untraced}, profiled {row.profiled})",
              flush=True)
        for problem in row.errors:
            print(f"  {name}: {problem}", flush=True)
    print()
    print(table(rows))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.json:
        out = [{**asdict(r), "ratio": r.ratio, "spread": r.spread} for r in rows]
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
