"""The daemon in a fleet, for real: `heapscope serve` with selectors finds compiled services started after it, follows
a prefork parent's children through an exit, a restart and an exec, refuses a target at its limit with a clear
line, a 429 and a metric, and after a SIGKILL a restarted daemon finds the same processes again (which ran on
unharmed meanwhile).

fleet_service.c allocates a 1000-byte block every 20 ms into a ring of 8, freeing the slot's old block first: once
attached for a few ticks, a target's live heap is exactly 8000 bytes, all at ring_alloc, whatever it did before.
Each process writes its tick count to $FLEET_DIR/PID, so the test can tell it still runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.process.sampler import FORKED_ARMED, FORKED_CLAIMED
from agent.session.sampled import NEW_CODE_EVERY
from tests.support.armed import loaded_sampler, probe_code, sampler, sampler_fields, sampler_state
from tests.support.daemon import Daemon, start_daemon, stop_daemon
from tests.support.harness import PROGRAMS
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

SOURCE = PROGRAMS / "fleet_service.c"
RING_BYTES = 8 * 1000
FOUND_WITHIN = 90.0  # attaching compiles a BPF program: seconds each on a loaded 2-core machine


def ring_site() -> str:
    [line] = [n for n, text in enumerate(SOURCE.read_text().splitlines(), 1) if "return malloc(1000);" in text]
    return f"ring_alloc (fleet_service.c:{line})"


class Services:
    """fleet_service copies under given names (the process name is the file's), started and ended by the test."""

    def __init__(self, program: Path, tmp: Path) -> None:
        self.program = program
        self.tmp = tmp
        self.ticks = tmp / "ticks"
        self.ticks.mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, workers: int = 0, cgroup: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        exe = self.tmp / name
        if not exe.exists():
            exe.write_bytes(self.program.read_bytes())
            exe.chmod(0o755)

        def enter_cgroup() -> None:
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(os.getpid()))

        p = subprocess.Popen(
            [str(exe), str(workers)],
            env={**os.environ, "FLEET_DIR": str(self.ticks), **(env or {})},
            preexec_fn=enter_cgroup,
        )
        self.procs.append(p)
        return p

    def tick(self, pid: int) -> int:
        try:
            return int((self.ticks / str(pid)).read_text() or 0)
        except (OSError, ValueError):
            return -1

    def running(self, pid: int, within: float = 10.0) -> bool:
        """Alive, not stopped, and its loop advances within `within` seconds; else the wait fails, saying so."""
        before = self.tick(pid)

        def advanced() -> bool:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            except OSError:
                return False
            return state in ("R", "S") and self.tick(pid) > before >= 0

        return wait_for(advanced, within, f"process {pid} to run on (alive, not stopped, its loop advancing)",
                        interval=0.05)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(name))
    return sorted(out)


def start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def targets(d: Daemon) -> dict[int, dict[str, Any]]:
    with d.client() as c:
        r = c.get("/targets")
    assert r.status_code == 200, r.text
    return {t["pid"]: t for t in r.json()}


def profiling(d: Daemon, pid: int, heap: int | None = RING_BYTES) -> Callable[[], bool]:
    """The target is profiled (and, once the ring turned over since the attach, holds exactly `heap` bytes)."""

    def check() -> bool:
        t = targets(d).get(pid)
        return t is not None and t["state"] == "profiling" and (heap is None or t["heap"]["useful_bytes"] == heap)

    return check


