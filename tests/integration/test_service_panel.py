"""Sampled mode on a panel of real servers from Debian's packages (issue 31), through the real daemon.

Each service (tests/support/services.py: nginx, postgres, python3's http.server, memcached, redis, lighttpd, apache2
with the prefork MPM and a worker replaced every 10,000 connections, apache2 as Debian sets it up, with the event MPM,
and with the prefork MPM as Debian's mpm_prefork.conf sets it, haproxy with Debian's chroot and without it) runs as
its package runs it, on a free loopback port with its files in a temporary directory. For each one `heapscope serve`
(sampled, its default) is given a selector for the service's main process, and must:
- profile every process of it (a master and its workers; the postmaster, its background processes and the backend
  of an open connection) in sampled mode, with the sampler armed in each (read from the sampler's own control block
  in the process);
- let the service's own load tool (ab, pgbench, memcaslap, redis-benchmark) run without an error while attached,
  its allocator calls counted;
- detach (the selector and the targets deleted): every sampler disarmed, the load tool runs without an error;
- attached again (POST /targets per process), survive heapscope's SIGKILL: every sampler disarms by itself (a
  threadless one, haproxy's worker's, at its first sample under the next load), the processes run on, the service
  answers and its load tool runs without an error.
nginx is also reloaded and has a worker killed, apache2 (prefork) has every worker replaced after its
MaxConnectionsPerChild connections, and apache2-event and apache2-prefork are reloaded (`apachectl graceful`): the new
workers are profiled too; postgres gets a new connection: its new backend is profiled too.
What must be armed and must survive are a service's steady processes (Service.steady_pids): not the ones it starts
and ends by itself (postgres's autovacuum workers, the backends of pgbench's connections, which end a moment after
pgbench), and apache2's workers once its pool has settled after a load.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.model.sampling import DEFAULT_SAMPLE_RATE
from tests.support.armed import allocated_bytes, sampler, sampler_state, threadless_armed
from tests.support.capability import unavailable
from tests.support.daemon import AUTH, Daemon, start_daemon, stop_daemon
from tests.support.services import SERVICES, Apache, Nginx, Postgres, Service
from tests.support.tracepoints import syscall_tracepoints
from tests.support.wait import wait_for

pytestmark = pytest.mark.integration

LOAD_SECONDS = 3.0
# The daemon attaches a process in seconds of CPU (it compiles a BPF program a target), two at a time: a wait for
# several processes allows this long for the first one and again after each one armed, so that it scales with their
# number and with how busy the machine is, and fails when the daemon makes no progress.
ARMED_WITHIN = 90.0
DISARMED_WITHIN = 5.0  # the sampler's own watchdog sees its controller gone within a second


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def targets(d: Daemon) -> dict[int, dict[str, Any]]:
    with d.client() as c:
        r = c.get("/targets")
    assert r.status_code == 200, r.text
    return {t["pid"]: t for t in r.json()}


def add_selector(d: Daemon, svc: Service) -> int:
    with d.client() as c:
        r = c.post("/targets", json={"cmdline": svc.selector})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def attach_each(d: Daemon, svc: Service, pids: Iterable[int]) -> None:
    """POST /targets per process: a selector does not choose again what the user let go."""
    roles = svc.processes()
    with httpx.Client(base_url=d.url, headers=AUTH, timeout=ARMED_WITHIN) as c:
        for pid in pids:
            r = c.post("/targets", json={"pid": pid})
            why = f"{svc.name}: POST /targets {pid} ({roles.get(pid, '?')}): {r.status_code} {r.text}"
            assert r.status_code == 201 or not alive(pid), why  # one that ended since has nothing to attach


def daemon_lines(d: Daemon, pid: int) -> list[str]:
    """The daemon's log lines about the process (a refusal says why)."""
    about = [ln for ln in d.stderr().splitlines() if re.search(rf"\b{pid}\b", ln)]
    trouble = [ln for ln in about if re.search(r"cannot|refus|waiting|error|fail", ln)]
    return (trouble or about)[-3:]


