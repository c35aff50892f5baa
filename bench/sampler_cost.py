#!/usr/bin/env python3
"""What the in-process sampler costs per malloc+free pair, side by side with the native run, in one run.

    sudo .venv/bin/python bench/sampler_cost.py [--pairs 2000000] [--repeats 5]

bench/churn.c times its own loop. Each configuration starts a fresh churn process held at its gate (a FIFO),
brings the sampler in by ptrace injection where the configuration needs it, arms it, opens the gate, and
reads the loop's seconds. Configurations are interleaved (each once, then again); the minimum and the median
of the repeats are reported (on a shared machine the minimum is the figure least disturbed by other load).

- native: no sampler.
- loaded: sampler injected, not armed (the hooks are not installed: should equal native).
- armed 512KiB: armed at the default rate, no probe on the probe functions (the in-process cost).
- armed 512KiB + uprobe: the same with tracefs uprobes on hs_sample_alloc/hs_sample_free (what the kernel
  adds on the sampled calls; the eBPF program of the finished design costs more than a trace event).
- armed 4KiB + uprobe: a sample about every 4 KiB allocated, to show the sampled path's own cost.
Also printed: the injection time of each injected run (ptrace seize to dlopen returned).

With --hooks, instead: bench/sampler_hooks.c in one process, the sampler injected once, rounds alternating
disarmed / armed at 512 KiB / armed with uprobes. Same process, same threads: the differences are the hooks'
own cost, free of the control thread's effect on glibc (a single-threaded process becomes multi-threaded
when the sampler loads, which alone costs glibc's malloc about +0.05 µs a pair here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.process.inject import inject  # noqa: E402
from agent.process.sampler import SamplerControl, build_sampler  # noqa: E402
from tests.support.sampler_probes import sample_trace  # noqa: E402

CONFIGS = ("native", "loaded", "armed 512KiB", "armed 512KiB + uprobe", "armed 4KiB + uprobe")


def run_once(
    churn: Path, lib: Path, config: str, pairs: int, scratch: Path
) -> tuple[float, tuple[float, float] | None]:
    gate = scratch / "gate"
    if gate.exists():
        gate.unlink()
    os.mkfifo(gate)
    time_file = scratch / "time"
    env = dict(os.environ, CHURN_GATE=str(gate), CHURN_TIME_FILE=str(time_file))
    proc = subprocess.Popen([str(churn), str(pairs)], env=env)
    inject_seconds: tuple[float, float] | None = None
    try:
        with ExitStack() as stack:
            if config != "native":
                time.sleep(0.05)  # the process reaches its gate
                started = time.monotonic()
                done = inject(proc.pid, lib)
                inject_seconds = (time.monotonic() - started, done.seconds)
            if config.startswith("armed"):
                ctl = SamplerControl(proc.pid, lib)
                stack.callback(ctl.close)
                if "uprobe" in config:
                    stack.enter_context(sample_trace(lib))
                ctl.arm(524288 if "512KiB" in config else 4096)
            with open(gate, "wb") as g:
                g.write(b"x")
            if proc.wait(timeout=300) != 0:
                raise SystemExit(f"churn failed under {config}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return float(time_file.read_text()), inject_seconds


def hooks_only(pairs: int, repeats: int, scratch: Path, lib: Path) -> None:
    program = scratch / "sampler_hooks"
    subprocess.run(["gcc", "-O2", "-o", str(program), str(REPO / "bench" / "sampler_hooks.c")], check=True)
    proc = subprocess.Popen([str(program), str(pairs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    configs = ("disarmed", "armed 512KiB", "armed 512KiB + uprobe")
    ns: dict[str, list[float]] = {c: [] for c in configs}
    try:
        assert proc.stdout.readline().strip() == "ready"
        inject(proc.pid, lib)

        def run_round() -> float:
            proc.stdin.write("run\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            return float(proc.stdout.readline())  # type: ignore[union-attr]

        run_round()  # warm-up: the allocator's arenas and the slots
        for _ in range(repeats):
            for config in configs:
                with ExitStack() as stack:
                    if config != "disarmed":
                        ctl = SamplerControl(proc.pid, lib)
                        stack.callback(ctl.close)
                        if "uprobe" in config:
                            stack.enter_context(sample_trace(lib))
                        ctl.arm(524288)
                        stack.callback(ctl.disarm)
                    ns[config].append(run_round())
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    print(f"{pairs} malloc+free pairs per round, {repeats} rounds each, one process (ns per pair; added vs disarmed)")
    for label, pick in (("min", min), ("median", statistics.median)):
        base = pick(ns["disarmed"])
        for config in configs:
            v = pick(ns[config])
            print(f"  {label:6s} {config:24s} {v:7.1f} ns   {v - base:+6.1f} ns")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hooks", action="store_true", help="the hooks alone, armed against disarmed in one process")
    args = ap.parse_args()
    if args.hooks:
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o755)
            cache = Path(tmp) / "cache"
            cache.mkdir(mode=0o755)
            hooks_only(args.pairs, args.repeats, Path(tmp), build_sampler(cache))
        return
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        churn = scratch / "churn"
        subprocess.run(["gcc", "-O2", "-g", "-o", str(churn), str(REPO / "bench" / "churn.c")], check=True)
        cache = scratch / "cache"
        cache.mkdir(mode=0o755)
        os.chmod(scratch, 0o755)
        lib = build_sampler(cache)
        seconds: dict[str, list[float]] = {c: [] for c in CONFIGS}
        injects: list[tuple[float, float]] = []
        for _ in range(args.repeats):
            for config in CONFIGS:
                s, inj = run_once(churn, lib, config, args.pairs, scratch)
                seconds[config].append(s)
                if inj is not None:
                    injects.append(inj)
    print(f"{args.pairs} malloc+free pairs, {args.repeats} runs each (µs per pair; added vs native)")
    for label, pick in (("min", min), ("median", statistics.median)):
        native = pick(seconds["native"]) / args.pairs * 1e6
        for config in CONFIGS:
            us = pick(seconds[config]) / args.pairs * 1e6
            print(f"  {label:6s} {config:24s} {us:.4f} µs   {us - native:+.4f} µs   {us / native:.2f}x")
    total = [t for t, _ in injects]
    ptrace = [p for _, p in injects]
    print(
        f"  injection: median {statistics.median(total) * 1e3:.1f} ms in all (checks, symbol ranges), of which "
        f"{statistics.median(ptrace) * 1e3:.1f} ms from the first seize to dlopen's return "
        f"(max {max(ptrace) * 1e3:.1f})"
    )


if __name__ == "__main__":
    main()
