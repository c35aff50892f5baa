"""procinfo.running: the sampling loop's cheap liveness check, by PID and start time, against a fake /proc; and its
resident memory reader, against real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from agent.process.procinfo import ResidentReader, children_of, running, start_time, thread_limit


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


def write_task(proc: Path, pid: int, uid: int, threads: int, nproc: str) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "status").write_text(f"Name:\tsvc\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nThreads:\t{threads}\n")
    (proc / str(pid) / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units     \n"
        f"Max processes             {nproc:<20} {nproc:<20} processes \n"
    )


def test_a_thread_limit_is_named_only_when_the_users_tasks_reach_it(tmp_path: Path) -> None:
    write_task(tmp_path, 10, 33, 2, "4")
    write_task(tmp_path, 11, 33, 1, "4")
    write_task(tmp_path, 12, 1000, 9, "unlimited")  # another user's tasks do not count
    assert thread_limit(10, str(tmp_path)) is None  # 3 tasks of user 33, limit 4
    write_task(tmp_path, 13, 33, 1, "4")
    why = thread_limit(10, str(tmp_path))
    assert why is not None and "Max processes 4" in why and "user 33 runs 4 tasks" in why
    assert thread_limit(12, str(tmp_path)) is None  # unlimited
    write_task(tmp_path, 14, 0, 1, "0")
    assert thread_limit(14, str(tmp_path)) is None  # root is exempt
    assert thread_limit(99, str(tmp_path)) is None  # gone


def test_an_attached_process_is_watched_through_a_pidfd_until_it_exits(tmp_path: Path) -> None:
    """attach_to's liveness check: a pidfd poll for a real process (readable from its exit on, zombie or reaped),
    the /proc read for a /proc of another root; the descriptor goes with the check."""
    import gc
    import os
    import subprocess
    import time

    from agent.process.target import _Alive

    child = subprocess.Popen(["sleep", "30"])
    try:
        alive = _Alive(child.pid, start_time(child.pid), "/proc")
        assert alive._poll is not None and alive()
        fds = len(os.listdir("/proc/self/fd"))
        child.kill()
        deadline = time.monotonic() + 5
        while alive() and time.monotonic() < deadline:  # the kill is delivered asynchronously
            time.sleep(0.001)
        assert not alive()  # a zombie: exited, not reaped yet
        child.wait()
        assert not alive()
        alive.close()  # the profile's end (TargetProcess.abandon)
        assert len(os.listdir("/proc/self/fd")) == fds - 1 and not alive()
        again = _Alive(os.getpid(), start_time(os.getpid()), "/proc")
        del again
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == fds - 1  # one never closed goes with the object
    finally:
        child.kill()
        child.wait()
    write_stat(tmp_path, 42, "S", 1234)
    other_root = _Alive(42, 1234, str(tmp_path))
    assert other_root._poll is None and other_root()
    write_stat(tmp_path, 42, "Z", 1234)
    assert not other_root()


def test_the_resident_reader_follows_its_process_and_says_none_once_it_is_gone() -> None:
    """ResidentReader against real processes: a child that touches 64 MiB reads at least that much; once it has
    exited and been reaped, its open statm says None (not another process's figure under a reused PID)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; b = bytearray(64 << 20); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
    reader = ResidentReader(child.pid)
    try:
        rss = reader.read()
        assert rss is not None and rss >= 64 << 20
        assert abs(rss - psutil.Process(child.pid).memory_info().rss) < 4 << 20
        child.kill()
        child.wait()
        assert reader.read() is None
    finally:
        reader.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert ResidentReader(child.pid).read() is None  # opened after the process is gone


def test_children_of_a_real_process_and_of_a_kernel_without_the_file(tmp_path: Path) -> None:
    """The children files of every thread of the process; None (scan /proc instead) where the kernel has none."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, threading\n"
         "kids = [subprocess.Popen(['sleep', '30']) for _ in range(2)]\n"
         "t = threading.Thread(target=lambda: kids.append(subprocess.Popen(['sleep', '30'])))\n"
         "t.start(); t.join(); print(' '.join(str(k.pid) for k in kids), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    kids: set[int] = set()
    try:
        assert parent.stdout is not None
        kids = {int(p) for p in parent.stdout.readline().split()}
        assert len(kids) == 3
        assert set(children_of(parent.pid) or ()) == kids  # the one forked by the other thread too
        assert children_of(min(kids)) == []
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
    assert children_of(parent.pid) == []  # gone
    (tmp_path / "7" / "task" / "7").mkdir(parents=True)  # a thread without a children file
    assert children_of(7, str(tmp_path)) is None