def wait_armed(d: Daemon, svc: Service, pids: Iterable[int], what: str) -> None:
    """Until every one of the processes still running is a target profiling in sampled mode with its sampler
    armed; else (one refused, or none more armed for ARMED_WITHIN) fail naming what each missing one is, what
    /targets says and what the daemon logged."""
    want = sorted(set(pids))
    assert want, f"{svc.name}: no processes to check ({what})"
    deadline = time.monotonic() + ARMED_WITHIN
    done = 0  # armed, or ended
    while True:
        have = targets(d)
        roles = svc.processes()
        problems: dict[int, str] = {}
        for pid in want:
            if not alive(pid):
                continue  # a process that ended meanwhile (a postgres autovacuum worker) has nothing to profile
            t = have.get(pid)
            state = sampler_state(pid)
            if t is None:
                problems[pid] = f"{pid} ({roles.get(pid, '?')}): not in /targets; sampler {state}"
            elif t["state"] != "profiling" or t["mode"] != "sampled" or state != "armed":
                problems[pid] = (f"{pid} ({roles.get(pid, '?')}): {t['state']} {t['mode']}, sampler {state}, "
                                 f"error {t['error']!r}")
        if not problems:
            return
        if len(want) - len(problems) > done:
            done = len(want) - len(problems)
            deadline = time.monotonic() + ARMED_WITHIN
        refused = {p: v for p, v in problems.items() if have.get(p, {}).get("state") == "refused"}  # for good
        if refused or time.monotonic() > deadline:
            problems = refused or problems  # the others may be on their way still
            logged = [ln for p in problems for ln in daemon_lines(d, p)]
            when = "(refused)" if refused else f"(none more in {ARMED_WITHIN:.0f} s, {done} of {len(want)} were)"
            raise AssertionError(f"{svc.name}, {what}: not every process profiled with its sampler armed {when}:\n  "
                                 + "\n  ".join(problems.values())
                                 + "\ndaemon log:\n  " + "\n  ".join(logged))
        time.sleep(0.5)


def wait_disarmed(svc: Service, pids: Iterable[int], what: str, reason: str | None = None) -> None:
    """Until no process's sampler is armed; then each one's is idle (loaded, its hooks put back), disarmed for
    `reason` if given."""
    want = sorted(set(pids))
    deadline = time.monotonic() + DISARMED_WITHIN
    while True:
        got = {p: sampler(p) for p in want}
        if not [p for p, (state, _) in got.items() if state == "armed"]:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{svc.name}, {what}: the sampler stayed armed: {got}")
        time.sleep(0.05)
    idle = ("idle", "threadless")  # threadless: idle with no control thread (a process that may start none)
    if reason is None:
        wrong = {p: sr for p, sr in got.items() if sr[0] not in (*idle, "not loaded", "gone")}
    else:
        wrong = {p: sr for p, sr in got.items() if sr not in [(s, reason) for s in idle] and sr[0] != "gone"}
    assert not wrong, f"{svc.name}, {what}: samplers not idle{f' ({reason})' if reason else ''}: {wrong}"


