"""agent.daemon.fleet's choices over a /proc tree written here, with the attach itself replaced (no BPF): what the
scan chooses, which children it follows, that a process is known by its start time, and the limits' refusals.
The real thing against compiled programs is tests/integration/test_fleet.py."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.cli import expand_filename
from agent.daemon import manager as manager_module
from agent.daemon.fleet import FleetConfig, FleetManager, _Job
from agent.daemon.manager import DaemonConfig, failure_said
from agent.errors import NoSuchTarget, TargetError
from agent.export.metrics import FleetCollector
from agent.model.counters import Counters
from agent.model.fleet import Limits, TargetOrigin
from agent.model.options import MassifOptions
from agent.model.selector import Selector
from agent.session.pipeline import ProfileSettings
from agent.session.storerec import StoreSettings
from agent.store import Retention


def write_process(proc: Path, pid: int, comm: str, ppid: int, exe: str, args: list[str], cgroup: str = "/",
                  start: int = 1000) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    # Fields 3..22 of /proc/PID/stat: state, ppid, then 16 we do not read, then the start time.
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} " + " ".join(["0"] * 17) + f" {start} 0 0\n")
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in args))
    (d / "cgroup").write_text(f"0::{cgroup}\n")
    (d / "exe").symlink_to(exe)


@dataclass
class FakeTarget:
    pid: int
    command: str
    state: str = "profiling"
    origin: TargetOrigin = field(default_factory=TargetOrigin)
    ended_at: float | None = None

    def counters(self) -> Counters:
        return Counters(n_sites=3)


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    proc = tmp_path / "proc"
    write_process(proc, 100, "nginx", 1, "/usr/sbin/nginx", ["nginx: master"], "/system.slice/nginx.service")
    write_process(proc, 101, "nginx-w", 100, "/usr/sbin/nginx", ["nginx: worker"], "/system.slice/nginx.service")
    write_process(proc, 102, "nginx-w", 100, "/usr/sbin/nginx", ["nginx: worker"], "/system.slice/nginx.service")
    write_process(proc, 103, "sh", 100, "/bin/sh", ["sh", "-c", "logrotate"], "/system.slice/nginx.service")
    write_process(proc, 104, "nginx-w", 101, "/usr/sbin/nginx", ["nginx: worker"], "/system.slice/nginx.service")
    write_process(proc, 200, "redis-server", 1, "/usr/bin/redis-server", ["redis-server *:6379"])
    write_process(proc, 300, "nginx", 2, "/nonexistent", [])  # a kernel thread: no command line

    def fake_attach(self: FleetManager, pid: int, mode: object = None) -> FakeTarget:
        if not (proc / str(pid)).exists():
            raise NoSuchTarget(f"no process with PID {pid}")
        t = FakeTarget(pid, (proc / str(pid) / "comm").read_text().strip())
        self._targets[pid] = t  # type: ignore[assignment]
        return t

    monkeypatch.setattr(manager_module.TargetManager, "attach", fake_attach)

    def make(limits: Limits | None = None, follow: bool = True, store: StoreSettings | None = None,
             files: dict[str, str] | None = None) -> FleetManager:
        profile = ProfileSettings(opts=MassifOptions(), store=store, files=files or {})
        config = DaemonConfig(profile=profile, output_dir=tmp_path / "out", expand=expand_filename, say=said.append)
        selectors = (Selector.make(comm="^nginx$", follow_children=follow),)
        m = FleetManager(config, FleetConfig(selectors=selectors, limits=limits or Limits(), use_events=False),
                         proc=str(proc))

        def drain() -> None:  # what the attach workers do, in this thread
            while not m._queue.empty():
                job = m._queue.get()
                assert job is not None
                m._do(job)
                m._queued.discard(job.pid)

        m.drain = drain  # type: ignore[attr-defined]
        return m

    said: list[str] = []
    make.said = said  # type: ignore[attr-defined]
    make.proc = proc  # type: ignore[attr-defined]
    return make


def test_the_scan_chooses_the_match_and_follows_its_children_that_run_its_program(fleet) -> None:  # type: ignore[no-untyped-def]
    m = fleet()
    m._scan()
    m.drain()
    held = {t.pid: t.origin for t in m.targets()}
    # 101, 102 renamed themselves (no match by name) but run nginx: followed; 104 is a grandchild; 103 runs sh.
    assert sorted(held) == [100, 101, 102, 104]
    assert held[100].parent is None and held[100].selector == 1 and held[100].start_time == 1000
    assert held[101].parent == 100 and held[104].parent == 101
    assert held[100].placement.unit == "nginx.service"
    assert m.fleet_status().selectors[0].matched == 4


def test_without_following_children_only_the_match(fleet) -> None:  # type: ignore[no-untyped-def]
    m = fleet(follow=False)
    m._scan()
    m.drain()
    assert [t.pid for t in m.targets()] == [100]


def test_a_reused_pid_is_another_process(fleet) -> None:  # type: ignore[no-untyped-def]
    m = fleet()
    job = _Job(100, "match", 1, None, start_time=999)  # chosen as a process that started at 999
    with pytest.raises(NoSuchTarget, match="went away"):
        m.attach(job.pid, selector=1, identity=job.start_time)
    assert m.targets() == []


def test_a_limit_refuses_and_counts_and_says_it_once(fleet) -> None:  # type: ignore[no-untyped-def]
    m = fleet(limits=Limits(max_targets=2))
    m._scan()
    m.drain()
    assert len(m.targets()) == 2
    status = m.fleet_status()
    assert status.refused["targets"] == 2 and status.limits.max_targets == 2
    refusals = [line for line in fleet.said if "its limit (--max-targets)" in line]
    assert len(refusals) == 2
    m._scan()  # the next scan meets them again: counted again, not said again
    m.drain()
    assert m.fleet_status().refused["targets"] == 4
    assert len([line for line in fleet.said if "its limit (--max-targets)" in line]) == 2


def test_ended_targets_are_forgotten_first_to_make_room_for_sites_or_memory(fleet) -> None:  # type: ignore[no-untyped-def]
    m = fleet(limits=Limits(max_memory=1))  # always at the limit
    ended = FakeTarget(555, "old", state="exited", ended_at=1.0)
    m._targets[555] = ended  # type: ignore[assignment]
    refusal = m._refusal()
    assert refusal is not None and refusal.reason == "memory"
    assert 555 not in {t.pid for t in m.targets()}  # forgotten on the way, still refused
    assert any("forgot ended target 555" in line for line in fleet.said)


def test_the_old_history_of_processes_no_longer_profiled_is_deleted_and_counted(  # type: ignore[no-untyped-def]
    fleet, tmp_path: Path
) -> None:
    root = tmp_path / "out" / "store"
    now = time.time()
    for name in ("100", "777"):  # 100 is profiled after the scan; 777 is a process long gone
        (root / name).mkdir(parents=True)
        seg = root / name / "seg-00000001.hss"
        seg.write_bytes(b"x")
        os.utime(seg, (now - 7200, now - 7200))
    m = fleet(store=StoreSettings(root, retention=Retention(max_age_s=3600.0)))
    m._scan()
    m.drain()
    assert 100 in {t.pid for t in m.targets()}
    m._housekeeping()
    assert not (root / "777").exists()
    assert (root / "100" / "seg-00000001.hss").exists()  # its writer keeps it within the retention
    status = m.fleet_status()
    assert (status.expired_segments, status.expired_histories) == (1, 1)
    assert any("store: deleted 1 segments older than --store-max-age" in line for line in fleet.said)
    metrics = {f.name: f.samples[0].value for f in FleetCollector(m).collect() if f.name.startswith("heapscope_store")}
    assert metrics == {"heapscope_store_expired_segments": 1, "heapscope_store_expired_histories": 1}
    (root / "778").mkdir()
    (root / "778" / "seg-00000001.hss").write_bytes(b"x")
    os.utime(root / "778" / "seg-00000001.hss", (now - 7200, now - 7200))
    m._housekeeping()  # the next sweep is ten minutes away
    assert (root / "778").exists()


def test_the_old_output_files_of_processes_no_longer_profiled_are_deleted_and_counted(  # type: ignore[no-untyped-def]
    fleet, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    now = time.time()
    for name in ("massif.out.100", "massif.out.777", "massif.out.778", "README"):
        (out / name).write_text("x")
        os.utime(out / name, (now - 8 * 86400, now - 8 * 86400))
    (out / "massif.out.779").write_text("x")  # written an hour ago
    m = fleet(files={"massif": "massif.out.%p"})
    m._scan()
    m.drain()
    m._housekeeping()
    assert sorted(p.name for p in out.iterdir()) == ["README", "massif.out.100", "massif.out.779"]
    assert m.fleet_status().expired_outputs == 2
    assert any("deleted 2 output files older than --output-max-age" in line for line in fleet.said)
    metrics = {f.name: f.samples[0].value for f in FleetCollector(m).collect() if f.samples}
    assert metrics["heapscope_output_files_expired"] == 2


def test_output_files_stay_for_good_at_an_age_of_zero(fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    out.mkdir()
    (out / "massif.out.777").write_text("x")
    os.utime(out / "massif.out.777", (1.0, 1.0))
    m = fleet(files={"massif": "massif.out.%p"})
    m.fleet = replace(m.fleet, output_max_age=0.0)
    m._housekeeping()
    assert (out / "massif.out.777").exists() and m.fleet_status().expired_outputs == 0


def test_a_failed_profile_is_said_with_its_type_and_place_when_it_is_a_bug() -> None:
    def fail(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:
            return caught

    assert failure_said(fail(TargetError("process 4 exited"))) == "process 4 exited"
    bug = failure_said(fail(AssertionError()))  # no message of its own: the type and the line name it
    assert bug.startswith("AssertionError at test_fleet_scan.py:") and bug.split(":")[-1].isdigit()
    key = failure_said(fail(KeyError("x")))
    assert key.startswith("KeyError at test_fleet_scan.py:") and key.endswith(": 'x'")
