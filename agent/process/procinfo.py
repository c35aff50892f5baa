"""The facts selectors look at, read from /proc: name, command line, cgroup, parent and start time. Each read is
a few small files; a process that went away in between reads as None, never as an error. And this process's own
memory: its RSS, malloc's free memory given back, its malloc arenas limited."""

from __future__ import annotations

import contextlib
import ctypes
import os
import weakref
from collections.abc import Iterator

from agent.model.cgroup import parse_proc_cgroup
from agent.model.selector import ProcessFacts


def _stat_fields(pid: int, proc: str) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): field 3 onwards."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    _, sep, rest = text.rpartition(")")
    return rest.split() if sep else None


def start_time(pid: int, proc: str = "/proc") -> int | None:
    """Clock ticks after boot at which the process started: with the PID, its identity."""
    fields = _stat_fields(pid, proc)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19])


def running(pid: int, started: int | None, proc: str = "/proc") -> bool:
    """The process that started at `started` (start_time) still runs: not gone, not a zombie, and its PID not
    reused. One small read, where psutil's is_running builds a whole Process (a sampling loop asks at every turn)."""
    fields = _stat_fields(pid, proc)
    if fields is None or len(fields) < 20:
        return False
    return fields[0] not in ("Z", "X", "x") and (started is None or int(fields[19]) == started)


def read_facts(pid: int, proc: str = "/proc", cmdline: bool = True, cgroup: bool = True) -> ProcessFacts | None:
    """What selectors need of `pid` (the command line and the cgroup only when asked); None if it is gone."""
    fields = _stat_fields(pid, proc)
    if fields is None or len(fields) < 20:
        return None
    try:
        with open(f"{proc}/{pid}/comm", "rb") as f:
            comm = f.read().decode(errors="replace").rstrip("\n")
        args = ""
        if cmdline:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                args = " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
        else:  # kernel threads have none; selectors skip them: say whether there is one
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                args = comm if f.read(1) else ""
        path = ""
        if cgroup:
            with open(f"{proc}/{pid}/cgroup") as f:
                path = parse_proc_cgroup(f.read())
    except OSError:
        return None
    return ProcessFacts(pid=pid, ppid=int(fields[1]), start_time=int(fields[19]), comm=comm, cmdline=args, cgroup=path)


def cgroup_of(pid: int, proc: str = "/proc") -> str:
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            return parse_proc_cgroup(f.read())
    except OSError:
        return ""


def process_ids(proc: str = "/proc") -> Iterator[int]:
    """Every process (thread group) now, in PID order."""
    try:
        names = os.listdir(proc)
    except OSError:
        return
    yield from sorted(int(n) for n in names if n.isdigit())


def children_of(pid: int, proc: str = "/proc") -> list[int] | None:
    """The processes `pid` has forked that run now, from each of its threads' children file: a few reads, where
    a scan of /proc reads every process's. None where the kernel keeps no such file (CONFIG_PROC_CHILDREN)."""
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return []  # gone: no children to find
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if os.path.isdir(f"{proc}/{pid}/task/{tid}"):
                return None  # the thread is there, the file is not
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


def is_thread_group_leader(pid: int, proc: str = "/proc") -> bool:
    """Whether `pid` is a process rather than a thread of one (threads are reachable as /proc/TID too)."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1]) == pid
    except OSError:
        return False
    return False


def status_fields(pid: int, proc: str = "/proc") -> dict[str, str]:
    """/proc/PID/status by field name (values as written, after the tab); OSError where it cannot be read."""
    with open(f"{proc}/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _status_or_none(pid: int, proc: str) -> dict[str, str]:
    try:
        return status_fields(pid, proc)
    except OSError:  # gone meanwhile
        return {}


def thread_limit(pid: int, proc: str = "/proc") -> str | None:
    """Why `pid` can start no thread, if its RLIMIT_NPROC says so (a server that drops to a user of its own and sets
    it, as haproxy's workers do), else None. The kernel counts every task of the process's real user against that
    limit, and exempts root."""
    uid = _status_or_none(pid, proc).get("Uid", "").split()[:1]
    try:
        with open(f"{proc}/{pid}/limits") as f:
            soft = next((line.split()[2] for line in f if line.startswith("Max processes")), "unlimited")
    except OSError:
        return None
    if not uid or uid[0] == "0" or not soft.isdigit():
        return None
    tasks = 0
    for other in process_ids(proc):
        status = _status_or_none(other, proc)
        if status.get("Uid", "").split()[:1] == uid:
            tasks += int(status.get("Threads", "1"))
    if tasks < int(soft):
        return None
    return (f"its limit on processes (RLIMIT_NPROC, Max processes {soft}) lets it start no thread: user {uid[0]} "
            f"runs {tasks} tasks already")


def resident_bytes(pid: int | None = None, proc: str = "/proc") -> int:
    """Resident memory of a process (by default this one)."""
    target = "self" if pid is None else str(pid)
    try:
        with open(f"{proc}/{target}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


class ResidentReader:
    """A target's resident memory, read again and again (the memory line, every tick): its statm file opened once
    and read with pread, a tenth of psutil's open, read and parse. The open file stays the process's it was opened
    for: once that one is gone, reads say None, never another process's figure under a reused PID."""

    def __init__(self, pid: int, proc: str = "/proc") -> None:
        try:
            self._fd: int | None = os.open(f"{proc}/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None
        else:  # closed with the reader if nobody closes it first
            self._closer = weakref.finalize(self, os.close, self._fd)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def read(self) -> int | None:
        """Bytes resident now; None if the process is gone."""
        sizes = self.sizes()
        return sizes[0] if sizes is not None else None

    def sizes(self) -> tuple[int, int] | None:
        """(bytes resident, bytes mapped) now; None if the process is gone."""
        fd = self._fd
        if fd is None:
            return None
        try:
            size, resident = os.pread(fd, 128, 0).split()[:2]
            return int(resident) * self._page, int(size) * self._page
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            self._fd = None
            self._closer()


def release_free_memory() -> None:
    """Give the memory malloc holds free back to the system (glibc's malloc_trim): a profile's tables are large, and
    each target's thread has its own malloc arena, which keeps what it freed otherwise."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


MALLOC_ARENAS = 2  # a daemon's C heap: arenas its threads share (mallopt M_ARENA_MAX)
_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """Let a daemon's threads share a few malloc arenas instead of one each (glibc's default is up to 8 a CPU).
    Each target's thread compiles its program, and clang's tens of MB, freed, leave a fragmented arena that
    malloc_trim cannot give back whole: with an arena per target thread that stayed with each target (~4 MiB of
    RSS a target on this VM), with shared arenas the next compile reuses it. Call before the threads start;
    the threads hold the GIL for most of their work, so sharing costs them little."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas)