def working_dirs(pids: Iterable[int]) -> dict[tuple[int, int], str]:
    """Each thread's working directory, by (process, thread): a thread may have a filesystem context of its own
    (the sampler's folder handover gives the loading thread one, for the dlopen alone)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):  # gone meanwhile
                out[(pid, int(tid))] = os.readlink(f"/proc/{pid}/task/{tid}/cwd")
    return out


def held(d: Daemon) -> dict[int, dict[str, Any]]:
    """The targets not ended (profiling, or waiting to be attached)."""
    return {pid: t for pid, t in targets(d).items() if t["ended_at"] is None}


def detach_all(d: Daemon, selector: int) -> None:
    """DELETE the selector, then every target it left (profiling or waiting)."""
    refused = []
    with d.client() as c:
        r = c.delete(f"/selectors/{selector}")
        assert r.status_code == 200, r.text
        for pid, t in held(d).items():
            r = c.delete(f"/targets/{pid}")
            if r.status_code != 200 and pid in held(d):  # not one that ended meanwhile (a pgbench backend)
                what = f"{t['cmdline'].strip()}, {t['state']}"
                refused.append(f"DELETE /targets/{pid} ({what}): {r.status_code} {r.text}")
    assert not refused, "a target listed in /targets could not be detached:\n  " + "\n  ".join(refused)


def allocation_calls(d: Daemon) -> int:
    """The allocator calls the daemon counted in all its targets, ended ones included (sampled mode counts every
    call, exactly, while it samples the bytes)."""
    return sum(t["heap"]["allocation_calls"] for t in targets(d).values())


def check_load(svc: Service, when: str) -> None:
    got = svc.load(LOAD_SECONDS)
    assert got.ok, f"{svc.name} {when}: {got}"


def extras(d: Daemon, svc: Service) -> None:
    """What a prefork server does to its processes while profiled: they are profiled after it too."""
    if isinstance(svc, Nginx):
        new = svc.reload()
        wait_armed(d, svc, [svc.main_pid, *new], "after nginx -s reload")
        killed, now = svc.kill_worker()
        wait_armed(d, svc, now, f"after worker {killed} was killed")
        assert svc.answers()
    if isinstance(svc, Postgres):
        backend = svc.connect()
        wait_armed(d, svc, [backend], f"after a new connection (backend {backend})")
    if isinstance(svc, Apache) and not svc.MAX_CONNECTIONS_PER_CHILD:  # no child ends for its connections' count
        new = svc.reload()
        wait_armed(d, svc, [svc.main_pid, *new], "after a graceful restart (apachectl graceful)")
    elif isinstance(svc, Apache):
        new = svc.recycle_workers()
        wait_armed(d, svc, [svc.main_pid, *new], "after every worker was recycled (MaxConnectionsPerChild)")





@pytest.mark.parametrize("name", list(SERVICES))
def test_sampled_mode_on_a_real_service(name: str, heapscope_cmd: list[str], tmp_path: Path) -> None:
    cls = SERVICES[name]
    missing = cls.missing()
    if missing:
        unavailable(f"{name} is not installed ({', '.join(missing)}): scripts/setup.sh apt")
    with cls() as svc:
        check_load(svc, "untraced")
        # The daemon's own default, said: start_daemon chooses exact mode unless told.
        d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled", "--no-store")
        try:
            dirs = working_dirs(svc.steady_pids())
            selector = add_selector(d, svc)
            pids = svc.steady_pids()
            wait_armed(d, svc, pids, "at attach")
            moved = {k: (dirs[k], v) for k, v in working_dirs(pids).items() if k in dirs and dirs[k] != v}
            assert not moved, f"{svc.name}: threads whose working directory the attach changed: {moved}"
            # Sampled mode's default traces no system call (the page calls only with --page-calls=yes), and still
            # reads every process's mapped total.
            assert not syscall_tracepoints(d.proc.pid), syscall_tracepoints(d.proc.pid)
            pages = {pid: t["pages"] for pid, t in targets(d).items()}
            assert all(pid in pages and pages[pid]["mapped_bytes"] > 0 for pid in pids), pages
            assert not any(p["page_calls_traced"] for p in pages.values()), pages
            calls = allocation_calls(d)
            check_load(svc, "while attached")
            wait_armed(d, svc, pids, "after the load")
            wait_for(lambda: allocation_calls(d) > calls, 10, f"{svc.name}: allocator calls counted under the load")
            extras(d, svc)

            detach_all(d, selector)
            pids = svc.steady_pids()
            wait_disarmed(svc, pids, "after detach")
            assert not held(d), f"targets left after detach: {held(d)}"
            check_load(svc, "after detach")

            pids = svc.steady_pids()
            attach_each(d, svc, pids)
            wait_armed(d, svc, pids, "at the second attach")
            roles = svc.processes()
            # A threadless sampler (haproxy's worker) sees the lease close at its next sample: under the load, if
            # its allocations reach one (below).
            threadless = {p: allocated_bytes(p) for p in pids if threadless_armed(p)}
            d.proc.kill()
            d.proc.wait(30)
            wait_disarmed(svc, [p for p in pids if p not in threadless], "after heapscope's SIGKILL", "controller gone")
            # Before any request of ours: apache's workers end by themselves after so many connections.
            gone = [f"{p} ({roles.get(p, '?')})" for p in pids if not alive(p)]
            assert not gone, f"{svc.name}: gone after heapscope's SIGKILL: {', '.join(gone)}; its log: {svc.log_tail()}"
            assert svc.answers(), f"{svc.name} does not answer after heapscope's SIGKILL"
            check_load(svc, "after heapscope's SIGKILL")
            # One whose allocations since the kill were 8 mean distances between samples has had a sample due but
            # with a chance of e^-8: it must have let go. Fewer (haproxy allocates from its own pools), and it may
            # still wait for its first: its hooks only count, as they did while heapscope was there.
            due = [p for p, before in threadless.items() if allocated_bytes(p) - before > 8 * DEFAULT_SAMPLE_RATE]
            wait_disarmed(svc, due, "after heapscope's SIGKILL and a load", "controller gone")
        finally:
            stop_daemon(d)