def metric(d: Daemon, name: str, **labels: str) -> float | None:
    with d.client() as c:
        text = c.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}")[0]))
            if all(have.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def services(build: Callable[..., Path], tmp_path: Path) -> Iterator[Services]:
    s = Services(build("fleet_service.c"), tmp_path)
    yield s
    s.stop()


@pytest.fixture
def pod_cgroup() -> Iterator[tuple[Path, str, str]]:
    """A cgroup v2 directory laid out as the kubelet (systemd driver) and containerd make it: (dir, pod, id)."""
    mounts = [ln.split() for ln in Path("/proc/self/mounts").read_text().splitlines()]
    roots = [m[1] for m in mounts if m[2] == "cgroup2"]
    if not roots:
        pytest.skip("no cgroup v2 hierarchy is mounted")
    pod = str(uuid.uuid4())
    container = uuid.uuid4().hex + uuid.uuid4().hex
    parts = ["kubepods.slice", "kubepods-burstable.slice", f"kubepods-burstable-pod{pod.replace('-', '_')}.slice",
             f"cri-containerd-{container}.scope"]
    base = Path(roots[0])
    made = []
    path = base
    for part in parts:
        path = path / part
        if not path.exists():
            path.mkdir()
            made.append(path)
    yield path, pod, container
    # Runs before the services fixture's end: what still runs in the cgroup (the test's own service) ends first.
    for pid in (path / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGTERM)
    for p in reversed(made):
        for _ in range(50):  # the processes in it may take a moment to be gone
            try:
                p.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_services_started_after_the_daemon_are_found_and_marked(
    heapscope_cmd: list[str], services: Services, pod_cgroup: tuple[Path, str, str], tmp_path: Path
) -> None:
    cgroup_dir, pod, container = pod_cgroup
    # What an earlier daemon left: a gone process's file a week old goes at the first chores; a file not named by
    # the daemon's templates stays.
    (tmp_path / "out").mkdir()
    left, other = tmp_path / "out" / "massif.out.4194999", tmp_path / "out" / "massif.out.notes"
    for f in (left, other):
        f.write_text("old")
        os.utime(f, (time.time() - 8 * 86400,) * 2)
    d = start_daemon(heapscope_cmd, tmp_path, "--attach-comm", "^svc-alpha$", "--attach-cgroup", f"pod:{pod}",
                     "--keep-exited", "4")
    try:
        wait_for(lambda: not left.exists(), 10, "the week-old file of a gone process deleted (--output-max-age)")
        assert other.exists() and metric(d, "heapscope_output_files_expired_total") == 1
        alpha = services.start("svc-alpha")
        beta = services.start("svc-beta", cgroup=cgroup_dir)  # chosen by its pod
        gamma = services.start("svc-gamma")  # chosen by nothing
        wait_for(profiling(d, alpha.pid), FOUND_WITHIN, "svc-alpha profiled")
        wait_for(profiling(d, beta.pid), FOUND_WITHIN, "svc-beta profiled")
        held = targets(d)
        assert gamma.pid not in held
        a, b = held[alpha.pid], held[beta.pid]
        with d.client() as c:
            sel = {s["id"]: s for s in c.get("/selectors").json()}
        assert sel[a["origin"]["selector"]]["comm"] == "^svc-alpha$"
        assert sel[b["origin"]["selector"]]["cgroup"] == f"pod:{pod}"
        assert a["origin"]["start_time"] == start_ticks(alpha.pid) and a["origin"]["parent"] is None
        placement = b["origin"]["placement"]
        assert (placement["pod"], placement["container"], placement["runtime"]) == (pod, container, "containerd")
        assert placement["cgroup"].endswith(f"/cri-containerd-{container}.scope")
        # The metrics carry the pod and the container; the whole heap sits at ring_alloc.
        site = ring_site()
        assert metric(d, "heapscope_site_live_bytes", pid=str(beta.pid), pod=pod, container=container,
                      site=site) == RING_BYTES
        assert metric(d, "heapscope_site_live_bytes", pid=str(alpha.pid), pod="", site=site) == RING_BYTES
        assert metric(d, "heapscope_selector_matches_total", selector=str(a["origin"]["selector"])) == 1

        # A target that exits is marked, stays for --keep-exited, then goes.
        alpha.terminate()
        alpha.wait(10)
        wait_for(lambda: targets(d)[alpha.pid]["state"] == "exited", 30, "svc-alpha marked exited")
        wait_for(lambda: targets(d)[alpha.pid]["origin"]["expires_at"] is not None, 10, "an expiry time")
        gone = targets(d)[alpha.pid]
        assert gone["exited"] and gone["ended_at"] is not None and gone["origin"]["end_reason"] == "exited"
        wait_for(lambda: alpha.pid not in targets(d), 30, "svc-alpha forgotten after --keep-exited")
        assert services.running(beta.pid) and services.running(gamma.pid)
    finally:
        stop_daemon(d)


def test_ended_targets_beyond_max_exited_are_forgotten_oldest_first(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    """--max-exited: a prefork server that replaces a worker a second would have the daemon hold every ended
    profile for --keep-exited. Beyond the limit the oldest ended target goes first, said once in the log and
    counted; its files stay. (test_services_started_after_the_daemon_are_found_and_marked keeps its ended target
    on the default, 256.)"""
    d = start_daemon(heapscope_cmd, tmp_path, "--attach-comm", "^svc-churn$", "--max-exited", "2")
    try:
        ended: list[int] = []
        for _ in range(4):
            p = services.start("svc-churn")
            wait_for(profiling(d, p.pid, heap=None), FOUND_WITHIN, f"svc-churn {p.pid} profiled")
            p.terminate()
            p.wait(10)
            wait_for(lambda pid=p.pid: targets(d).get(pid, {}).get("state") != "profiling", 30, "its profile ended")
            ended.append(p.pid)
        wait_for(lambda: metric(d, "heapscope_targets_forgotten_total", reason="count") == 2, 10,
                 "two ended targets forgotten beyond --max-exited 2")
        held = targets(d)
        assert [pid for pid in ended if pid in held] == ended[2:], (ended, sorted(held))
        assert all(held[pid]["state"] == "exited" for pid in ended[2:])
        assert metric(d, "heapscope_targets_forgotten_total", reason="age") == 0
        for pid in ended:  # forgotten by the daemon, not by the disk
            assert (tmp_path / "out" / f"massif.out.{pid}").is_file(), pid
        assert d.stderr().count("--max-exited") == 1, d.stderr()
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("mode", ["exact", "sampled"])
def test_a_prefork_parent_and_its_children_through_exit_restart_and_exec(
    heapscope_cmd: list[str], services: Services, tmp_path: Path, mode: str
) -> None:
    """In both modes; sampled is the daemon's default. The first workers, forked before the parent's sampler was
    armed, have the library but no control thread: the daemon starts it again in them. The third, forked from the
    armed parent, samples from its fork on (the test below)."""
    d = start_daemon(heapscope_cmd, tmp_path, f"--mode={mode}", "--attach-comm", "^svc-prefork$")
    heap = RING_BYTES if mode == "exact" else None  # sampled: estimates
    try:
        parent = services.start("svc-prefork", workers=2)
        wait_for(lambda: len(children(parent.pid)) == 2, 10, "two workers")
        first, second = children(parent.pid)
        # The workers are named fleet-worker: the selector does not match them; they are followed as children.
        for pid in (parent.pid, first, second):
            wait_for(profiling(d, pid, heap), FOUND_WITHIN, f"{pid} profiled")
        held = targets(d)
        assert Path(f"/proc/{first}/comm").read_text().strip() == "fleet-worker"
        assert held[parent.pid]["origin"]["parent"] is None
        assert held[first]["origin"]["parent"] == parent.pid and held[second]["origin"]["parent"] == parent.pid
        assert held[first]["origin"]["selector"] == held[parent.pid]["origin"]["selector"]

        # One worker exits; the parent forks a new one (a restart): the old one is marked, the new one followed.
        os.kill(first, signal.SIGUSR1)
        # The old worker counts as a child until the parent reaps it: a new one is a child that is neither.
        wait_for(lambda: len(set(children(parent.pid)) - {first, second}) == 1, 10, "a new worker")
        [third] = set(children(parent.pid)) - {first, second}
        wait_for(lambda: targets(d)[first]["state"] == "exited", 30, "the old worker marked exited")
        wait_for(profiling(d, third, heap), FOUND_WITHIN, "the new worker profiled")
        assert targets(d)[third]["origin"]["parent"] == parent.pid
        if mode == "sampled":  # forked from an armed parent: its inherited sampler armed since its fork, and counts
            assert f"sampler inherited armed by {third} from the process it was forked from" in d.stderr()
            calls = targets(d)[third]["heap"]["allocation_calls"]
            wait_for(lambda: targets(d)[third]["heap"]["allocation_calls"] > calls, 30, "the new worker's calls")

        # The other worker execs the program again: its profile ends there, and the new image, still the parent's
        # program, is followed from its start (its name is now "exe": no selector matches it by name).
        before = targets(d)[second]
        os.kill(second, signal.SIGUSR2)
        wait_for(lambda: targets(d)[second]["started_at"] != before["started_at"], FOUND_WITHIN, "re-attached")
        wait_for(profiling(d, second, heap), FOUND_WITHIN, "the exec'ed worker profiled")
        after = targets(d)[second]
        assert after["command"] == "exe" and after["cmdline"].endswith("--worker")
        assert after["origin"]["parent"] == parent.pid
        assert after["origin"]["start_time"] == before["origin"]["start_time"]  # the same process
        assert f"process {second} exec'ed another program" in d.stderr()

        # An exec of another program ends the profile cleanly: marked, kept, not followed.
        os.kill(third, signal.SIGHUP)
        wait_for(lambda: targets(d)[third]["state"] != "profiling", 30, "the profile ended at the exec")
        wait_for(lambda: targets(d)[third]["origin"]["end_reason"] == "exec", 10, "marked as ended by an exec")
        assert Path(f"/proc/{third}/comm").read_text().strip() == "sleep"
        time.sleep(2)  # a span to observe, not a wait: nothing re-attaches it in that time
        assert targets(d)[third]["state"] == "detached"
        for pid in (parent.pid, second):
            assert services.running(pid)
    finally:
        stop_daemon(d)


def test_a_worker_forked_from_an_armed_parent_is_sampled_from_its_fork_with_no_stop(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    """Sampled mode, the daemon's default. A worker the parent forks while its sampler is armed keeps it armed,
    on the parent's lease: the daemon profiles it with no injection and no thread started in it. Detaching the
    parent leaves the worker profiled; heapscope's SIGKILL lets both go. At a rate that samples the worker's 50 kB a
    second several times a second (the panel's nginx and apache2 have forked workers at the default rate)."""
    d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", "--sample-rate=16384", "--attach-comm",
                     "^svc-forkarmed$")  # fmt: skip
    try:
        parent = services.start("svc-forkarmed", workers=1)
        wait_for(lambda: len(children(parent.pid)) == 1, 10, "a worker")
        [old] = children(parent.pid)
        wait_for(profiling(d, parent.pid, None), FOUND_WITHIN, "the parent profiled")
        wait_for(lambda: sampler_state(parent.pid) == "armed", 30, "the parent's sampler armed")
        time.sleep(1.5)  # the parent's calls counted before the fork: some 75, none of them the worker's
        os.kill(old, signal.SIGUSR1)  # a restart: the parent forks a new worker, armed
        wait_for(lambda: len(set(children(parent.pid)) - {old}) == 1, 10, "a new worker")
        [new] = set(children(parent.pid)) - {old}
        wait_for(profiling(d, new, None), FOUND_WITHIN, "the new worker profiled")
        assert f"sampler inherited armed by {new} from the process it was forked from" in d.stderr()
        assert not re.search(rf"sampler .*(loaded into|inherited by) {new}\b", d.stderr()), d.stderr()
        fields = sampler_fields(new)
        assert sampler_state(new) == "armed" and fields["control_tid"] == 0, fields  # no control thread started
        assert fields["forked_armed"] == FORKED_CLAIMED, fields  # this daemon took its share of the lease
        scans = fields["scans"]  # its parent's, counted on in the child
        threads = {Path(f"/proc/{new}/task/{t}/comm").read_text().strip() for t in os.listdir(f"/proc/{new}/task")}
        assert threads == {"fleet-worker"}, threads
        # Its exact counts start at its fork: one 1000-byte block every 20 ms, not the parent's calls before.
        born = targets(d)[new]
        parents_calls = targets(d)[parent.pid]["heap"]["allocation_calls"]
        assert 0 < born["heap"]["allocation_calls"] < parents_calls - 40, (born["heap"], parents_calls)
        assert targets(d)[new]["sampler"].endswith("inherited armed from its parent, threadless")
        # Its samples made the kernel's uprobe trampoline in it, anonymous code: no object to patch, so no rescan
        # (a call, which stops the worker) for it, two looks for new code later.
        wait_for(lambda: "[uprobes-trampoline]" in Path(f"/proc/{new}/maps").read_text(), 30, "a sample's trampoline")
        time.sleep(2 * NEW_CODE_EVERY + 0.5)
        assert sampler_fields(new)["scans"] == scans, (sampler_fields(new), scans)

        # The parent detached: the worker stays armed on the lease it shares, and is still counted.
        with d.client() as c:
            assert c.delete(f"/targets/{parent.pid}").status_code == 200
        # single-threaded, kept so: disarmed by a call, threadless
        wait_for(lambda: sampler(parent.pid) == ("threadless", "requested"), 30, "the parent's sampler disarmed")
        calls = targets(d)[new]["heap"]["allocation_calls"]
        wait_for(lambda: targets(d)[new]["heap"]["allocation_calls"] > calls, 30, "the worker's calls after it")
        assert sampler_state(new) == "armed" and targets(d)[new]["state"] == "profiling"

        # heapscope killed: the lease's last write end goes; the worker lets go at its next sample.
        d.proc.kill()
        d.proc.wait(30)
        wait_for(lambda: sampler(new) == ("threadless", "controller gone"), 30, "the worker's sampler let go")
        assert services.running(parent.pid) and services.running(new)
    finally:
        stop_daemon(d)


def test_a_forked_worker_keeps_its_probe_functions_as_the_library_has_them_through_a_sigkill(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    """Sampled mode, the daemon's default. The kernel runs a uprobe on the probe functions' 5-byte nop as a call into
    a trampoline page, which a forked child does not get: the worker inherits a call into nothing, and the kernel,
    taking a probe that trapped on top of it off again, puts back only its first byte (an invalid instruction, which
    killed a worker that sampled as heapscope died). The daemon puts the worker's code back as the library has it
    before its probes go on. A quiet worker (it allocates nothing: no sample between its probes and the SIGKILL)
    shows it: after the daemon's SIGKILL both processes hold the library's code."""
    d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", "--sample-rate=16384", "--attach-comm",
                     "^svc-quietfork$")  # fmt: skip
    try:
        parent = services.start("svc-quietfork", workers=1, env={"FLEET_QUIET_WORKERS": "1"})
        wait_for(lambda: len(children(parent.pid)) == 1, 10, "a worker")
        [old] = children(parent.pid)
        wait_for(profiling(d, parent.pid, None), FOUND_WITHIN, "the parent profiled")
        wait_for(lambda: sampler_state(parent.pid) == "armed", 30, "the parent's sampler armed")
        library = loaded_sampler(parent.pid)
        assert library is not None
        own = probe_code(None, library)
        # The parent's samples (some 3 a second) have its probes optimized: a call into its trampoline.
        wait_for(lambda: all(c[0] == 0xE8 for c in probe_code(parent.pid, library).values()), 30, "optimized probes")
        os.kill(old, signal.SIGUSR1)  # a restart: the parent forks a new worker, armed, with the parent's calls
        wait_for(lambda: len(set(children(parent.pid)) - {old}) == 1, 10, "a new worker")
        [new] = set(children(parent.pid)) - {old}
        wait_for(profiling(d, new, None), FOUND_WITHIN, "the new worker profiled")
        assert sampler_fields(new)["forked_armed"] == FORKED_CLAIMED
        assert f"sampler in {new}: hs_sample_alloc and hs_sample_free put back as its library has them" in d.stderr()
        # The daemon's probes on the library's own code: an int3 on its first byte at most, until a first sample.
        assert all(probe_code(new, library)[n][1:] == own[n][1:] for n in own), (probe_code(new, library), own)

        d.proc.kill()
        d.proc.wait(30)
        for pid in (parent.pid, new):

            def as_the_library(pid: int = pid) -> bool:
                return probe_code(pid, library) == own

            wait_for(as_the_library, 10, f"{pid}'s probe functions as the library's")
        assert services.running(parent.pid) and services.running(new)
    finally:
        stop_daemon(d)


def test_a_worker_forked_armed_and_not_profiled_is_disarmed_with_its_parent(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    """Sampled mode, the daemon's default. A parent attached by its PID alone (no selector follows its forks): a
    worker it forks while armed is armed on its lease since the fork, unclaimed. Without a thread of its own it
    would notice the lease gone only at its next sample, which a quiet worker never takes: detaching the parent
    disarms it too, by a call, and both run on."""
    d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", "--sample-rate=16384")
    try:
        parent = services.start("svc-unclaimed", workers=1, env={"FLEET_QUIET_WORKERS": "1"})
        wait_for(lambda: len(children(parent.pid)) == 1, 10, "a worker")
        [old] = children(parent.pid)
        with d.client() as c:
            assert c.post("/targets", json={"pid": parent.pid}).status_code < 300
        wait_for(profiling(d, parent.pid, None), FOUND_WITHIN, "the parent profiled")
        wait_for(lambda: sampler_state(parent.pid) == "armed", 30, "the parent's sampler armed")
        os.kill(old, signal.SIGUSR1)  # a restart: the parent forks a new worker, armed
        wait_for(lambda: len(set(children(parent.pid)) - {old}) == 1, 10, "a new worker")
        [new] = set(children(parent.pid)) - {old}
        wait_for(lambda: sampler_state(new) == "armed", 10, "the new worker armed since its fork")
        assert sampler_fields(new)["forked_armed"] == FORKED_ARMED  # unclaimed: nothing follows the parent's forks
        time.sleep(1.0)
        assert new not in targets(d) and sampler_state(new) == "armed"

        with d.client() as c:
            assert c.delete(f"/targets/{parent.pid}").status_code == 200
        # single-threaded, kept so: disarmed by a call, threadless
        wait_for(lambda: sampler(parent.pid) == ("threadless", "requested"), 30, "the parent's sampler disarmed")
        assert sampler(new) == ("threadless", "requested"), sampler_fields(new)
        assert f"sampler in {new}, forked armed by {parent.pid} and not profiled: disarmed with it" in d.stderr()
        assert services.running(parent.pid) and services.running(new)
    finally:
        stop_daemon(d)


def test_a_limit_refuses_with_a_clear_line_a_429_and_a_metric(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    d = start_daemon(heapscope_cmd, tmp_path, "--attach-comm", "^svc-limit$", "--max-targets", "1")
    try:
        one = services.start("svc-limit")
        wait_for(profiling(d, one.pid, heap=None), FOUND_WITHIN, "the first profiled")
        two = services.start("svc-limit")
        says = f"not profiling process {two.pid}: the daemon profiles 1 processes, its limit (--max-targets)"
        wait_for(lambda: says in d.stderr(), 30, "the refusal in the log")
        assert d.stderr().count(says) == 1  # said once, however often the scan meets it again
        assert two.pid not in targets(d)
        with d.client() as c:
            r = c.post("/targets", json={"pid": two.pid})
        assert r.status_code == 429 and r.json() == {"detail": says, "error": "TargetRefused"}
        refused = metric(d, "heapscope_targets_refused_total", reason="targets")
        assert refused is not None and refused >= 2
        assert metric(d, "heapscope_limit", kind="targets") == 1
        assert services.running(two.pid)
    finally:
        stop_daemon(d)


def test_sigkill_then_a_restarted_daemon_finds_the_same_processes(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    args = ("--attach-comm", "^svc-restart$")
    (tmp_path / "first").mkdir()
    d = start_daemon(heapscope_cmd, tmp_path / "first", *args)
    parent = services.start("svc-restart", workers=1)
    wait_for(lambda: len(children(parent.pid)) == 1, 10, "a worker")
    [worker] = children(parent.pid)
    try:
        for pid in (parent.pid, worker):
            wait_for(profiling(d, pid), FOUND_WITHIN, f"{pid} profiled")
        identities = {pid: t["origin"]["start_time"] for pid, t in targets(d).items()}
    finally:
        d.proc.kill()  # SIGKILL: nothing of the daemon's shutdown runs
        d.proc.wait()
    for pid in (parent.pid, worker):
        assert services.running(pid), f"{pid} does not run on after the daemon's SIGKILL"
    (tmp_path / "second").mkdir()
    d = start_daemon(heapscope_cmd, tmp_path / "second", *args)
    try:
        for pid in (parent.pid, worker):
            wait_for(profiling(d, pid), FOUND_WITHIN, f"{pid} profiled again")
        held = targets(d)
        assert {pid: held[pid]["origin"]["start_time"] for pid in identities} == identities
        assert held[worker]["origin"]["parent"] == parent.pid  # found as the chosen parent's child again
        for pid in (parent.pid, worker):
            assert services.running(pid)
    finally:
        stop_daemon(d)


def test_a_process_being_attached_is_listed_and_let_go_by_its_selectors_removal_or_a_delete(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    """A daemon's first target of a mode waits for its program's compile (seconds): meanwhile /targets lists it as
    attaching. Its selector removed then, the process is not left profiled once attached; a DELETE then waits for
    the attach and detaches it (not a 404 while it is being attached, then a profile nobody wants)."""
    d = start_daemon(heapscope_cmd, tmp_path, "--mode", "exact")
    try:
        with d.client() as c:
            r = c.post("/targets", json={"comm": "^svc-late$"})
            assert r.status_code == 201, r.text
            selector = r.json()["id"]
        late = services.start("svc-late")
        wait_for(lambda: targets(d).get(late.pid, {}).get("state") == "attaching", FOUND_WITHIN,
                 "the chosen process listed as attaching while the program compiles")
        listed = targets(d)[late.pid]
        assert listed["origin"]["selector"] == selector and listed["error"] is None
        with d.client() as c:
            assert c.delete(f"/selectors/{selector}").status_code == 200
        wait_for(lambda: late.pid not in targets(d), FOUND_WITHIN, "the process let go once attached")
        end = time.monotonic() + 3
        while time.monotonic() < end:  # and not profiled a moment later
            assert late.pid not in targets(d), "profiled by a selector removed during its attach"
            time.sleep(0.1)
        assert services.running(late.pid)

        # Asked for in the other mode (its program compiles now): a DELETE during the attach detaches it after.
        asked = services.start("svc-asked")
        answers: dict[str, httpx.Response] = {}

        def post() -> None:
            with d.client() as c:
                answers["post"] = c.post("/targets", json={"pid": asked.pid, "mode": "sampled"}, timeout=120)

        poster = threading.Thread(target=post)
        poster.start()
        wait_for(lambda: targets(d).get(asked.pid, {}).get("state") == "attaching", FOUND_WITHIN,
                 "the asked-for process listed as attaching")
        with d.client() as c:
            deleted = c.delete(f"/targets/{asked.pid}", timeout=120)
        poster.join(120)
        assert answers["post"].status_code == 201, answers["post"].text
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["state"] == "detached" and deleted.json()["files"]
        assert asked.pid not in targets(d) and services.running(asked.pid)
    finally:
        stop_daemon(d)


def test_a_deleted_target_stays_let_go_until_the_user_asks_for_it_again(
    heapscope_cmd: list[str], services: Services, tmp_path: Path
) -> None:
    """DELETE /targets/PID lets a process go: the selector that chose it does not take it back while it runs. A
    selector POSTed after that (the same pattern again) is the user asking anew and takes it, as does POST {pid}."""
    d = start_daemon(heapscope_cmd, tmp_path, "--mode", "exact")
    try:
        svc = services.start("svc-again")
        with d.client() as c:
            first = c.post("/targets", json={"comm": "^svc-again$"}).json()["id"]
        wait_for(profiling(d, svc.pid, heap=None), FOUND_WITHIN, "the process profiled through its selector")
        with d.client() as c:
            assert c.delete(f"/targets/{svc.pid}").status_code == 200
        end = time.monotonic() + 3  # the daemon looks again at its processes meanwhile (a rescan, fork events)
        while time.monotonic() < end:
            assert targets(d).get(svc.pid, {}).get("state") != "profiling", "taken back by the selector it left"
            time.sleep(0.2)

        with d.client() as c:
            assert c.delete(f"/selectors/{first}").status_code == 200
            second = c.post("/targets", json={"comm": "^svc-again$"}).json()["id"]
        wait_for(profiling(d, svc.pid, heap=None), FOUND_WITHIN, "the process profiled by the selector POSTed again")
        assert targets(d)[svc.pid]["origin"]["selector"] == second

        with d.client() as c:
            assert c.delete(f"/selectors/{second}").status_code == 200
            assert c.delete(f"/targets/{svc.pid}").status_code == 200
            again = c.post("/targets", json={"pid": svc.pid})
        assert again.status_code == 201, again.text
        wait_for(profiling(d, svc.pid, heap=None), FOUND_WITHIN, "the process profiled when asked for by its PID")
        assert services.running(svc.pid)
    finally:
        stop_daemon(d)
