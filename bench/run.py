#!/usr/bin/env python3
"""Heap profilers side by side, in one run: what each one costs per allocator call.

Run as root with the venv's interpreter, from anywhere:

    sudo .venv/bin/python bench/run.py            # 2,000,000 pairs, 3 repeats, every tool
    .venv/bin/python bench/run.py --quick         # 200,000 pairs
    .venv/bin/python bench/run.py --tools native,massif --repeats 5

Each workload is a C program from bench/ that times its own loop and writes the seconds to the file
named by $CHURN_TIME_FILE. So besides each tool's wall time (which includes starting up, compiling
and attaching BPF programs, writing its output) we get the loop's own time under every tool, and the
cost per call is computed from that. Runs are interleaved (every tool once, then again) and the
median of the repeats is reported. Results also go to bench/results/<workload>[-quick].json.

To add a workload: put its C source in bench/, and add a Workload to WORKLOADS. It must take the
number of calls as argv[1], and honour CHURN_TIME_FILE and CHURN_GATE (see churn.c).
To add a tool: write a function (workload binary, argv tail, env, scratch dir) -> Measurement and
add it to TOOLS.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
BUILD_DIR = BENCH_DIR / "build"
RESULTS_DIR = BENCH_DIR / "results"
HEAPSCOPE = REPO / ".venv" / "bin" / "heapscope"

RUN_TIMEOUT_S = 900.0  # memleak on 2,000,000 pairs takes ~30 s; anything near this is a hang
ATTACH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Workload:
    name: str
    source: str  # file in bench/
    cflags: tuple[str, ...]
    calls: int  # default number of calls (argv[1])
    quick_calls: int
    unit: str  # what one call is, for the table header
    env: tuple[tuple[str, str], ...] = ()  # set for the workload's runs (e.g. CHURN_DEPTH)

    def binary(self) -> Path:
        return BUILD_DIR / self.source.removesuffix(".c")


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="churn",
            source="churn.c",
            cflags=("-O2", "-g", "-fno-omit-frame-pointer"),
            calls=2_000_000,
            quick_calls=200_000,
            unit="malloc+free pair",
        ),
        # The same loop 20 calls deep: what the stack walk costs per allocation (cfi against fp).
        Workload(
            name="churn-deep20",
            source="churn.c",
            cflags=("-O2", "-g", "-fno-omit-frame-pointer"),
            calls=1_000_000,
            quick_calls=100_000,
            unit="malloc+free pair, 20 frames deep",
            env=(("CHURN_DEPTH", "17"),),
        ),
        # The loop with an idle second thread: glibc's malloc takes its locks, as in a service (and in any
        # process with sampled mode's sampler, whose control thread is a second thread): that case's native.
        Workload(
            name="churn-mt",
            source="churn.c",
            cflags=("-O2", "-g", "-fno-omit-frame-pointer"),
            calls=2_000_000,
            quick_calls=200_000,
            unit="malloc+free pair, a second thread idle",
            env=(("CHURN_THREAD", "1"),),
        ),
        # The loop after 200,000 untimed pairs and a pause: each profiler's one-time work at its first calls
        # (heapscope symbolizes their stacks, seconds of CPU on a 2-core machine) is not in the loop's time.
        Workload(
            name="churn-warm",
            source="churn.c",
            cflags=("-O2", "-g", "-fno-omit-frame-pointer"),
            calls=2_000_000,
            quick_calls=200_000,
            unit="malloc+free pair, after a warm-up",
            env=(("CHURN_WARMUP", "200000"),),
        ),
        # mmap/munmap pairs: what the page syscall tracepoints cost (exact mode traces them; sampled mode with
        # --page-calls=yes).
        Workload(
            name="mmap-churn",
            source="churn.c",
            cflags=("-O2", "-g", "-fno-omit-frame-pointer"),
            calls=200_000,
            quick_calls=20_000,
            unit="mmap+munmap pair",
            env=(("CHURN_MMAP", "1"),),
        ),
    )
}


@dataclass
class Measurement:
    wall_s: float  # what a user waits for: the whole command (memleak: from release to exit)
    loop_s: float  # the workload's own loop, as it measured it


class ToolFailed(Exception):
    """One line for the table; the tool's last output, if any, goes to the JSON."""

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(summary)
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Running things


def tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def read_loop_time(path: Path) -> float:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise ToolFailed(f"the workload did not report its loop time ({e})") from e


def timed_command(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    """Run cmd to completion; return its wall seconds, or raise ToolFailed with its last output."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT_S
        )
    except FileNotFoundError as e:
        raise ToolFailed(f"{cmd[0]}: not found") from e
    except subprocess.TimeoutExpired as e:
        raise ToolFailed(f"timed out after {RUN_TIMEOUT_S:.0f} s") from e
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        output = tail(proc.stderr + proc.stdout)
        last = output.splitlines()[-1] if output else ""
        raise ToolFailed(f"exit {proc.returncode}: {last}", output)
    return wall


def require_output(scratch: Path, pattern: str, tool: str) -> None:
    """A tool that ran without writing its profile has not done the job we are timing."""
    if not list(scratch.glob(pattern)):
        raise ToolFailed(f"{tool} wrote no {pattern} in {scratch}")


# ---------------------------------------------------------------------------------------------
# Tools. Each one runs the workload once and returns what it measured.

ToolFn = Callable[[Path, list[str], dict[str, str], Path], Measurement]


def run_native(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
    wall = timed_command([str(binary), *args], env, scratch)
    return Measurement(wall, read_loop_time(scratch / "loop_time"))


def _heapscope(
    unwind: str, malt: bool = False, pages: bool = False, mode: str = "exact", time_unit: str = "B"
) -> ToolFn:
    def run(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
        out = scratch / "massif.out.heapscope"
        extra = [f"--malt-out-file={scratch / 'malt.json'}"] if malt else []
        extra += ["--pages-as-heap=yes"] if pages else []
        extra += [f"--mode={mode}"]
        cmd = [
            str(HEAPSCOPE), "run", "-q", f"--time-unit={time_unit}", f"--unwind={unwind}", f"--massif-out-file={out}",
            *extra, "--", str(binary), *args,
        ]  # fmt: skip
        wall = timed_command(cmd, env, scratch)
        require_output(scratch, out.name, "heapscope")
        return Measurement(wall, read_loop_time(scratch / "loop_time"))

    return run


def _massif(*options: str) -> ToolFn:
    def run(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
        out = scratch / "massif.out.valgrind"
        cmd = ["valgrind", "--tool=massif", "--time-unit=B", *options, f"--massif-out-file={out}", str(binary), *args]
        wall = timed_command(cmd, env, scratch)
        require_output(scratch, out.name, "valgrind")
        return Measurement(wall, read_loop_time(scratch / "loop_time"))

    return run


def run_heaptrack(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
    cmd = ["heaptrack", "-o", str(scratch / "heaptrack.out"), str(binary), *args]
    wall = timed_command(cmd, env, scratch)
    require_output(scratch, "heaptrack.out*", "heaptrack")
    return Measurement(wall, read_loop_time(scratch / "loop_time"))


def _pump(stream: object, lines: queue.Queue[str | None]) -> None:
    # Drain the pipe all the time: memleak prints every interval and must never block on a full pipe.
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)
    lines.put(None)


def _release_gate(fifo: Path, child: subprocess.Popen[bytes]) -> None:
    """Open the FIFO for writing without blocking forever if the workload has died."""
    deadline = time.monotonic() + 10
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:  # ENXIO: no reader yet
            if child.poll() is not None or time.monotonic() > deadline:
                raise ToolFailed(f"the held workload is not reading its gate ({e})") from e
            time.sleep(0.01)
    os.write(fd, b"x")
    os.close(fd)


def run_memleak(binary: Path, args: list[str], env: dict[str, str], scratch: Path) -> Measurement:
    """bcc's memleak attaches to a PID: hold the workload at its gate, attach, then release it.

    memleak prints "Attaching to pid" before it attaches, so that line does not mean ready. With an
    interval of 1 s its first report comes after every probe is attached; that is the signal. The
    reports it prints each second run on the other core while the workload runs.
    """
    fifo = scratch / "gate"
    os.mkfifo(fifo)
    child = subprocess.Popen([str(binary), *args], env={**env, "CHURN_GATE": str(fifo)}, cwd=scratch)
    tracer_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        tracer = subprocess.Popen(
            ["memleak-bpfcc", "-p", str(child.pid), "-T", "1", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=tracer_env,
        )
    except FileNotFoundError as e:
        child.kill()
        child.wait()
        raise ToolFailed("memleak-bpfcc: not found") from e
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(tracer.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty as e:
                raise ToolFailed(f"memleak did not report within {ATTACH_TIMEOUT_S:.0f} s") from e
            if line is None:
                output = tail("".join(seen))
                last = output.splitlines()[-1] if output else ""
                raise ToolFailed(f"memleak exited {tracer.wait()}: {last}", output)
            seen.append(line)
            if "outstanding allocations" in line:
                break
        start = time.perf_counter()
        _release_gate(fifo, child)
        try:
            code = child.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise ToolFailed(f"timed out after {RUN_TIMEOUT_S:.0f} s") from e
        wall = time.perf_counter() - start
        if code != 0:
            raise ToolFailed(f"the workload exited {code} under memleak")
        if tracer.poll() is not None:
            raise ToolFailed("memleak exited early", tail("".join(seen)))
    finally:
        for proc, sig in ((child, signal.SIGKILL), (tracer, signal.SIGINT)):
            if proc.poll() is None:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return Measurement(wall, read_loop_time(scratch / "loop_time"))


@dataclass(frozen=True)
class Tool:
    name: str
    run: ToolFn
    note: str


TOOLS: list[Tool] = [
    Tool("native", run_native, "no profiler"),
    Tool("heapscope", _heapscope("cfi"), "heapscope run --time-unit=B: .eh_frame walk (wall: + compile, attach)"),
    Tool("heapscope-fp", _heapscope("fp"), "heapscope run --unwind=fp: frame-pointer walk"),
    Tool("heapscope-ms", _heapscope("cfi", time_unit="ms"), "heapscope run --time-unit=ms"),
    Tool("heapscope-malt", _heapscope("cfi", malt=True), "heapscope run --malt-out-file: + MALT's statistics"),
    Tool("heapscope-pages", _heapscope("cfi", pages=True), "heapscope run --pages-as-heap=yes"),
    Tool("heapscope-sampled", _heapscope("cfi", mode="sampled"),
         "heapscope run --mode=sampled: the in-process sampler, one sample per 512 KiB on average"),
    Tool("massif", _massif(), "valgrind --tool=massif --time-unit=B"),
    Tool("massif-pages", _massif("--pages-as-heap=yes"), "valgrind --tool=massif --pages-as-heap=yes"),
    Tool("heaptrack", run_heaptrack, "heaptrack (LD_PRELOAD)"),
    Tool("memleak", run_memleak, "memleak-bpfcc -p PID (wall from release; attach not counted)"),
]


# ---------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class ToolResult:
    tool: Tool
    runs: list[Measurement] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.runs) and not self.errors

    def median_wall(self) -> float:
        return statistics.median(m.wall_s for m in self.runs)

    def median_loop(self) -> float:
        return statistics.median(m.loop_s for m in self.runs)


def build(workload: Workload) -> Path:
    src = BENCH_DIR / workload.source
    out = workload.binary()
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        BUILD_DIR.mkdir(exist_ok=True)
        subprocess.run(["gcc", *workload.cflags, "-o", str(out), str(src)], check=True)
    return out


def version_of(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (proc.stdout or proc.stderr).strip()
    return text.splitlines()[0] if proc.returncode == 0 and text else None


def tool_versions() -> dict[str, str | None]:
    return {
        "heapscope": version_of([str(HEAPSCOPE), "--version"]),
        "massif": version_of(["valgrind", "--version"]),
        "heaptrack": version_of(["heaptrack", "--version"]),
        "memleak": version_of(["dpkg-query", "-W", "-f=bpfcc-tools ${Version}", "bpfcc-tools"]),
    }


def bench(workload: Workload, tools: list[Tool], calls: int, repeats: int) -> list[ToolResult]:
    binary = build(workload)
    results = [ToolResult(t) for t in tools]
    for rep in range(repeats):
        for res in results:
            if res.errors:  # a tool that failed once is not retried: its row says why
                continue
            scratch = Path(tempfile.mkdtemp(prefix=f"heapscope-bench-{res.tool.name}-"))
            env = {**os.environ, **dict(workload.env), "CHURN_TIME_FILE": str(scratch / "loop_time")}
            try:
                m = res.tool.run(binary, [str(calls)], env, scratch)
                res.runs.append(m)
                print(
                    f"  [{rep + 1}/{repeats}] {res.tool.name:<10} wall {m.wall_s:8.3f} s  loop {m.loop_s:8.3f} s",
                    flush=True,
                )
            except ToolFailed as e:
                res.errors.append(str(e))
                res.details.append(e.detail)
                print(f"  [{rep + 1}/{repeats}] {res.tool.name:<10} FAILED: {e}", flush=True)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return results


def report(workload: Workload, results: list[ToolResult], calls: int) -> list[dict[str, object]]:
    native = next((r for r in results if r.tool.name == "native" and r.ok), None)
    base_loop = native.median_loop() if native else None
    base_wall = native.median_wall() if native else None
    rows: list[dict[str, object]] = []
    head = (
        f"{'tool':<10} {'wall s':>9} {'loop s':>9} {'µs/call':>9} {'x native':>9} {'x native':>9}  note\n"
        f"{'':<10} {'':>9} {'':>9} {'(loop)':>9} {'(loop)':>9} {'(wall)':>9}"
    )
    print(f"\n{workload.name}: {calls:,} x {workload.unit}, median of {max(len(r.runs) for r in results)}")
    print(head)
    for r in results:
        row: dict[str, object] = {
            "tool": r.tool.name,
            "note": r.tool.note,
            "runs": [{"wall_s": m.wall_s, "loop_s": m.loop_s} for m in r.runs],
            "error": r.errors[0] if r.errors else None,
            "error_output": r.details[0] if r.details else None,
        }
        if r.ok:
            wall, loop = r.median_wall(), r.median_loop()
            per_call = loop / calls * 1e6
            ratio_loop = loop / base_loop if base_loop else None
            ratio_wall = wall / base_wall if base_wall else None
            row |= {
                "median_wall_s": wall,
                "median_loop_s": loop,
                "us_per_call": per_call,
                "ratio_loop": ratio_loop,
                "ratio_wall": ratio_wall,
            }
            rl = f"{ratio_loop:9.1f}" if ratio_loop else f"{'-':>9}"
            rw = f"{ratio_wall:9.1f}" if ratio_wall else f"{'-':>9}"
            print(f"{r.tool.name:<10} {wall:9.3f} {loop:9.3f} {per_call:9.3f} {rl} {rw}  {r.tool.note}")
        else:
            why = r.errors[0] if r.errors else "no runs"
            print(f"{r.tool.name:<10} {'FAILED':>9}  {why[:100]}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer calls (each workload's quick count)")
    p.add_argument("--calls", type=int, help="number of calls, overriding the workload's default")
    p.add_argument("--repeats", type=int, default=3, help="runs per tool; the median is reported (default 3)")
    p.add_argument("--tools", default=",".join(t.name for t in TOOLS), help="comma-separated subset of tools")
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="default: all")
    p.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    args = p.parse_args(argv)

    by_name = {t.name: t for t in TOOLS}
    wanted = [n.strip() for n in args.tools.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        p.error(f"unknown tool(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    tools = [by_name[n] for n in wanted]
    if os.geteuid() != 0:
        print("warning: not root: the heapscope and memleak rows will fail", file=sys.stderr)

    versions = tool_versions()
    for name in args.workload or sorted(WORKLOADS):
        workload = WORKLOADS[name]
        calls = args.calls or (workload.quick_calls if args.quick else workload.calls)
        print(f"{workload.name}: {calls:,} calls, {args.repeats} repeat(s), tools: {', '.join(wanted)}")
        results = bench(workload, tools, calls, args.repeats)
        rows = report(workload, results, calls)
        if not args.no_json:
            RESULTS_DIR.mkdir(exist_ok=True)
            out = RESULTS_DIR / f"{workload.name}{'-quick' if args.quick else ''}.json"
            doc = {
                "workload": workload.name,
                "unit": workload.unit,
                "calls": calls,
                "repeats": args.repeats,
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "machine": {
                    "kernel": platform.release(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "versions": versions,
                "results": rows,
            }
            out.write_text(json.dumps(doc, indent=2) + "\n")
            print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
