#!/usr/bin/env python3
"""The daemon in a fleet over time: services start, fork, restart and exit at a steady rate while a selector picks
them up, and one more process is attached and detached over and over through the API.

    sudo .venv/bin/python bench/fleet_soak.py                     # one hour
    sudo .venv/bin/python bench/fleet_soak.py --duration 300      # five minutes
    sudo .venv/bin/python bench/fleet_soak.py --cycle-period 8    # the hour at the churn of the first hour

The services are tests/integration/programs/fleet_service.c, built here with gcc: each process allocates a
1000-byte block every 20 ms into a ring of 8, so once attached a second its live heap is exactly 8000 bytes.
Every --period seconds one step of a round runs, in turn: start a service (a parent and one worker, both chosen
by `--attach-comm ^soak-svc$`, the worker as a followed child), make a worker exit (its parent forks a new one:
a restart), end the oldest service when more than --services run. Beside that, all the time, a cycle of
attach (POST /targets {"pid"}), check, detach (DELETE /targets/PID) on processes no selector matches, in exact
and sampled mode in turn (sampled at a rate of 1 byte, where every block is sampled at a weight of 1, so that the
exact answer still holds while the sampler is injected, armed and disarmed every other cycle). --cyclers such
processes are cycled at once, each by its own thread: attaches overlap other targets' checks and detaches, and
the daemon meets concurrent attaches, as a fleet's restarts give it. By default a cycler starts its next cycle as
soon as the last one ended (a churn that grows as the daemon gets faster: 0.38 cycles a second when each attach
compiled its program, 1.7 now); --cycle-period paces them, for a figure at a churn of one's choosing.

Reported (JSON on stdout, and bench/results/fleet_soak.json):
- target crashes: a service or worker that ended other than by the soak's own signals (the parents report their
  workers' ends), or the attach/detach process found not running;
- wrong results: a target profiled for more than a second whose live heap is not 8000 bytes, asked twice; a
  profile that failed once attached (its `error`), or a detach that wrote no file;
- leaked probes: the BPF links, programs, maps and perf events the daemon holds (its /proc/PID/fd) once every
  target is gone and its programs' --keep-programs time has passed, against their count before the first target;
  and bpftool's system-wide count of uprobe_multi links before the daemon started and after it ended (other work
  on the machine may move that one);
- the daemon's RSS every 10 s (and its median each ten minutes), what it is made of each minute (anonymous
  memory, file pages, threads, descriptors), and its CPU time.
Exit status 0 only when there were no crashes, no wrong results and no leaked probes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from benchproc import cpu_seconds, free_port, heapscope_cmd, rss_mib

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "tests" / "integration" / "programs" / "fleet_service.c"
RING_BYTES = 8000
# serve --keep-programs: shorter than the default (600 s) so that the end can check that the programs are unloaded
# once kept that long; longer than any gap between the soak's attaches, so that during the soak they stay loaded
# as with the default.
KEEP_PROGRAMS = 10
SETTLE = 1.0  # seconds after an attach by which a target's ring has turned over (every 20 ms, 8 slots)


def bpf_fds(pid: int) -> Counter[str]:
    """The BPF objects and perf events the process holds, by kind."""
    kinds: Counter[str] = Counter()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return kinds
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        for kind in ("bpf-link", "bpf-prog", "bpf-map", "perf_event"):
            if kind in link:
                kinds[kind] += 1
    return kinds


def uprobe_links() -> int | None:
    """uprobe_multi links on the whole machine (bpftool), or None without bpftool."""
    if shutil.which("bpftool") is None:
        return None
    done = subprocess.run(["bpftool", "-j", "link", "list"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    links = json.loads(done.stdout or "[]")
    return sum(1 for link in links if link.get("type") in ("uprobe_multi", 12))


def _status(pid: int) -> dict[str, int]:
    """The numeric lines of /proc/PID/status (sizes in kB)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            first = value.split()[:1]
            if first and first[0].isdigit():
                out[key] = int(first[0])
    return out


