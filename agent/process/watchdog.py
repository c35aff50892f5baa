"""A launched target is never left stopped, however heapscope ends.

`run` holds its target at events (its exec, loader changes, exit()): the BPF program stops it with SIGSTOP and
heapscope sends SIGCONT once it has caught up. If heapscope dies in between (SIGKILL, the OOM killer, a crash),
nobody would send that SIGCONT. So each launched target gets a watchdog: a small process forked from heapscope that
keeps only two descriptors, the read end of a pipe whose write end heapscope holds, and a pidfd of the target. The
kernel closes heapscope's end when heapscope ends in any way; from then on the watchdog continues the target
whenever it finds it stopped (a probe not yet detached may stop it again), until heapscope is gone and a grace period
more. An orderly end dismisses the watchdog first, which then sends nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

DISMISS = b"q"  # heapscope ended in order: the target was let go already
GRACE_SECONDS = 2.0  # how long after heapscope is gone the watchdog still looks (a probe in flight)
LONGEST_WATCH = 120.0  # however long heapscope takes to go


def process_state(pid: int, proc: str = "/proc") -> str:
    """The state letter of /proc/PID/stat (R, S, T, t, Z...), or "" when the process is gone."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class ReleaseWatchdog:
    """Continues `pid` if it is left stopped when this process ends. Call dismiss() at an orderly end."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        target_fd = os.pidfd_open(pid)
        owner_fd = os.pidfd_open(os.getpid())
        read_end, self._write_end = os.pipe()  # close-on-exec: no program launched later keeps it open
        try:
            self.watchdog_pid = os.fork()
        except BaseException:
            for fd in (target_fd, owner_fd, read_end, self._write_end):
                os.close(fd)
            raise
        if self.watchdog_pid == 0:  # the watchdog: never returns
            _watch(read_end, target_fd, owner_fd, pid)
        for fd in (target_fd, owner_fd, read_end):
            os.close(fd)

    def dismiss(self) -> None:
        """heapscope has let the target go and detached its probes: the watchdog ends without a signal."""
        if self._write_end < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._write_end, DISMISS)
        os.close(self._write_end)
        self._write_end = -1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.watchdog_pid, 0)


def _watch(read_end: int, target_fd: int, owner_fd: int, pid: int) -> None:
    """The watchdog's whole life, in the forked child: only system calls, then _exit."""
    status = 0
    try:
        # Its own session: a Ctrl-C or a signal to heapscope's process group does not end it first.
        os.setsid()
        keep = sorted((read_end, target_fd, owner_fd))
        # Every other descriptor goes: copies of BPF links would keep the probes alive, and a copy of the held
        # child's go pipe would keep it from seeing heapscope's end.
        start = 0
        for fd in keep:
            os.closerange(start, fd)
            start = fd + 1
        os.closerange(start, os.sysconf("SC_OPEN_MAX"))
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_IGN)
        while True:
            try:
                word = os.read(read_end, 1)
                break
            except InterruptedError:
                continue
        if word == DISMISS:
            os._exit(0)
        # heapscope is ending: its descriptors are being closed, and a probe still attached may stop the target
        # once more. Continue it whenever it is found stopped, until heapscope is gone and a grace period more.
        started = time.monotonic()
        owner_gone = 0.0
        while time.monotonic() < started + LONGEST_WATCH:
            now = time.monotonic()
            if not owner_gone and select.select([owner_fd], [], [], 0)[0]:
                owner_gone = now
            if owner_gone and now > owner_gone + GRACE_SECONDS:
                break
            state = process_state(pid)
            if state in ("", "Z", "X"):
                break
            if state == "T":  # stopped by a signal (a ptrace stop, "t", is a debugger's to end)
                signal.pidfd_send_signal(target_fd, signal.SIGCONT)
            time.sleep(0.01)
    except BaseException:
        status = 1
    os._exit(status)
