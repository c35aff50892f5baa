"""ReleaseWatchdog (agent/process/watchdog.py): a stopped process is continued when its owner dies, and left alone
when the owner dismisses the watchdog. Real processes, no root needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.process.watchdog import process_state

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def stopped_sleeper() -> Iterator[int]:
    """A process stopped by SIGSTOP, as the BPF program stops a `run` target at an event."""
    proc = subprocess.Popen(["sleep", "30"])
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while process_state(proc.pid) != "T":
        assert time.monotonic() < deadline, "sleep did not stop"
        time.sleep(0.005)
    yield proc.pid
    proc.kill()
    proc.wait()


def _owner(pid: int, then: str, before: str = "") -> subprocess.CompletedProcess[str]:
    """A process that does `before`, sets up a watchdog for `pid`, then does `then` (Python code)."""
    code = textwrap.dedent(
        f"""
        import os, signal
        from agent.process.watchdog import ReleaseWatchdog
        {before}
        w = ReleaseWatchdog({pid})
        print(w.watchdog_pid, flush=True)
        {then}
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=30)


def _state_within(pid: int, seconds: float, wanted: str) -> str:
    deadline = time.monotonic() + seconds
    state = process_state(pid)
    while state != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
        state = process_state(pid)
    return state


def test_killed_owner_leaves_no_process_stopped(stopped_sleeper: int) -> None:
    done = _owner(stopped_sleeper, "os.kill(os.getpid(), signal.SIGKILL)")
    assert done.returncode == -signal.SIGKILL
    assert _state_within(stopped_sleeper, 1.0, "S") == "S"  # continued: back to sleeping


def test_dismissed_watchdog_sends_nothing(stopped_sleeper: int) -> None:
    done = _owner(stopped_sleeper, "w.dismiss()")
    assert done.returncode == 0, done.stderr
    watchdog = int(done.stdout.split()[0])
    assert process_state(watchdog) in ("", "Z")  # it has ended (reaped by dismiss)
    time.sleep(0.3)  # a span to observe, not a wait: no signal comes in that time
    assert process_state(stopped_sleeper) == "T"  # an orderly end lets the target go itself: no signal here


def test_watchdog_keeps_no_other_descriptor(stopped_sleeper: int) -> None:
    """Copies of heapscope's descriptors (BPF links, a held child's go pipe) would outlive heapscope in the
    watchdog: it keeps its pipe and two pidfds only."""
    done = _owner(
        stopped_sleeper,
        "import time; time.sleep(0.5); print(len(os.listdir(f'/proc/{w.watchdog_pid}/fd')), flush=True); w.dismiss()",
        before="extra = [os.open('/dev/null', os.O_RDONLY) for _ in range(5)]",
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[1]) == 3
