"""A `run` target held at an event is released however heapscope ends: SIGKILL of heapscope while the target is
stopped leaves it running, and it runs to its end (agent/process/watchdog.py)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from agent.process.watchdog import process_state


def _launched_target(heapscope: subprocess.Popen[bytes], program: Path, deadline: float) -> int:
    """The PID of heapscope's child once it has exec'ed `program`."""
    parent = psutil.Process(heapscope.pid)
    while time.monotonic() < deadline:
        for child in parent.children():
            try:
                if child.exe() == str(program):
                    return int(child.pid)
            except psutil.Error:
                continue
        assert heapscope.poll() is None, "heapscope ended before its target ran"
        time.sleep(0.001)
    pytest.fail("heapscope never exec'ed its target")


def _wait_held(pid: int, deadline: float) -> None:
    """Until the target is stopped at one of the events `run` holds it at (its exec, a loader change, exit())."""
    while time.monotonic() < deadline:
        state = process_state(pid)
        if state == "T":
            return
        assert state not in ("", "Z"), "the target ended without ever being held"
        time.sleep(0.0005)
    pytest.fail("the target was never seen held at an event")


def test_sigkill_of_run_leaves_no_target_stopped(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    program = build("release_target.c")
    marker = tmp_path / "finished"
    heapscope = subprocess.Popen(
        [*heapscope_cmd, "run", f"--massif-out-file={tmp_path / 'massif.out'}", "--", str(program), str(marker)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    pid = 0
    try:
        deadline = time.monotonic() + 120
        pid = _launched_target(heapscope, program, deadline)
        target_fd = os.pidfd_open(pid)
        _wait_held(pid, deadline)
        heapscope.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert heapscope.wait(10) == -signal.SIGKILL
        # Within a second the target is no longer stopped...
        while process_state(pid) in ("T", "t") and time.monotonic() < killed_at + 1.0:
            time.sleep(0.005)
        state = process_state(pid)
        assert state not in ("T", "t"), f"the target is still stopped ({state}) 1 s after heapscope was killed"
        # ...and it runs to its end: it writes its marker and exits (reaped by init, so seen through its pidfd).
        ready, _, _ = select.select([target_fd], [], [], 60)
        os.close(target_fd)
        assert ready, "the target did not end within 60 s of heapscope's death"
        assert marker.read_text() == "finished\n"
    finally:
        if heapscope.poll() is None:
            heapscope.kill()
            heapscope.wait()
        if pid and process_state(pid) not in ("", "Z"):  # a failed run leaves nothing behind
            os.kill(pid, signal.SIGKILL)
