#!/usr/bin/env python3
"""What one followed worker's life costs heapscope's daemon, phase by phase (issue 31: a prefork server that
replaces its workers as it serves, apache2's MaxConnectionsPerChild).

    sudo .venv/bin/python bench/worker_cost.py [--service apache2] [--seconds 20] [--serve-args ARGS]

One instance of the service (tests/support/services.py) is followed by `heapscope serve` through a selector, as
the panel does (sampled mode, serve's defaults: the history store and MALT on), with the daemon run under
bench/phase_timer.py, which times chosen functions in CPU, thread by thread. After a warm-up the count starts again
and the service's load tool runs for --seconds. Counted are the profiles whose whole life (TargetManager._profile:
attach, sampling, files) fell inside the load: the workers that were started and replaced while it ran. For each
phase: its CPU per such life (median; phases are inclusive, a phase inside another is counted in both), and how
often it ran. Beside them, the daemon's whole CPU over the load, and the share its followed lives account for.

bench/request_cost.py says what a request costs the service and the machine; this says where the daemon's part of
it goes when the service's processes come and go.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import service_panel
from benchproc import cpu_seconds
from service_panel import Daemon, follow_all, one_service_options

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.services import SERVICES  # noqa: E402

FLEET_THREAD = "the fleet's thread"
# (phase, where it belongs in a followed process's life), in the order of that life
PHASES: Sequence[tuple[str, str]] = (
    ("agent.daemon.manager:TargetManager._profile", "whole life"),
    ("agent.session.pipeline:Profile.run", "whole life"),
    ("agent.session.sampled:SamplerLink.__init__", "start"),
    ("agent.kernel.probes:HeapProbes.__enter__", "start"),
    ("agent.session.session:Session.prepare_attach", "start"),
    ("agent.session.sampled:SamplerLink.arm", "start"),
    ("agent.session.pipeline:Profile._open_store", "start"),
    ("agent.session.session:Session.run", "sampling"),
    ("agent.session.session:Session.take_points", "sampling"),
    ("agent.session.session:Session.sample", "sampling"),
    ("agent.session.session:Session._take_points", "sampling"),  # inside take_points and sample
    ("agent.model.schedule:PointFeed.feed", "sampling"),  # Massif's schedule and culling, point by point
    ("agent.session.session:Session._give_trees", "sampling"),
    ("agent.session.maltrec:MaltRecorder.sample", "sampling"),
    ("agent.session.storerec:StoreRecorder.record", "sampling"),
    ("agent.session.session:Session.sync_mappings", "sampling"),
    ("agent.session.sampled:SamplerLink.poll", "sampling"),
    ("agent.session.pipeline:Profile._record_memory", "sampling"),
    ("agent.kernel.probes:HeapProbes.wait_events", "sampling"),
    ("agent.session.sampled:SamplerLink.disarm", "end"),
    ("agent.kernel.probes:HeapProbes.__exit__", "end"),
    ("agent.session.session:Session.finish", "end"),
    ("agent.session.session:Session.malt_profile", "end"),
    ("agent.session.pipeline:Profile._close_store", "end"),
    ("agent.session.pipeline:Profile.write_outputs", "end"),
    ("agent.session.pipeline:Profile.summary", "end"),
    ("agent.daemon.fleet:FleetManager.attach", FLEET_THREAD),
)


def phase_name(spec: str) -> str:
    return spec.split(":", 1)[1]


def report(threads: list[dict[str, Any]], daemon_cpu: float, seconds: float, rate: float) -> list[str]:
    whole = phase_name(PHASES[0][0])
    lives = [t for t in threads if t["started"] and t["ended"] and whole in t["phases"]]
    lines = [
        f"daemon: {1000 * daemon_cpu / seconds:.1f} ms of CPU a second over the load (its load tool: "
        f"{rate:,.0f} a second); {len(lives)} followed lives began and ended in it"
    ]
    if not lives:
        return [*lines, "no whole life to count: a longer --seconds, or a service that replaces its workers"]
    spent_in_lives = sum(t["phases"][whole][1] for t in lives)
    lines.append(
        f"their profile threads: {1000 * spent_in_lives / seconds:.1f} ms a second, "
        f"{100 * spent_in_lives / daemon_cpu:.0f}% of the daemon's CPU"
    )
    lines.append(f"{'phase':40s} {'part':20s} {'ms a life':>10s} {'runs a life':>12s}")
    for spec, part in PHASES:
        name = phase_name(spec)
        if part == FLEET_THREAD:  # not in a life's thread: its total over the whole load, shared by the lives
            total = [t["phases"][name] for t in threads if name in t["phases"]]
            ms = 1000 * sum(cpu for _, cpu in total) / len(lives)
            runs = sum(calls for calls, _ in total) / len(lives)
        else:
            per = [t["phases"].get(name, [0, 0.0]) for t in lives]
            ms = statistics.median(1000 * cpu for _, cpu in per)
            runs = statistics.median(calls for calls, _ in per)
        lines.append(f"{name:40s} {part:20s} {ms:10.2f} {runs:12.1f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_service_options(ap, 20.0, "the load's run, over which the lives are counted")
    ap.add_argument("--json", type=Path, help="also write each counted thread's phases")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/worker_cost.py needs root (attaching)")
    with tempfile.TemporaryDirectory(prefix="heapscope-worker-cost-") as tmp, SERVICES[args.service]() as svc:
        out = Path(tmp) / "phases.json"
        os.environ["HEAPSCOPE_PHASES"] = ",".join(spec for spec, _ in PHASES)
        os.environ["HEAPSCOPE_PHASES_OUT"] = str(out)
        service_panel.heapscope_cmd = lambda: [sys.executable, str(Path(__file__).with_name("phase_timer.py"))]
        daemon = Daemon(Path(tmp), store=True, serve_args=shlex.split(args.serve_args))
        try:
            follow_all(daemon, svc)
            daemon.proc.send_signal(signal.SIGUSR1)  # the count starts again
            before = cpu_seconds(daemon.proc.pid)
            got = svc.load(args.seconds)
            daemon_cpu = cpu_seconds(daemon.proc.pid) - before
            daemon.proc.send_signal(signal.SIGUSR2)  # the lives that ended in the load: not those the stop ends
            deadline = time.monotonic() + 10.0
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            daemon.stop()
        if not out.exists():
            raise SystemExit(f"the daemon wrote no phases ({daemon.last_line()})")
        threads = json.loads(out.read_text())
    print("\n".join(report(threads, daemon_cpu, args.seconds, got.rate)))
    if args.json:
        args.json.write_text(json.dumps(threads, indent=1) + "\n")


if __name__ == "__main__":
    main()
