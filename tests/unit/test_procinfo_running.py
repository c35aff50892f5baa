"""procinfo.running: the sampling loop's cheap liveness check, by PID and start time, against a fake /proc."""

from __future__ import annotations

from pathlib import Path

from agent.process.procinfo import running, start_time


def write_stat(proc: Path, pid: int, state: str, started: int, comm: str = "svc (a) b") -> None:
    # Fields after the command name: state is field 3, the start time field 22 (index 19 after the name).
    tail = [state, "1", *["0"] * 17, str(started), "0"]
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(tail) + "\n")


def test_the_same_process_runs(tmp_path: Path) -> None:
    write_stat(tmp_path, 42, "S", 1234)
    started = start_time(42, str(tmp_path))
    assert started == 1234
    assert running(42, started, str(tmp_path))


def test_a_zombie_a_gone_process_and_a_reused_pid_do_not(tmp_path: Path) -> None:
    write_stat(tmp_path, 42, "Z", 1234)
    assert not running(42, 1234, str(tmp_path))
    assert not running(43, 1234, str(tmp_path))  # no such PID
    write_stat(tmp_path, 42, "R", 5678)  # the PID now names a process that started later
    assert not running(42, 1234, str(tmp_path))
    assert running(42, 5678, str(tmp_path))
