"""The process a profile is of: a running one attached to, or a program launched held before its exec (`run`).

Either way the pipeline gets the same thing: the PID, what to call it, the allocator it uses, a way to tell
whether it still runs, and `release()`, which lets a held program exec once the probes are in place.
"""

from __future__ import annotations

import os
import select
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil

from agent.errors import TargetError
from agent.process.discovery import Allocator, allocator_of_process, allocator_of_program, read_process
from agent.process.launch import HeldChild
from agent.process.procinfo import running, start_time
from agent.process.watchdog import ReleaseWatchdog


@dataclass
class TargetProcess:
    pid: int
    name: str  # the process name (comm): short, for metric labels
    cmdline: str  # the command line, for the files' cmd: lines
    allocator: Allocator
    alive: Callable[[], bool]
    child: HeldChild | None = None  # launched (`run`): held until release()
    watchdog: ReleaseWatchdog | None = None  # launched: continues the target if heapscope dies holding it
    _released: bool = False

    @property
    def launched(self) -> bool:
        return self.child is not None

    def release(self) -> None:
        """The probes are in place: a held program may exec now."""
        if self.child is not None and not self._released:
            self._released = True
            self.child.release()

    def abandon(self) -> None:
        """The profile is over (its probes closed) or setting up failed: a held program that never ran is ended,
        one released runs on, and its watchdog is no longer needed."""
        if self.child is not None and not self._released:
            self._released = True
            self.child.abandon()
        if self.watchdog is not None:
            self.watchdog.dismiss()
            self.watchdog = None
        if isinstance(self.alive, _Alive):
            self.alive.close()


def attach_to(pid: int, proc: str = "/proc") -> TargetProcess:
    """A running process, by PID."""
    info = read_process(pid, proc)
    allocator = allocator_of_process(pid, proc, info)
    try:
        name = psutil.Process(pid).name()
    except psutil.Error as exc:
        raise TargetError(f"process {pid} went away: {exc}") from exc
    started = start_time(pid, proc)
    return TargetProcess(pid, name, " ".join(info.cmdline), allocator, _Alive(pid, started, proc))


class _Alive:
    """Whether an attached process still runs, asked at every turn of its sampling loop: a poll of a pidfd (one
    system call: readable once the process has exited) where the kernel gives one for the very process that
    started at `started`, else a read of /proc/PID/stat (procinfo.running)."""

    def __init__(self, pid: int, started: int | None, proc: str) -> None:
        self.pid, self.started, self.proc = pid, started, proc
        self._poll: select.poll | None = None
        if proc != "/proc":
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        if not running(pid, started, proc):  # the PID was taken again before the pidfd: it is not ours
            os.close(fd)
            return
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._closer = weakref.finalize(self, os.close, fd)  # at the latest with this object

    def close(self) -> None:
        """The profile is over: the descriptor goes now (asked again, /proc answers)."""
        if self._poll is not None:
            self._poll = None
            self._closer()

    def __call__(self) -> bool:
        if self._poll is None:
            return running(self.pid, self.started, self.proc)
        return not self._poll.poll(0)


def launch(argv: Sequence[str], env: dict[str, str] | None = None) -> TargetProcess:
    """A program started held before its exec: the probes arm at the exec, so nothing it allocates is missed.
    `env`: its environment (default: ours)."""
    child = HeldChild(argv, env)
    try:
        allocator = allocator_of_program(child.path, child.env)
        watchdog = ReleaseWatchdog(child.pid)
    except BaseException:
        child.abandon()
        raise
    return TargetProcess(
        child.pid,
        os.path.basename(argv[0])[:15],
        " ".join(argv),
        allocator,
        lambda: child.poll() is None,
        child=child,
        watchdog=watchdog,
    )
