"""Sampled mode's safe point on real threads (safe_point.c): the call chain decides, not every stack word.

- A thread blocked in pause() under a frame whose dead slots point into malloc is safe: sampled attach arms at
  once, where the old scan of every word refused it for good (shown here by the same check without tables).
- A process whose every thread is inside the allocator is refused with one line naming where each one is; the
  daemon shows it in /targets as waiting, tries again, and profiles it once its threads have left malloc.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from agent.process.inject import examine_threads
from tests.support.daemon import Daemon, start_daemon, stop_daemon, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def safe_point(build: Callable[..., Path]) -> Path:
    return build("safe_point.c")


class Program:
    """safe_point in a mode, its stderr a pipe nobody reads until drain()."""

    def __init__(self, program: Path, mode: str) -> None:
        self.proc = subprocess.Popen([str(program), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n"
        time.sleep(0.2)  # the main thread from its write() into malloc's lock wait

    @property
    def pid(self) -> int:
        return self.proc.pid

    def drain(self) -> bytes:
        """Read the full stderr pipe: malloc_stats goes on and lets go of the arena's lock."""
        threading.Thread(target=lambda: self.proc.stderr.read() if self.proc.stderr else None, daemon=True).start()
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def stale(safe_point: Path) -> Iterator[Program]:
    p = Program(safe_point, "stale")
    yield p
    p.end()


@pytest.fixture
def locked(safe_point: Path) -> Iterator[Program]:
    p = Program(safe_point, "locked")
    yield p
    p.end()


def test_stale_pointers_into_malloc_in_dead_slots_do_not_keep_an_idle_thread_unsafe(
    heapscope_cmd: list[str], stale: Program, tmp_path: Path
) -> None:
    [scanned] = examine_threads(stale.pid, unwind=False).values()
    assert not scanned.safe and "malloc" in scanned.where  # the words are there: the old scan refused it
    [unwound] = examine_threads(stale.pid).values()
    assert unwound.safe and not unwound.scanned and unwound.frames >= 3, unwound
    started = time.monotonic()
    prof = subprocess.Popen([*heapscope_cmd, "attach", str(stale.pid)], cwd=tmp_path, stderr=subprocess.PIPE,
                            text=True)
    assert prof.stderr is not None
    lines = []
    for line in prof.stderr:
        lines.append(line)
        if "sampler armed" in line:
            break
    armed_after = time.monotonic() - started
    prof.send_signal(2)
    rest = prof.communicate(timeout=60)[1]
    log = "".join(lines) + rest
    assert prof.returncode == 0 and "sampler armed" in log and "Traceback" not in log, log
    assert "by thread" in log and stale.proc.poll() is None
    print(f"armed {armed_after:.1f} s after the attach started")


def test_every_thread_inside_malloc_is_a_refusal_that_names_where_each_is(
    heapscope_cmd: list[str], locked: Program, tmp_path: Path
) -> None:
    verdicts = examine_threads(locked.pid)
    assert len(verdicts) == 2 and not any(v.safe for v in verdicts.values()), verdicts
    done = subprocess.run([*heapscope_cmd, "attach", str(locked.pid)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    errors = [line for line in done.stderr.splitlines() if "safe point" in line]
    assert done.returncode == 3 and len(errors) == 1, done.stderr
    assert f"thread {locked.pid} in __libc_malloc" in errors[0] and "in __malloc_stats" in errors[0], errors[0]
    assert "Traceback" not in done.stderr
    # Nothing was changed: once stderr is read, malloc returns and the program goes on.
    assert locked.drain().startswith(b"unlocked")
    assert locked.proc.poll() is None


@pytest.fixture
def sampled_daemon(heapscope_cmd: list[str], tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(heapscope_cmd, tmp_path, "--mode=sampled")  # the daemon's default mode, said explicitly
    yield d
    stop_daemon(d)


def test_the_daemon_shows_a_process_without_a_safe_point_as_waiting_and_profiles_it_later(
    sampled_daemon: Daemon, locked: Program
) -> None:
    client = sampled_daemon.client()
    r = client.post("/targets", json={"pid": locked.pid}, timeout=120)
    assert r.status_code == 409 and "in __libc_malloc" in r.json()["detail"], r.text
    [waiting] = [t for t in client.get("/targets").json() if t["pid"] == locked.pid]
    assert waiting["state"] == "waiting" and "in __malloc_stats" in waiting["error"], waiting
    assert 'heapscope_targets_waiting 1.0' in client.get("/metrics").text
    assert locked.drain().startswith(b"unlocked")

    def profiled() -> bool:
        states = [t["state"] for t in client.get("/targets").json() if t["pid"] == locked.pid]
        return states == ["profiling"]

    wait_for(profiled, 60, "the waiting target profiled")
    assert 'heapscope_targets_waiting 0.0' in client.get("/metrics").text
    assert f"profiling {locked.pid} (safe_point, asked for, after " in sampled_daemon.stderr(), sampled_daemon.stderr()
    assert httpx.get(f"{sampled_daemon.url}/healthz").status_code == 200


def test_a_waiting_target_let_go_by_delete_or_by_its_selector_is_no_longer_tried(
    sampled_daemon: Daemon, locked: Program
) -> None:
    client = sampled_daemon.client()

    def states() -> list[str]:
        return [t["state"] for t in client.get("/targets").json() if t["pid"] == locked.pid]

    # Chosen by a selector, waiting; the selector removed: the wait ends with it.
    chosen = client.post("/targets", json={"comm": "^safe_point$", "follow_children": False}, timeout=30)
    assert chosen.status_code in (200, 201), chosen.text
    wait_for(lambda: states() == ["waiting"], 60, "the selected process waiting")
    assert client.delete(f"/selectors/{chosen.json()['id']}").status_code == 200
    assert states() == [] and 'heapscope_targets_waiting 0.0' in client.get("/metrics").text

    # Asked for by PID, waiting; DELETE answers with it, and it is not tried again once it could be profiled.
    assert client.post("/targets", json={"pid": locked.pid}, timeout=120).status_code == 409
    assert states() == ["waiting"]
    gone = client.delete(f"/targets/{locked.pid}")
    assert gone.status_code == 200 and gone.json()["state"] == "detached", gone.text
    assert locked.drain().startswith(b"unlocked")
    time.sleep(5)  # past the first retry (2 s): nothing may attach it now
    assert states() == [] and f"profiling {locked.pid}" not in sampled_daemon.stderr()
    assert locked.proc.poll() is None
