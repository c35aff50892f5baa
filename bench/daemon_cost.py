#!/usr/bin/env python3
"""The daemon's cost per target: CPU and memory of `heapscope serve` with 1, 10 and 50 sleeping targets, and with
one busy target among them.

    sudo .venv/bin/python bench/daemon_cost.py                       # 1, 10, 50 sleeping targets, 20 s windows
    sudo .venv/bin/python bench/daemon_cost.py --counts 1,10 --window 10

1. `heapscope serve` on loopback, no target: its CPU over the window and its memory.
2. One busy target alone (bench/idle_target.c allocating and freeing --busy-rate blocks a second): the same.
   It is detached again.
3. Sleeping targets (bench/idle_target.c: a few blocks, then pause()) attached through POST /targets until there
   are 1, 10, 50 of them; the figures at each count.
4. The busy target again, among the sleeping ones.

Measured from outside the daemon:
- CPU: utime + stime of /proc/PID/stat over the window, as a percentage of one core.
- memory: RSS, PSS and private bytes (/proc/PID/smaps_rollup), the daemon's threads; and what the kernel holds for
  it that no RSS shows: the memlock of its BPF maps and programs (/proc/PID/fdinfo of each BPF fd, as `bpftool
  map show` reports it).
Each step's time to attach is recorded too. Results go to bench/results/daemon_cost.json. Goal (issue 17): 50
sleeping targets cost at most 5% of one core and at most 1 GiB in all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchproc import build, cpu_seconds, daemon_client, free_port, stop_all

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
MIB = 2**20


def rollup(pid: int) -> dict[str, float]:
    """RSS, PSS and private bytes (MiB) from smaps_rollup."""
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        kb[name] = int(value.split()[0])
    return {
        "rss_mib": kb["Rss"] / 1024,
        "pss_mib": kb["Pss"] / 1024,
        "private_mib": (kb["Private_Clean"] + kb["Private_Dirty"]) / 1024,
        "anon_mib": kb["Anonymous"] / 1024,
    }


def bpf_memlock(pid: int) -> dict[str, float]:
    """The kernel memory of the daemon's BPF maps and programs (fdinfo's memlock, which is what `bpftool map
    show` prints), counted once per object (the same map may be open through several fds)."""
    seen: set[tuple[str, str]] = set()
    maps = progs = 0
    n_maps = n_progs = 0
    fd_dir = Path(f"/proc/{pid}/fdinfo")
    for info in fd_dir.iterdir():
        try:
            text = info.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if "memlock" not in fields:
            continue
        ident = fields.get("map_id", fields.get("prog_id", "")).strip()
        kind = "map" if "map_type" in fields else "prog" if "prog_type" in fields else ""
        if not kind or (kind, ident) in seen:
            continue
        seen.add((kind, ident))
        if kind == "map":
            maps += int(fields["memlock"])
            n_maps += 1
        else:
            progs += int(fields["memlock"])
            n_progs += 1
    return {"bpf_maps_mib": maps / MIB, "bpf_progs_mib": progs / MIB, "bpf_maps": n_maps, "bpf_progs": n_progs}


def measure(pid: int, window: float) -> dict[str, float]:
    time.sleep(2.0)  # let the last attach's work settle
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    out: dict[str, float] = {"cpu_percent": 100 * (c1 - c0) / (t1 - t0)}
    out.update(rollup(pid))
    out.update(bpf_memlock(pid))
    out["threads"] = len(os.listdir(f"/proc/{pid}/task"))
    return out


def start(program: Path, *args: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([str(program), *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    return p


def show(label: str, m: dict[str, float]) -> None:
    print(
        f"{label:>28}: {m['cpu_percent']:6.2f} % CPU  RSS {m['rss_mib']:7.1f} MiB  PSS {m['pss_mib']:7.1f} MiB  "
        f"BPF maps {m['bpf_maps_mib']:7.1f} MiB ({m['bpf_maps']:.0f})  progs {m['bpf_progs_mib']:5.1f} MiB  "
        f"threads {m['threads']:.0f}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1,10,50", help="numbers of sleeping targets, ascending")
    ap.add_argument("--window", type=float, default=20.0, help="seconds each measurement lasts")
    ap.add_argument("--busy-rate", type=int, default=20_000, help="the busy target's allocations a second")
    ap.add_argument("--label", default="", help="a name for this run in the results file")
    ap.add_argument("--tree", type=Path, default=REPO, help="the heapscope checkout to run (default: this one)")
    ap.add_argument("serve_args", nargs="*", help="more options for `heapscope serve` (after --)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/daemon_cost.py needs root (BPF)", file=sys.stderr)
        return 1
    counts = [int(c) for c in args.counts.split(",")]
    program = build(BENCH / "idle_target.c", BENCH / "build" / "idle_target", opt="-O1")
    port = free_port()
    out_dir = BENCH / "build" / "daemon-cost-out"
    env = {k: v for k, v in os.environ.items() if k != "HEAPSCOPE_TOKEN"}
    env["PYTHONPATH"] = str(args.tree)
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.cli",
            "serve",
            "--http",
            f"127.0.0.1:{port}",
            "--output-dir",
            str(out_dir),
            "-q",
            *args.serve_args,
        ],
        env=env,
        cwd=args.tree,
    )
    targets: list[subprocess.Popen[bytes]] = []
    result: dict[str, object] = {
        "label": args.label,
        "tree": str(args.tree),
        "window_s": args.window,
        "busy_rate": args.busy_rate,
        "serve_args": args.serve_args,
        "steps": [],
    }
    steps: list[dict[str, object]] = result["steps"]  # type: ignore[assignment]

    def step(label: str, sleeping: int, busy: bool, attach_s: float) -> None:
        m = measure(daemon.pid, args.window)
        show(label, m)
        steps.append({"label": label, "sleeping": sleeping, "busy": busy, "attach_s": attach_s, **m})

    try:
        client = daemon_client(port, timeout=300)
        step("no target", 0, False, 0.0)

        busy = start(program, "busy", str(args.busy_rate))
        t0 = time.monotonic()
        r = client.post("/targets", json={"pid": busy.pid})
        assert r.status_code == 201, r.text
        step("busy target alone", 0, True, time.monotonic() - t0)
        assert client.delete(f"/targets/{busy.pid}").status_code == 200
        busy.kill()
        busy.wait()

        for count in counts:
            t0, before = time.monotonic(), len(targets)
            while len(targets) < count:
                p = start(program)
                targets.append(p)
                r = client.post("/targets", json={"pid": p.pid})
                assert r.status_code == 201, r.text
            step(f"{count} sleeping", count, False, (time.monotonic() - t0) / max(1, count - before))

        busy = start(program, "busy", str(args.busy_rate))
        t0 = time.monotonic()
        r = client.post("/targets", json={"pid": busy.pid})
        assert r.status_code == 201, r.text
        step(f"{len(targets)} sleeping + busy", len(targets), True, time.monotonic() - t0)
        targets.append(busy)
    finally:
        stop_all(daemon, targets)

    # Per sleeping target: the slope between the first and the last count.
    sleeping = [s for s in steps if not s["busy"] and s["sleeping"]]
    if len(sleeping) >= 2:
        a, b = sleeping[0], sleeping[-1]
        dn = int(b["sleeping"]) - int(a["sleeping"])  # type: ignore[call-overload]
        per = {
            key: (float(b[key]) - float(a[key])) / dn  # type: ignore[arg-type]
            for key in ("cpu_percent", "rss_mib", "pss_mib", "bpf_maps_mib", "bpf_progs_mib")
        }
        result["per_sleeping_target"] = per
        print("per sleeping target: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()))
    alone = next(s for s in steps if s["label"] == "busy target alone")
    among = steps[-1]
    before = sleeping[-1] if sleeping else None
    if before is not None:
        extra = float(among["cpu_percent"]) - float(before["cpu_percent"])  # type: ignore[arg-type]
        result["busy_cpu_percent"] = {
            "alone": float(alone["cpu_percent"]) - float(steps[0]["cpu_percent"]),  # type: ignore[arg-type]
            "among_sleeping": extra,
        }
        print(f"busy target's own CPU: {result['busy_cpu_percent']}")
    (BENCH / "results").mkdir(exist_ok=True)
    name = f"daemon_cost{'-' + args.label if args.label else ''}.json"
    (BENCH / "results" / name).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