def memory_parts(pid: int) -> dict[str, float]:
    """Where the daemon's RSS is (anonymous memory, file pages), its threads and descriptors: what tells a leak
    from the pages of the libraries it maps."""
    status = _status(pid)
    return {"RssAnon": round(status["RssAnon"] / 1024, 1), "RssFile": round(status["RssFile"] / 1024, 1),
            "Threads": status["Threads"], "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def ten_minute_medians(series: list[tuple[float, int]]) -> list[float]:
    """The median of each ten minutes of (seconds, bytes) samples, in MiB."""
    buckets: dict[int, list[int]] = {}
    for t, value in series:
        buckets.setdefault(int(t // 600), []).append(value)
    return [round(sorted(v)[len(v) // 2] / 2**20, 1) for _, v in sorted(buckets.items())]


def rss_and_cpu(pid: int) -> tuple[int, float]:
    return round(rss_mib(pid) * 2**20), cpu_seconds(pid)


def children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(name))
    return out


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.exe = work / "soak-svc"
        self.manual_exe = work / "soak-manual"
        self.services: list[subprocess.Popen[bytes]] = []
        self.ended: list[subprocess.Popen[bytes]] = []  # ended by the soak: their exit status is checked
        self.crashes: list[str] = []
        self.wrong: list[str] = []
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()  # counts, wrong and crashes: the cyclers' threads add to them too
        self.rss: list[tuple[float, int]] = []
        self.memory: list[dict[str, float]] = []  # memory_parts each minute
        self.cycle_seconds: list[float] = []
        self.daemon: subprocess.Popen[str] | None = None
        self.stopping = threading.Event()
        self.url = ""
        self.log = work / "daemon.log"
        self.t0 = time.monotonic()
        self.failed: set[tuple[int, str]] = set()  # (pid, started_at) of profiles found failed, said once
        self.first_seen: dict[tuple[int, str], float] = {}  # (pid, started_at): when the soak first saw it ready

    # ---- set-up ----

    def build(self) -> None:
        subprocess.run(["gcc", "-g", "-O0", "-o", str(self.exe), str(SOURCE)], check=True)
        shutil.copy(self.exe, self.manual_exe)

    def start_daemon(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [*heapscope_cmd(), "serve", "--http", f"127.0.0.1:{port}", "--output-dir", str(self.work / "out"),
               "--attach-comm", "^soak-svc$", "--keep-exited", "5", "--malt", "no", "--mode", "exact",
               "--keep-programs", str(KEEP_PROGRAMS),
               *([] if self.args.verbose else ["-q"])]
        env = {k: v for k, v in os.environ.items() if k != "HEAPSCOPE_TOKEN"}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        log = self.log.open("w")
        self.daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self.keep_log, args=(self.daemon, log), daemon=True).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise SystemExit(f"the daemon exited with {self.daemon.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit("the daemon did not answer within 60 s")

    def keep_log(self, daemon: subprocess.Popen[str], log: Any) -> None:
        """The daemon's lines, each stamped with the soak's clock, so that they line up with its findings."""
        assert daemon.stderr is not None
        for line in daemon.stderr:
            log.write(f"{self.at()} {line}")
            log.flush()
        log.close()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)

    def spawn(self, exe: Path, workers: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([str(exe), str(workers)], stderr=subprocess.PIPE)

    # ---- checks ----

    def targets(self) -> dict[int, dict[str, Any]]:
        assert self.daemon is not None
        if self.daemon.poll() is not None:
            raise SystemExit(f"the daemon ended with status {self.daemon.returncode}; its log: {self.log}")
        with self.client() as c:
            return {t["pid"]: t for t in c.get("/targets").json()}

    def check_results(self, held: dict[int, dict[str, Any]]) -> None:
        now = time.monotonic()
        for pid, t in held.items():
            if t["error"] and (pid, t["started_at"]) not in self.failed:
                self.failed.add((pid, t["started_at"]))
                self.wrong.append(f"{self.at()} {pid} ({t['command']}, {t['state']}): profiling failed: {t['error']}")
            if t["state"] != "profiling":
                continue
            # Counted from when the soak first saw this profile listed (it is listed once attached and armed);
            # started_at is when the profile was made, before its program was compiled.
            if now - self.first_seen.setdefault((pid, t["started_at"]), now) < SETTLE + 1:
                continue
            self.counts["results checked"] += 1
            if not self._off(t):
                continue
            # A sample can fall between a tick's free and its malloc (the heap then really is 7000 B), and a
            # process that has just exited between its last free and its exit: ask again after a few samples.
            time.sleep(0.2)
            again = self.targets().get(pid, {})
            if again.get("started_at") != t["started_at"]:
                self.counts["off reads of a profile detached before asked again"] += 1  # a cycler's, re-attached
            elif Path(f"/proc/{pid}").exists() and again.get("state") == "profiling" and self._off(again):
                self.wrong.append(f"{self.at()} {pid} ({t['command']}): {self.heap_said(again)}")
            else:
                self.counts["off reads right when asked again"] += 1

    def at(self) -> str:
        return f"[{time.monotonic() - self.t0:.1f} s]"

    @staticmethod
    def heap_said(t: dict[str, Any]) -> str:
        """A wrong read, with what tells a sampler that stopped counting (its calls stand still) from samples
        lost with the sampler still counting."""
        h = t["heap"]
        return (f"{h['useful_bytes']} B in {h['live_blocks']} blocks, expected {RING_BYTES} B in 8 "
                f"({t['mode']}; {h['allocation_calls']} allocations, {h['free_calls']} frees, "
                f"{h['untracked_frees']} untracked frees, {h['dropped']} dropped)")

    @staticmethod
    def _off(t: dict[str, Any]) -> bool:
        return bool(t["heap"]["useful_bytes"] != RING_BYTES or t["heap"]["live_blocks"] != 8)

    def check_services(self) -> None:
        for p in list(self.services):
            if p.poll() is not None:
                self.crashes.append(f"service {p.pid} ended by itself with status {p.returncode}")
                self.services.remove(p)

    # ---- steps ----

    def start_service(self) -> None:
        self.services.append(self.spawn(self.exe, 1))
        self.counts["services started"] += 1

    def restart_a_worker(self) -> None:
        for p in self.services:
            kids = children(p.pid)
            if kids:
                os.kill(kids[0], signal.SIGUSR1)
                self.counts["workers restarted"] += 1
                return

    def end_oldest(self) -> None:
        if len(self.services) > self.args.services:
            p = self.services.pop(0)
            p.terminate()
            self.ended.append(p)
            self.counts["services ended"] += 1

    def attach_detach(self, manual: subprocess.Popen[bytes], sampled: bool) -> None:
        started = time.monotonic()
        # Sampled at a rate of 1 byte samples every block at a weight of 1, so the exact figure is still the
        # right answer, while the sampler is injected, armed and disarmed every other cycle.
        mode = {"mode": "sampled", "sample_rate": 1} if sampled else {"mode": "exact"}
        problems = []
        detached = False
        with self.client() as c:
            r = c.post("/targets", json={"pid": manual.pid, **mode})
            if r.status_code != 201:
                problems.append(f"attach {manual.pid}: {r.status_code} {r.text}")
            else:
                time.sleep(SETTLE + 0.5)
                t = c.get("/targets").json()
                [mine] = [x for x in t if x["pid"] == manual.pid]
                if self._off(mine):
                    # As for the services: a read can fall between a tick's free and its malloc, when the heap
                    # really is 7000 B. Asked again 0.5 s later; wrong only when that read is off too.
                    time.sleep(0.5)
                    [again] = [x for x in c.get("/targets").json() if x["pid"] == manual.pid]
                    if self._off(again):
                        problems.append(f"{self.at()} attach/detach {manual.pid}: {self.heap_said(mine)}; "
                                        f"0.5 s later {self.heap_said(again)}")
                    else:
                        with self.lock:
                            self.counts["off reads right when asked again"] += 1
                r = c.delete(f"/targets/{manual.pid}")
                detached = r.status_code == 200
                if not detached:
                    problems.append(f"detach {manual.pid}: {r.status_code} {r.text}")
                elif (ended := r.json())["error"] or not ended["files"]:
                    problems.append(f"{self.at()} detach {manual.pid} ({mode['mode']}): files "
                                    f"{ended['files']}, error {ended['error']}")
        with self.lock:
            self.wrong += problems
            if detached:  # a whole cycle, attach to detach (its read may still be wrong: counted above)
                self.counts["attach/detach cycles"] += 1
                self.counts[f"attach/detach cycles ({mode['mode']})"] += 1
                self.cycle_seconds.append(time.monotonic() - started)
            if manual.poll() is not None:
                self.crashes.append(f"the attach/detach process {manual.pid} ended with status {manual.returncode}")

    def cycle(self, manual: subprocess.Popen[bytes], first_sampled: bool, until: float) -> None:
        """Attach/detach cycles on one process, back to back until `until`, both modes in turn."""
        sampled = first_sampled
        while time.monotonic() < until and not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.attach_detach(manual, sampled)
            except (httpx.HTTPError, SystemExit, ValueError) as exc:  # the daemon gone: the main loop says so
                with self.lock:
                    self.wrong.append(f"attach/detach {manual.pid}: {type(exc).__name__}: {exc}")
                return
            sampled = not sampled
            if self.args.cycle_period:  # paced: the next cycle starts cycle_period after this one started
                self.stopping.wait(max(0.0, started + self.args.cycle_period - time.monotonic()))

    # ---- the run ----

    def run(self) -> dict[str, Any]:
        a = self.args
        self.build()
        links_before = uprobe_links()
        self.start_daemon()
        assert self.daemon is not None
        time.sleep(3)  # the selector's tracepoints loaded, nothing chosen yet
        baseline = bpf_fds(self.daemon.pid)
        rss0, cpu0 = rss_and_cpu(self.daemon.pid)
        self.rss.append((0.0, rss0))
        manuals = [self.spawn(self.manual_exe, 0) for _ in range(a.cyclers if a.cycles else 0)]
        t0 = self.t0 = time.monotonic()
        steps = [self.start_service, self.restart_a_worker, self.end_oldest]
        next_step = next_check = next_rss = t0
        step = 0
        cyclers = [threading.Thread(target=self.cycle, args=(m, i % 2 == 1, t0 + a.duration), daemon=True)
                   for i, m in enumerate(manuals)]
        for t in cyclers:
            t.start()
        while time.monotonic() - t0 < a.duration:
            now = time.monotonic()
            if now >= next_step:
                steps[step % len(steps)]()
                step += 1
                next_step = now + a.period
            if now >= next_check:
                self.check_services()
                self.check_results(self.targets())
                next_check = now + 5
            if now >= next_rss:
                self.rss.append((round(now - t0, 1), rss_and_cpu(self.daemon.pid)[0]))
                if len(self.rss) % 6 == 1:  # a minute
                    self.memory.append({"t": round(now - t0, 1), **memory_parts(self.daemon.pid)})
                next_rss = now + 10
            time.sleep(0.5)
            if self.daemon.poll() is not None:
                self.crashes.append(f"the daemon ended with status {self.daemon.returncode}")
                break
        self.stopping.set()
        for t in cyclers:
            t.join()
        soak_seconds = time.monotonic() - t0
        # Wind down: every service ends; the daemon forgets them after --keep-exited.
        for p in self.services:
            p.terminate()
            self.ended.append(p)
        self.services = []
        for m in manuals:
            m.terminate()
            self.ended.append(m)
        for p in self.ended:
            try:
                status = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                status = p.wait()
            err = p.stderr.read().decode(errors="replace") if p.stderr else ""
            self.crashes += [ln for ln in err.splitlines() if "crashed" in ln]
            if status != 0:
                self.crashes.append(f"process {p.pid} ended with status {status} after SIGTERM")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.targets():
            time.sleep(0.5)
        left = self.targets()
        rss1, cpu1 = rss_and_cpu(self.daemon.pid)
        self.rss.append((round(time.monotonic() - t0, 1), rss1))
        # The programs stay loaded KEEP_PROGRAMS seconds after their last target: then everything must be gone.
        deadline = time.monotonic() + KEEP_PROGRAMS + 15
        while (after := bpf_fds(self.daemon.pid)) != baseline and time.monotonic() < deadline:
            time.sleep(0.5)
        self.daemon.send_signal(signal.SIGTERM)
        self.daemon.wait(90)
        links_after = uprobe_links()
        leaked = {k: after[k] - baseline[k] for k in set(after) | set(baseline) if after[k] != baseline[k]}
        rss_values = [r for _, r in self.rss]
        half = len(rss_values) // 2
        return {
            "duration_s": round(soak_seconds, 1),
            "period_s": a.period,
            "cyclers": len(manuals),
            "cycle_period_s": a.cycle_period or None,
            "counts": dict(self.counts),
            "target_crashes": len(self.crashes),
            "crashes": self.crashes,
            "wrong_results": len(self.wrong),
            "wrong": self.wrong[:20],
            "targets_left": sorted(left),
            "daemon_bpf_fds_before": dict(baseline),
            "daemon_bpf_fds_after": dict(after),
            "leaked_probes": leaked,
            "uprobe_links_machine_before": links_before,
            "uprobe_links_machine_after": links_after,
            "daemon_rss_mib": [(t, round(r / 2**20, 1)) for t, r in self.rss],
            "daemon_rss_ten_minute_medians_mib": ten_minute_medians(self.rss[1:-1] or self.rss),
            "daemon_memory_each_minute": self.memory,
            "daemon_rss_first_half_max_mib": round(max(rss_values[: max(half, 1)]) / 2**20, 1),
            "daemon_rss_second_half_max_mib": round(max(rss_values[half:]) / 2**20, 1),
            "daemon_cpu_s": round(cpu1 - cpu0, 1),
            "attach_detach_cycle_s_median": sorted(self.cycle_seconds)[len(self.cycle_seconds) // 2]
            if self.cycle_seconds else None,
            "daemon_log_errors": [ln for ln in self.log.read_text().splitlines() if "Traceback" in ln
                                  or "failed" in ln.replace("(0 failed)", "") or "stopped" in ln][:20],
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of churn (default 3600)")
    p.add_argument("--period", type=float, default=10.0, help="seconds between the fleet's steps (default 10)")
    p.add_argument("--services", type=int, default=3, help="services kept running at most (default 3)")
    p.add_argument("--no-cycles", dest="cycles", action="store_false", help="no attach/detach cycles")
    p.add_argument("--cyclers", type=int, default=3,
                   help="processes attached and detached at once, each by its own thread (default 3)")
    p.add_argument("--cycle-period", type=float, default=0.0,
                   help="a cycler starts a cycle at most once in this many seconds (default 0: as soon as the last "
                        "ended, so a faster daemon makes more cycles; 8 is the churn of the first hour, 1,361 "
                        "cycles with three cyclers)")
    p.add_argument("--verbose", action="store_true",
                   help="the daemon says what it does (not -q), and its log and work directory are kept")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fleet_soak.json")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("fleet_soak: needs root (BPF)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="heapscope-soak-"))
    report = Soak(args, work).run()
    if args.verbose:
        print(f"fleet_soak: the daemon's log is kept in {work / 'daemon.log'}", file=sys.stderr)
    else:
        shutil.rmtree(work)  # kept when the run ends early, with the daemon's log
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    bad = report["target_crashes"] or report["wrong_results"] or report["leaked_probes"] or report["targets_left"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
