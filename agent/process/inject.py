"""Bringing the sampler library into a running process: ptrace, then a call of the target's own dlopen.

Own code over ctypes rather than pyinjector (kubo/injector): the safety rules below need control of which
thread runs the call and when, which that library does not give (it calls dlopen from whichever thread it
attached, and its README warns that a thread stopped inside malloc deadlocks the process).

How a call is made safe:
- One thread at a time is seized (PTRACE_SEIZE + PTRACE_INTERRUPT); the others run on, so any lock they hold
  is released as usual. The seized thread is used only at a safe point: its instruction pointer and every
  return address of its call chain lie outside the allocator (malloc and its internal functions, the whole
  allocator library when it is not libc, C++ operators new/delete), the loader (ld.so, libc's dl* functions)
  and fork; a signal handler's frame is followed into the code the signal interrupted, which must be outside
  them too. The chain is unwound with the objects' CFI
  (agent.process.safepoint); above a frame that cannot be unwound, every word of the stack is checked
  instead, which can only make a thread look unsafe, never safe. An unsafe thread is released and another
  one, or the same one a little later, is tried; when none is found in time, the refusal says where each
  thread was (NoSafePoint), and the daemon tries again later.
- The call goes through a small stub (probes/sampler/inject_stub.S) that heapscope writes into a fresh
  mapping of the target (the mmap and mprotect for it are single system calls, single-stepped on a `syscall`
  instruction of libc). heapscope fills the stub's data with the thread's own registers, the general ones
  and the whole XSAVE area (x87, SSE, AVX, AVX-512, AMX), points the thread at the stub with a stack below its
  red zone, and lets it go (PTRACE_DETACH) before the call runs. The stub blocks signals, makes the call,
  puts the signal mask back, restores every register itself and jumps back. So if heapscope dies during
  the call, even by SIGKILL, the thread still resumes exactly where it was; heapscope only reads a `done`
  word to learn the result.
- A system call the stop interrupted is set to run again: rax = its number and rip on its `syscall`
  instruction, as the kernel does for the ERESTART* codes when no handler runs (the stub resumes the thread
  in user space, where the kernel's restart no longer applies), and also for the calls that Linux fails
  with EINTR after a mere stop (epoll_wait, semop, ...). No EINTR reaches the program. Signals that
  arrive while the thread is seized are sent again after it is released.
- The library is loaded RTLD_NOW | RTLD_NODELETE and never dlclosed: a second attach finds it mapped and
  injects nothing.

Refused, with one line and an exit code: ptrace forbidden (yama ptrace_scope 3, or already traced), a
target under seccomp (its filter may kill the process on a system call dlopen or the sampler makes), a
process without glibc's dlopen (static, musl), an allocator linked into the executable (its calls do not go
through the GOT). A sampler library the target cannot see through its own root (containers) is handed over in a
memfd, or, with no /proc there either (a bare chroot), by its folder (agent.process.handover).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import functools
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from elftools.elf.elffile import ELFFile

from agent.errors import EnvironmentProblem, NoSafePoint, SamplingRefused, TargetError
from agent.model.maps import MapsEntry
from agent.process import handover
from agent.process.discovery import allocator_of_process, is_libc_name
from agent.process.procinfo import status_fields
from agent.process.recent import RecentAnswers
from agent.process.safepoint import RuleLookup, UnsafeRanges, Verdict, examine
from agent.process.sampler import (
    KEPT_SINGLE_SYMBOL,
    build_sampler,
    build_stub,
    libc_of_process,
    mapped_base,
    read_map_lines,
    symbol_value,
)
from agent.process.view import ProcessView
from agent.symbols.debugfiles import DEFAULT_DEBUG_ROOTS, find_debug_file
from agent.symbols.elf import ElfObject, file_identity, open_elf
from agent.symbols.unwind import Rule, UnwindTable, load_table, lookup

T = TypeVar("T")

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_GETSIGINFO = 0x4202
PTRACE_SETSIGINFO = 0x4203
PTRACE_GETREGSET = 0x4204
PTRACE_SETREGSET = 0x4205
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_EVENT_STOP = 128
NT_X86_XSTATE = 0x202
WALL = 0x40000000
RTLD_NOW = 0x2
RTLD_NODELETE = 0x1000

# struct user_regs_struct (x86_64), 27 words.
REG_NAMES = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
    "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs",
)  # fmt: skip
REG = {name: i for i, name in enumerate(REG_NAMES)}
RED_ZONE = 128
WAIT_SPIN = 0.002  # seconds a stop is polled for without sleeping (_Thread._wait)
XSTATE_MAX = 16384
SIGINFO_SIZE = 128
EFLAGS_TF, EFLAGS_DF = 0x100, 0x400

# Functions a thread must not be inside when it runs the call: exact names and name prefixes.
UNSAFE_NAMES = frozenset(
    {
        "malloc", "free", "calloc", "realloc", "reallocarray", "memalign", "aligned_alloc", "posix_memalign",
        "valloc", "pvalloc", "cfree", "malloc_trim", "malloc_usable_size", "mallinfo", "mallinfo2",
        "malloc_stats", "malloc_info", "mallopt", "fork", "_Fork", "vfork", "dlopen", "dlclose", "dlsym",
        "dlvsym", "dladdr", "dladdr1", "dlinfo", "dlmopen", "dlerror", "dl_iterate_phdr",
        "pthread_create", "exit", "_exit",
    }
)  # fmt: skip
UNSAFE_PREFIXES = (
    "_int_", "sysmalloc", "malloc_", "arena_", "tcache", "__malloc", "__libc_malloc", "__libc_free",
    "__libc_calloc", "__libc_realloc", "__libc_memalign", "_dl_", "__libc_dl", "_Znw", "_Zna", "_Zdl", "_Zda",
    "__libc_fork", "__run_fork_handlers", "__pthread_create", "__nptl_", "__free_stacks", "__pthread_exit",
    "pthread_exit", "__libc_thread_freeres",
)  # fmt: skip

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


def _ptrace(request: int, tid: int, addr: int = 0, data: int | ctypes.Array | ctypes.Structure | None = None) -> int:
    if isinstance(data, ctypes.Array | ctypes.Structure):
        data_arg: int | None = ctypes.addressof(data)
    else:
        data_arg = data
    ctypes.set_errno(0)
    r = _libc.ptrace(request, tid, addr, data_arg)
    err = ctypes.get_errno()
    if r == -1 and err:
        raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")
    return int(r)


@dataclass
class Injection:
    """What an injection did."""

    pid: int
    library: Path
    reused: bool  # the library was already loaded: nothing injected
    tid: int = 0  # the thread that ran dlopen
    seconds: float = 0.0
    threads_tried: int = 0  # seize attempts that found a thread not at a safe point
    deferred_signals: list[int] = field(default_factory=list)
    # The process had one thread: the sampler's control thread makes its libc (glibc, musl) leave the single-threaded
    # fast paths (malloc takes its locks) for the rest of the process's life, loaded or not. Measured on
    # bench/churn.c: about +0.05 µs per malloc+free pair. Callers should say so.
    was_single_threaded: bool = False
    memfd: bool = False  # handed over in a memfd (the process could not see the library's path)
    folder: bool = False  # loaded from its folder, handed over (no /proc in the process's root either)

    @property
    def warnings(self) -> list[str]:
        if not self.was_single_threaded:
            return []
        return [
            f"process {self.pid} was single-threaded: the sampler's control thread (or its try at one) makes its "
            "libc's malloc take its locks from now on (a few tens of ns per call), also after detaching"
        ]


# ---- the stub -----------------------------------------------------------------------------------------

SYS_MMAP, SYS_MPROTECT, SYS_MUNMAP, SYS_RESTART = 9, 10, 11, 219
PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE, MAP_STACK = 0x02, 0x20, 0x4000, 0x20000
# Kernel-internal return values of an interrupted system call (include/linux/errno.h).
ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK = 512, 513, 514, 516
PTRACE_SINGLESTEP = 9


@dataclass(frozen=True)
class Stub:
    """probes/sampler/inject_stub.S assembled: the blob and the offsets of its labels."""

    blob: bytes
    labels: dict[str, int]

    @property
    def code_size(self) -> int:
        return self.labels["data_start"]

    @property
    def extra(self) -> int:
        """Where a call's string goes: after the last slot, in the data page."""
        return self.labels["saved_rip"] + 8

    @property
    def xsave(self) -> int:
        return self.labels["xsave_area"]

    @property
    def xsave_room(self) -> int:
        return self.labels["blob_end"] - self.labels["xsave_area"]


def load_stub(obj: Path) -> Stub:
    with open(obj, "rb") as f:
        elf = ELFFile(f)
        text = elf.get_section_by_name(".text")
        symtab = elf.get_section_by_name(".symtab")
        if text is None or symtab is None or elf.get_section_by_name(".rela.text") is not None:
            raise EnvironmentProblem(f"{obj} is not a self-contained injection stub")
        labels = {sym.name: sym["st_value"] for sym in symtab.iter_symbols() if sym.name}  # type: ignore[attr-defined]
        return Stub(text.data(), labels)


def _resume_context(saved: list[int]) -> list[int]:
    """The registers the thread resumes with: its own, except that a system call our stop interrupted is set
    to run again, as the kernel does when no handler runs (the stub resumes it in user space, where the
    kernel's restart logic no longer applies)."""
    regs = list(saved)
    nr = regs[REG["orig_rax"]]
    rax = regs[REG["rax"]] - (1 << 64) if regs[REG["rax"]] >= 1 << 63 else regs[REG["rax"]]
    if nr < 1 << 63:
        if rax in (-ERESTARTSYS, -ERESTARTNOINTR, -ERESTARTNOHAND):
            regs[REG["rax"]] = nr
            regs[REG["rip"]] -= 2
        elif rax == -ERESTART_RESTARTBLOCK:
            regs[REG["rax"]] = SYS_RESTART
            regs[REG["rip"]] -= 2
    return regs


# ---- refusals ------------------------------------------------------------------------------------------


def _status_fields(pid: int) -> dict[str, str]:
    try:
        return status_fields(pid)
    except FileNotFoundError as exc:
        raise TargetError(f"no process with PID {pid}") from exc


def _libc_mapping(maps: Iterable[MapsEntry]) -> MapsEntry | None:
    for m in maps:
        if m.offset == 0 and is_libc_name(os.path.basename(m.path)):
            return m
    return None


def _seen_as(pid: int, path: str, proc_root: str) -> str:
    """Where we open a file the process's maps name `path`: through its own root (a chroot's prefix off)."""
    return ProcessView.of(pid, proc_root).through(path)


def preflight_ptrace(pid: int) -> dict[str, str]:
    """Refuse where ptrace itself is not allowed or not safe."""
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    if yama.exists() and yama.read_text().strip() == "3":
        raise EnvironmentProblem("ptrace is disabled on this machine (kernel.yama.ptrace_scope=3); use --mode=exact")
    status = _status_fields(pid)
    if status.get("TracerPid", "0").strip() != "0":
        raise SamplingRefused(f"process {pid} is already traced by PID {status['TracerPid'].strip()}; use --mode=exact")
    seccomp = status.get("Seccomp", "0").strip()
    if seccomp != "0":
        raise SamplingRefused(
            f"process {pid} runs under seccomp (mode {seccomp}): its filter could kill it on a system call the "
            "sampler makes; use --mode=exact"
        )
    if status.get("State", "").startswith(("T", "t")):
        raise SamplingRefused(f"process {pid} is stopped; resume it or use --mode=exact")
    return status


def sees_library(pid: int, library: Path, proc_root: str = "/proc") -> bool:
    """Whether the process finds `library` at its path through its own root (not in a container or chroot that
    hides it): then it is dlopen'ed by that path, else handed over in a memfd."""
    try:
        inside = os.stat(f"{proc_root}/{pid}/root{library}")
    except OSError:
        return False
    ours = os.stat(library)
    return (inside.st_dev, inside.st_ino) == (ours.st_dev, ours.st_ino)


def needs_folder(pid: int, library: Path, proc_root: str = "/proc") -> bool:
    """Whether the process gets the library by its folder, handed over (agent.process.handover): it cannot see it
    through its own root, and has no /proc there for a memfd (a bare chroot)."""
    return not sees_library(pid, library, proc_root) and not os.path.lexists(f"{proc_root}/{pid}/root/proc/self")


def preflight(pid: int, library: Path, proc_root: str = "/proc") -> None:
    """Refuse, with one line, where injecting cannot be made safe."""
    preflight_ptrace(pid)
    by_folder = needs_folder(pid, library, proc_root)
    if by_folder and not handover.same_network_namespace(pid, proc_root):
        raise SamplingRefused(
            f"process {pid} cannot see the sampler library through its own root, has no /proc there to be handed "
            "it through a memfd, and is in another network namespace, where heapscope cannot hand it the library's "
            "folder; use --mode=exact"
        )
    maps = read_map_lines(pid)
    libc = _libc_mapping(maps)
    libc_elf = open_elf(_seen_as(pid, libc.path, proc_root)) if libc else None
    if libc_elf is None or _dlopen_of(libc_elf) is None:
        raise SamplingRefused(
            f"process {pid} has no libc with a dlopen (a static program, or a libc that is neither glibc nor musl); "
            "use --mode=exact"
        )
    glibc = libc_elf.find_symbol("gnu_get_libc_version") is not None
    if by_folder and glibc and libc_elf.find_symbol("pthread_create") is None:
        raise SamplingRefused(
            f"process {pid} cannot see the sampler library through its own root and has no /proc there: it is "
            "handed the library's folder, but its glibc (before 2.34) would need libdl and libpthread loaded from "
            "inside its root; use --mode=exact"
        )
    allocator = allocator_of_process(pid, proc_root)
    if file_identity(allocator.path) == file_identity(f"{proc_root}/{pid}/exe"):
        raise SamplingRefused(
            f"process {pid}'s allocator ({allocator.family}) is linked into its executable: its calls do not go "
            "through the GOT and cannot be sampled; use --mode=exact"
        )


def _dlopen_of(libc: ElfObject) -> str | None:
    """The name of the target libc's dlopen: dlopen (glibc 2.34+, where libdl went into libc), else
    __libc_dlopen_mode (older glibc's own, which a program that does not link libdl has too)."""
    for name in ("dlopen", "__libc_dlopen_mode"):
        if libc.find_symbol(name) is not None:
            return name
    return None


def preflight_sampled(pid: int, proc_root: str = "/proc") -> None:
    """Sampled mode's refusals for process `pid`, before anything is changed: those of inject(), with the
    library it would inject (nothing to check when that library is loaded already: it is reused)."""
    library = Path(os.path.realpath(build_sampler(libc=libc_of_process(pid))))
    if mapped_base(pid, library) is None:
        preflight(pid, library, proc_root)


# ---- the unsafe ranges ---------------------------------------------------------------------------------


def _is_unsafe_name(name: str) -> bool:
    bare = name.split("@", 1)[0]
    return bare in UNSAFE_NAMES or bare.startswith(UNSAFE_PREFIXES)


def _symbol_ranges(obj: ElfObject, debug: ElfObject | None) -> list[tuple[int, int, str]]:
    def read() -> list[tuple[int, int, str]]:
        ranges = []
        for source in (obj, debug) if debug is not None else (obj,):
            for sym in source.function_symbols():
                if sym.size and _is_unsafe_name(sym.name):
                    ranges.append((sym.value, sym.value + sym.size, sym.name))
        return ranges

    # Kept with the file's symbols (shared by every process of it): libc's are some 3,000 names to match.
    with_debug = "no debug file" if debug is None else debug.build_id or file_identity(debug.path)
    return obj.memoized(f"unsafe ranges, {with_debug}", read)


# The unsafe ranges of processes looked at lately, by their code's mappings (a millisecond of each attach, its
# objects' symbols matched again).
_recent_ranges: RecentAnswers[UnsafeRanges] = RecentAnswers()


def unsafe_ranges(pid: int, proc_root: str = "/proc", allocator: str | None = None) -> UnsafeRanges:
    """Address ranges of the target where a thread must not be (or return to) when it runs the call. `allocator`:
    the object that defines the process's malloc, when the caller found it already (found again otherwise)."""
    maps = read_map_lines(pid)
    allocator_file = file_identity(allocator or allocator_of_process(pid, proc_root).path)
    view = ProcessView.of(pid, proc_root)  # read once: every mapped object goes through it
    by_path: dict[str, list[MapsEntry]] = {}
    for m in maps:
        if m.path.startswith("/"):
            by_path.setdefault(m.path, []).append(m)
    # The same root and code mappings (files by device and inode, where they are): the same ranges.
    key = (view.root, view.namespace, allocator_file,
           tuple(m for lines in by_path.values() if any("x" in m.perms for m in lines) for m in lines))  # fmt: skip
    ranges = _recent_ranges.get(key)
    if ranges is None:
        ranges = _unsafe_ranges(view, by_path, allocator_file)
        _recent_ranges.put(key, ranges)
    return ranges


def _unsafe_ranges(view: ProcessView, by_path: dict[str, list[MapsEntry]], allocator_file: object) -> UnsafeRanges:
    """unsafe_ranges of the objects mapped at `by_path` (the mappings of each, by its path in the maps)."""
    out: list[tuple[int, int, str]] = []
    for path, lines in by_path.items():
        base = min(m.start for m in lines if m.offset == 0) if any(m.offset == 0 for m in lines) else None
        execs = [m for m in lines if "x" in m.perms]
        if not execs or base is None:
            continue
        name = os.path.basename(path)
        seen_as = view.through(path)
        if name.startswith("ld-linux"):
            out.extend((m.start, m.end, f"the loader ({name})") for m in execs)
            continue
        is_allocator = file_identity(seen_as) == allocator_file
        if is_allocator and not is_libc_name(name):
            out.extend((m.start, m.end, f"the allocator ({name})") for m in execs)  # jemalloc, tcmalloc: all
            continue
        if not (is_libc_name(name) or name.startswith(("libstdc++", "libc++"))
                or is_allocator):
            continue
        try:
            obj = open_elf(seen_as)
        except Exception:  # unreadable object: all of its code counts as unsafe
            out.extend((m.start, m.end, f"{name} (unreadable)") for m in execs)
            continue
        debug = find_debug_file(obj, DEFAULT_DEBUG_ROOTS)
        bias = base if obj.is_pie_or_shared else 0
        out.extend((lo + bias, hi + bias, fn) for lo, hi, fn in _symbol_ranges(obj, debug))
    return UnsafeRanges(out)


class _FrameRules:
    """The unwind row for any address of the target: its mapping's object, through the on-disk table cache
    (the tables the kernel's walker uses). Tables are read on demand: only objects on the threads' chains."""

    def __init__(self, pid: int, maps: list[MapsEntry], proc_root: str) -> None:
        self.maps = sorted((m for m in maps if "x" in m.perms and m.path.startswith("/")), key=lambda m: m.start)
        self._starts = [m.start for m in self.maps]
        self._objects: dict[str, tuple[UnwindTable, ElfObject] | None] = {}
        self._view = ProcessView.of(pid, proc_root)

    def __call__(self, address: int) -> Rule | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0 or address >= self.maps[i].end:
            return None  # the vDSO, anonymous (JIT) code, or no mapping at all
        m = self.maps[i]
        loaded = self._object(m.path)
        if loaded is None:
            return None
        table, obj = loaded
        vaddr = obj.file_offset_to_vaddr(m.offset)
        return None if vaddr is None else lookup(table, address - (m.start - vaddr))

    def _object(self, path: str) -> tuple[UnwindTable, ElfObject] | None:
        if path not in self._objects:
            seen_as = self._view.through(path)
            try:
                self._objects[path] = (load_table(seen_as), open_elf(seen_as))
            except Exception:  # no table to be had: the walk falls back to the scan from that frame
                self._objects[path] = None
        return self._objects[path]


# ---- one seized thread ---------------------------------------------------------------------------------


class _Thread:
    def __init__(self, pid: int, tid: int, mem_fd: int) -> None:
        self.pid = pid
        self.tid = tid
        self.mem = mem_fd
        self.deferred: list[tuple[int, bytes]] = []  # (signal, siginfo) that arrived while seized
        self.seized = False
        self.restarted_eintr = False  # a system call our stop made fail with EINTR was set to start again

    def seize(self) -> bool:
        """Seize and stop the thread; False if it went away."""
        try:
            _ptrace(PTRACE_SEIZE, self.tid, 0, 0)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                return False
            if exc.errno == errno.EPERM:
                raise TargetError(f"ptrace of process {self.pid} is not permitted: {exc.strerror}") from exc
            raise
        self.seized = True
        _ptrace(PTRACE_INTERRUPT, self.tid, 0, 0)
        while True:
            status = self._wait(5.0)
            if status is None:
                raise TargetError(f"thread {self.tid} of process {self.pid} did not stop within 5 s")
            if (status >> 16) == PTRACE_EVENT_STOP:
                self._undo_stop_eintr()
                return True
            if os.WIFSTOPPED(status):  # a signal on its way in: hold it, deliver it at the end
                self._defer(os.WSTOPSIG(status))
                _ptrace(PTRACE_CONT, self.tid, 0, 0)

    def _undo_stop_eintr(self) -> None:
        """Some blocking calls fail with EINTR when their thread is merely stopped, with no handler run
        (epoll_wait, semop, sigtimedwait, sockets with SO_RCVTIMEO: signal(7), "Interruption ... by stop
        signals"). A thread we stopped in one of them is set back onto its `syscall` instruction with the
        call number in rax, so the call starts again when the thread resumes, as the kernel does for the
        ERESTART* codes. Not when a signal is pending for it: then the EINTR may be that signal's."""
        regs = self.regs()
        if regs[REG["rax"]] != (-errno.EINTR) & 0xFFFFFFFFFFFFFFFF:
            return
        nr = regs[REG["orig_rax"]]
        if nr >= 1 << 63 or self._signal_pending():
            return
        rip = regs[REG["rip"]]
        if self.read(rip - 2, 2) != b"\x0f\x05":  # `syscall`
            return
        regs[REG["rax"]] = nr
        regs[REG["rip"]] = rip - 2
        self.set_regs(regs)
        self.restarted_eintr = True

    def _signal_pending(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/task/{self.tid}/status") as f:
                fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except FileNotFoundError:
            return True
        pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
        return bool(pending & ~int(fields.get("SigBlk", "0"), 16))

    def _defer(self, sig: int) -> None:
        info = (ctypes.c_ubyte * SIGINFO_SIZE)()
        _ptrace(PTRACE_GETSIGINFO, self.tid, 0, info)
        self.deferred.append((sig, bytes(info)))

    def _wait(self, timeout: float) -> int | None:
        # The thread is held stopped until its stop is seen here: a stop that comes at once (an interrupt, a single
        # step over a system call) is polled for without sleeping for the first WAIT_SPIN seconds. Sleeping from
        # the start, each of an injection's stops lasted some 0.6 ms more, and a database's backend held a lock
        # all its clients waited for (bench/target_stops.py measures the stops).
        now = time.monotonic()
        deadline, spin_until = now + timeout, now + WAIT_SPIN
        while True:
            try:
                got, status = os.waitpid(self.tid, WALL | os.WNOHANG)
            except ChildProcessError as exc:
                raise TargetError(f"thread {self.tid} of process {self.pid} went away") from exc
            if got == self.tid:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    self.seized = False
                    raise TargetError(f"process {self.pid} exited during the injection")
                return status
            now = time.monotonic()
            if now > deadline:
                return None
            if now < spin_until:
                os.sched_yield()  # the other core's thread may be the one about to stop
            else:
                time.sleep(0.0005)

    def regs(self) -> list[int]:
        buf = (ctypes.c_ulonglong * len(REG_NAMES))()
        _ptrace(PTRACE_GETREGS, self.tid, 0, buf)
        return list(buf)

    def set_regs(self, values: list[int]) -> None:
        buf = (ctypes.c_ulonglong * len(REG_NAMES))(*[v & 0xFFFFFFFFFFFFFFFF for v in values])
        _ptrace(PTRACE_SETREGS, self.tid, 0, buf)

    def xstate(self) -> bytes:
        buf = (ctypes.c_ubyte * XSTATE_MAX)()
        iov = _Iovec(ctypes.addressof(buf), XSTATE_MAX)
        _ptrace(PTRACE_GETREGSET, self.tid, NT_X86_XSTATE, iov)
        return bytes(buf[: iov.len])

    def set_xstate(self, data: bytes) -> None:
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        iov = _Iovec(ctypes.addressof(buf), len(data))
        _ptrace(PTRACE_SETREGSET, self.tid, NT_X86_XSTATE, iov)

    def read(self, address: int, n: int) -> bytes:
        return os.pread(self.mem, n, address)

    def write(self, address: int, data: bytes) -> None:
        if os.pwrite(self.mem, data, address) != len(data):
            raise TargetError(f"short write into process {self.pid}")

    def _syscall(self, at: int, base: list[int], nr: int, *args: int) -> int:
        """Run one system call on this thread by single-stepping a `syscall` instruction at `at`."""
        regs = list(base)
        regs[REG["rip"]] = at
        regs[REG["rax"]] = nr
        regs[REG["orig_rax"]] = -1
        regs[REG["eflags"]] &= ~(EFLAGS_TF | EFLAGS_DF)
        for reg, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
            regs[REG[reg]] = value
        self.set_regs(regs)
        while True:
            _ptrace(PTRACE_SINGLESTEP, self.tid, 0, 0)
            status = self._wait(5.0)
            if status is None:
                raise TargetError(f"a system call in thread {self.tid} of process {self.pid} did not return")
            if os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGTRAP and (status >> 16) == 0:
                now = self.regs()
                if now[REG["rip"]] == at + 2:
                    return now[REG["rax"]]
                raise TargetError(f"thread {self.tid} of process {self.pid} stepped somewhere unexpected")
            if os.WIFSTOPPED(status) and (status >> 16) == 0:
                self._defer(os.WSTOPSIG(status))  # delivered after the thread is released

    def _map(self, syscall_at: int, saved: list[int], size: int, flags: int) -> int:
        """An anonymous read-write mapping of `size` bytes made by this thread's mmap (extra `flags`)."""
        addr = self._syscall(syscall_at, saved, SYS_MMAP, 0, size, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | flags, (1 << 64) - 1, 0)
        if addr >= (1 << 64) - 4095:
            raise TargetError(f"process {self.pid}: mmap for the injection failed: {os.strerror((1 << 64) - addr)}")
        return addr

    def run_detached(self, stub: Stub, syscall_at: int, function: int, arg0: int, arg1: int, error_function: int,
                     extra: bytes = b"", thread: CallThread | None = None,
                     keep_single: tuple[int, int] = (0, 0)) -> Callable[[], tuple[int, int]]:
        """Start function(arg0, arg1) on this thread through the stub, then let the thread go: the stub puts
        every register back and resumes the thread where it was, whether or not heapscope is still there.
        `extra` is copied into the stub's data and its address replaces an argument equal to -1. With `thread`,
        the call runs on a new thread, on a stack mapped here, while this one waits for it. Returns a
        function that waits for the call to finish and gives (result, error message address); it raises
        NoCallThread where the new thread could not be made. `keep_single`: _keep_single's."""
        saved = self.regs()
        saved_x = self.xstate()
        if len(saved_x) > stub.xsave_room:
            raise TargetError(f"thread {self.tid}: its XSAVE area ({len(saved_x)} bytes) does not fit the stub")
        context = _resume_context(saved)
        try:
            page = self._map(syscall_at, saved, len(stub.blob), 0)
            # The call thread's stack: the stub unmaps it after the join.
            stack = self._map(syscall_at, saved, CALL_THREAD_STACK, MAP_NORESERVE | MAP_STACK) if thread else 0
            data = bytearray(stub.blob)
            extra_at = page + stub.extra
            words = {
                "function": function,
                "arg0": extra_at if arg0 == -1 else arg0,
                "arg1": extra_at if arg1 == -1 else arg1,
                "error_function": error_function,
                "thread_create": thread.create if thread else 0,
                "thread_join": thread.join if thread else 0,
                "thread_attr_init": thread.attr_init if thread else 0,
                "thread_attr_setstack": thread.attr_setstack if thread else 0,
                "thread_stack": stack,
                "thread_stack_size": CALL_THREAD_STACK if thread else 0,
                "single_flag": keep_single[0] if thread else 0,
                "single_mark": keep_single[1],
                "saved_rflags": context[REG["eflags"]],
                "saved_rip": context[REG["rip"]],
            }
            for reg in ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12",
                        "r13", "r14", "r15"):
                words[f"saved_{reg}"] = context[REG[reg]]
            for name, value in words.items():
                struct.pack_into("<Q", data, stub.labels[name], value & 0xFFFFFFFFFFFFFFFF)
            data[stub.extra : stub.extra + len(extra)] = extra
            data[stub.xsave : stub.xsave + len(saved_x)] = saved_x
            self.write(page, bytes(data))
            r = self._syscall(syscall_at, saved, SYS_MPROTECT, page, stub.code_size, PROT_READ | PROT_EXEC)
            if r != 0:
                raise TargetError(f"process {self.pid}: mprotect for the injection failed")
        except BaseException:
            self.set_xstate(saved_x)
            self.set_regs(saved)
            raise
        regs = list(saved)
        regs[REG["rip"]] = page + stub.labels["stub_entry"]
        regs[REG["rsp"]] = (saved[REG["rsp"]] - RED_ZONE - 512) & ~0xF
        regs[REG["orig_rax"]] = -1  # no system call restart on the way into the stub
        regs[REG["eflags"]] &= ~(EFLAGS_TF | EFLAGS_DF)
        self.set_regs(regs)
        self.release()  # from here the thread needs nobody
        done_at = page + stub.labels["done"]
        pid = self.pid

        def wait(timeout: float = 30.0) -> tuple[int, int]:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    done = struct.unpack("<Q", read_memory(pid, done_at, 8))[0]
                    if done:
                        result, error = struct.unpack("<QQ", read_memory(pid, page + stub.labels["result"], 16))
                        refused = read_memory(pid, page + stub.labels["create_error"], 4)
                        if thread and refused != bytes(4):
                            raise NoCallThread(os.strerror(int.from_bytes(refused, "little")))
                        return result, error
                except OSError as exc:
                    raise TargetError(f"process {pid} went away during the injected call") from exc
                if time.monotonic() > deadline:
                    raise TargetError(
                        f"the injected call in process {pid} has not returned after {timeout:.0f} s (it will "
                        "resume the thread by itself when it does)"
                    )
                time.sleep(0.0005)

        return wait

    def release(self) -> None:
        """Detach, delivering the first held signal (with its siginfo) and re-sending the others."""
        if not self.seized:
            return
        sig = 0
        if self.deferred:
            first, info = self.deferred[0]
            try:
                buf = (ctypes.c_ubyte * SIGINFO_SIZE).from_buffer_copy(info)
                _ptrace(PTRACE_SETSIGINFO, self.tid, 0, buf)
                sig = first
            except OSError:  # not in a signal-delivery stop: send it to the thread instead
                _tgkill(self.pid, self.tid, first)
        try:
            _ptrace(PTRACE_DETACH, self.tid, 0, sig)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise
        self.seized = False
        for other, _ in self.deferred[1:]:
            _tgkill(self.pid, self.tid, other)


class NoCallThread(TargetError):
    """pthread_create refused the thread an injected call was to run on (a thread limit)."""


def _tgkill(pid: int, tid: int, sig: int) -> None:
    _libc.syscall(234, pid, tid, sig)  # SYS_tgkill on x86_64


def _verdict(t: _Thread, ranges: UnsafeRanges, maps: list[MapsEntry], rules: RuleLookup) -> Verdict:
    regs = t.regs()
    rsp = regs[REG["rsp"]]
    stack = next((m for m in maps if m.start <= rsp < m.end), None)
    if stack is None:
        return Verdict(False, "on a stack outside its mappings", 0, False)
    return examine(regs[REG["rip"]], rsp, regs[REG["rbp"]], t.read, ranges, rules, stack.end)


# ---- the injection -------------------------------------------------------------------------------------


def _libc_functions(pid: int, names: Sequence[str], proc_root: str) -> list[int]:
    """The addresses of glibc's functions `names` in process `pid` (its maps and its libc read once)."""
    libc = _libc_mapping(read_map_lines(pid))
    elf = open_elf(_seen_as(pid, libc.path, proc_root)) if libc else None
    out = []
    for name in names:
        found = elf.find_symbol(name) if elf else None
        if libc is None or found is None:
            raise TargetError(f"process {pid} has no glibc {name}")
        out.append(libc.start + found[0])
    return out


def _libc_function(pid: int, name: str, proc_root: str) -> int:
    return _libc_functions(pid, (name,), proc_root)[0]


HOLDING_NICE = -10  # the injecting thread's nice while it may hold a target's thread stopped (_holding_priority)


@contextlib.contextmanager
def _holding_priority() -> Iterator[None]:
    """The calling thread runs at HOLDING_NICE meanwhile: a target thread it seized stays stopped until it lets it
    go, and on cores the service keeps busy a thread of normal weight waited its turn in the middle of that. Under
    pgbench on two cores, a new backend was held stopped some 5 ms in all (about 3 ms with this and the polling of
    _Thread._wait), while it could hold the row lock every other client waited for. Without the right to raise it
    (no CAP_SYS_NICE), as it was. A heapscope started at the idle policy (systemd's CPUSchedulingPolicy=idle,
    `chrt --idle 0`) holds at the normal one: no nice level counts under SCHED_IDLE, where a thread it seized would
    wait for whatever CPU the machine leaves."""
    me = threading.get_native_id()
    idle = os.sched_getscheduler(0) == os.SCHED_IDLE
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            idle = False  # left idle: nothing to give back
    own = os.getpriority(os.PRIO_PROCESS, me)
    before: int | None = own
    try:
        os.setpriority(os.PRIO_PROCESS, me, min(own, HOLDING_NICE))
    except OSError:
        before = None  # not raised: nothing to give back
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, me, before)
        if idle:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _on_safe_thread(
    pid: int, ranges: UnsafeRanges, work: Callable[[_Thread], T], wait: float, proc_root: str, rotate: int = 0
) -> tuple[T, _Thread, int]:
    """Run work(thread) on the first thread found at a safe point; returns (its result, the thread, how many
    threads were seized and found unsafe). `rotate` changes which thread is tried first. Raises NoSafePoint
    with each thread's last verdict when none was safe within `wait` seconds."""
    deadline = time.monotonic() + wait
    tried = 0
    found: dict[int, Verdict] = {}  # each thread's last verdict, for the refusal
    maps = read_map_lines(pid)
    rules = _FrameRules(pid, maps, proc_root)
    try:
        mem = os.open(f"{proc_root}/{pid}/mem", os.O_RDWR)
    except OSError as exc:
        raise TargetError(f"cannot open the memory of process {pid}: {exc.strerror}") from exc
    # Ctrl-C or SIGTERM in the middle of a call would leave the thread running our call with nobody to
    # restore it: hold them until the thread is released.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        with _holding_priority():
            while time.monotonic() < deadline:
                tids = sorted(int(t) for t in os.listdir(f"{proc_root}/{pid}/task"))
                k = rotate % len(tids) if tids else 0
                for tid in tids[k:] + tids[:k]:
                    t = _Thread(pid, tid, mem)
                    try:
                        if not t.seize():
                            continue
                        verdict = found[tid] = _verdict(t, ranges, maps, rules)
                        if not verdict.safe:
                            tried += 1
                            continue
                        return work(t), t, tried
                    except OSError as exc:  # ptrace or /proc/PID/mem refused something: one line, not a traceback
                        why = exc.strerror
                        raise TargetError(f"injecting into thread {tid} of process {pid} failed: {why}") from exc
                    finally:
                        t.release()
                time.sleep(0.01)
                fresh = read_map_lines(pid)
                if fresh != maps:  # a library loaded or unloaded meanwhile: the rules follow
                    maps, rules = fresh, _FrameRules(pid, fresh, proc_root)
        threads = "; ".join(v.describe(tid) for tid, v in sorted(found.items())) or "no thread could be seized"
        raise NoSafePoint(
            f"no thread of process {pid} reached a safe point (outside the allocator and the loader) in {wait:.0f} s: "
            f"{threads}"
        )
    finally:
        os.close(mem)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def examine_threads(pid: int, proc_root: str = "/proc", unwind: bool = True) -> dict[int, Verdict]:
    """Where each thread of `pid` is, as the injection would judge it (seized one at a time, each for a few
    milliseconds, then let go untouched). `unwind=False`: every stack word scanned, as no table were there.
    For diagnostics and tests."""
    preflight_ptrace(pid)
    ranges = unsafe_ranges(pid, proc_root)
    maps = read_map_lines(pid)
    rules = _FrameRules(pid, maps, proc_root) if unwind else _NoRules()
    out: dict[int, Verdict] = {}
    mem = os.open(f"{proc_root}/{pid}/mem", os.O_RDONLY)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        for tid in sorted(int(t) for t in os.listdir(f"{proc_root}/{pid}/task")):
            t = _Thread(pid, tid, mem)
            try:
                if t.seize():
                    out[tid] = _verdict(t, ranges, maps, rules)
            finally:
                t.release()
    finally:
        os.close(mem)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return out


class _NoRules:
    def __call__(self, address: int) -> Rule | None:
        return None


def read_memory(pid: int, address: int, n: int) -> bytes:
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, n, address)
    finally:
        os.close(fd)


def _syscall_instruction(pid: int, proc_root: str) -> int:
    """Address of a `syscall` instruction in the target's libc (inside its syscall() function)."""
    libc = _libc_mapping(read_map_lines(pid))
    obj = open_elf(_seen_as(pid, libc.path, proc_root)) if libc else None
    if libc is None or obj is None:
        raise TargetError(f"process {pid} has no glibc syscall()")

    def offset() -> int | None:  # kept with the file: every call into a process of it asks
        found = obj.find_symbol("syscall")
        if found is None:
            raise TargetError(f"process {pid} has no glibc syscall()")
        at = obj.code_bytes(found[0], max(found[1], 16)).find(b"\x0f\x05")
        return found[0] + at if at >= 0 else None

    at = obj.memoized("syscall instruction", offset)
    if at is None:
        raise TargetError(f"process {pid}: no syscall instruction in libc's syscall()")
    return libc.start + at


def single_threaded(pid: int, proc_root: str) -> bool:
    """glibc's own view (__libc_single_threaded, glibc 2.32+), else the thread count."""
    flag_at = _single_flag(pid, proc_root)
    if flag_at is not None:
        with contextlib.suppress(TargetError, OSError):
            return read_memory(pid, flag_at, 1) != b"\0"
    return len(os.listdir(f"{proc_root}/{pid}/task")) == 1


def _single_flag(pid: int, proc_root: str) -> int | None:
    """Where glibc (2.32+) keeps __libc_single_threaded in the process; None without it (musl, an older glibc)."""
    try:
        return _libc_function(pid, "__libc_single_threaded", proc_root)
    except (TargetError, OSError):
        return None


def _keep_single(pid: int, library: Path, single: bool, proc_root: str) -> tuple[int, int]:
    """(&__libc_single_threaded, the library's hs_kept_single_threaded offset) for the injection stub, which puts
    glibc's single-threaded flags back after joining the thread that loaded the library, where the program was
    single-threaded and the library kept it so (no control thread: hs_sampler.c single_threaded_program); (0, 0)
    where not asked: a program with threads, no glibc flag, a library without the mark. (The loader on the
    program's own thread clears no flag: run_detached asks nothing then.)"""
    if not single:
        return 0, 0
    found = open_elf(str(library)).find_symbol(KEPT_SINGLE_SYMBOL)
    flag_at = _single_flag(pid, proc_root)
    return (flag_at, found[0]) if found is not None and flag_at is not None else (0, 0)


def _stub() -> Stub:
    built = build_stub()
    st = os.stat(built)
    return _loaded_stub(str(built), (st.st_ino, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _loaded_stub(path: str, stamp: tuple[int, int]) -> Stub:
    """The stub read once while its file stays the same (every call into a target asks for it)."""
    return load_stub(Path(path))


def call_function(pid: int, name: str, wait: float = 5.0, proc_root: str = "/proc", rotate: int = 0) -> tuple[int, int]:
    """Call libc's `name`() (no arguments) in the target as inject() calls dlopen; returns (rax, thread).
    For checking the injection path itself (tests, diagnostics)."""
    preflight_ptrace(pid)
    return _call(pid, _libc_function(pid, name, proc_root), wait, proc_root, rotate)


def _call(pid: int, function: int, wait: float, proc_root: str, rotate: int = 0,
          allocator: str | None = None, args: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """function(*args) run on a thread at a safe point; (rax, thread)."""
    stub = _stub()
    syscall_at = _syscall_instruction(pid, proc_root)
    ranges = unsafe_ranges(pid, proc_root, allocator)
    waiter, t, _ = _on_safe_thread(
        pid, ranges, lambda t: t.run_detached(stub, syscall_at, function, *args, 0), wait, proc_root, rotate
    )
    result, _ = waiter()
    return result, t.tid


@dataclass(frozen=True)
class CallThread:
    """The libc functions the stub makes its call's thread with."""

    create: int
    join: int
    attr_init: int
    attr_setstack: int


CALL_THREAD_STACK = 1 << 20  # the loader and the library's constructor use a few KiB


def _call_thread(pid: int, proc_root: str) -> CallThread | None:
    """The functions to load the sampler on a thread of its own: what the loader and the library's start allocate
    then comes from that thread's arena, and the heap the program's threads share keeps the layout it had (a
    prefork server's workers, forked from it, keep theirs). None before glibc 2.34, whose libc has no
    pthread_create (it was in libpthread): the loader then runs on the program's thread."""
    names = ("pthread_create", "pthread_join", "pthread_attr_init", "pthread_attr_setstack")
    try:
        return CallThread(*_libc_functions(pid, names, proc_root))
    except TargetError:
        return None


REVIVE_SYMBOL = "hs_sampler_revive"


def revive(pid: int, library: Path, wait: float = 5.0, proc_root: str = "/proc", allocator: str | None = None) -> bool:
    """Start the sampler again in a forked child of a process it was loaded in (a prefork server's worker, a
    database's backend): the child has the library, but no control thread. Called like dlopen, at a safe point.
    False where that is not what is wrong (the library failed to start in its own process, or runs). A child that
    may start no thread gets its sampler threadless (sampler.py). `allocator` as for unsafe_ranges."""
    library = Path(os.path.realpath(library))
    base = mapped_base(pid, library)
    if base is None:
        return False
    preflight_ptrace(pid)
    result, _ = _call(pid, base + symbol_value(library, REVIVE_SYMBOL), wait, proc_root, allocator=allocator)
    if result >= 1 << 63 and (1 << 64) - result not in (errno.ENOTSUP, errno.EALREADY):
        raise TargetError(f"process {pid}: its sampler could not be started again: "
                          f"{os.strerror((1 << 64) - result)}; use --mode=exact")
    return result in (0, 1)  # 1: threadless


SAMPLER_CALL_SYMBOL = "hs_sampler_call"


def call_sampler(pid: int, library: Path, request: int, arg: int = 0, wait: float = 5.0, proc_root: str = "/proc",
                 allocator: str | None = None) -> int:
    """A request to a threadless sampler (one whose process could start no control thread): hs_sampler_call
    (request, arg) called on one of its threads at a safe point, like dlopen; its result (negative: -errno).
    `allocator` as for unsafe_ranges."""
    library = Path(os.path.realpath(library))
    base = mapped_base(pid, library)
    if base is None:
        raise TargetError(f"the sampler is not loaded in process {pid}")
    preflight_ptrace(pid)
    function = base + symbol_value(library, SAMPLER_CALL_SYMBOL)
    result, _ = _call(pid, function, wait, proc_root, allocator=allocator, args=(request, arg))
    return result - (1 << 64) if result >= 1 << 63 else result


MFD_CLOEXEC = 1


def inject(
    pid: int, library: Path, wait: float = 5.0, proc_root: str = "/proc", allocator: str | None = None
) -> Injection:
    """Load `library` into process `pid` (no-op if it is loaded already). A process that cannot see it at its
    path (a container, a chroot) is handed it in a memfd: made in the process, filled from here through
    /proc/PID/fd, dlopen'ed as /proc/self/fd/N, then closed. Nothing is written into its filesystem.
    `allocator` as for unsafe_ranges."""
    library = Path(os.path.realpath(library))
    if mapped_base(pid, library) is not None:
        return Injection(pid, library, reused=True)
    preflight(pid, library, proc_root)
    single = single_threaded(pid, proc_root)
    stub = _stub()
    ranges = unsafe_ranges(pid, proc_root, allocator)
    libc = _libc_mapping(read_map_lines(pid))
    dlopen_name = _dlopen_of(open_elf(_seen_as(pid, libc.path, proc_root))) if libc else None
    dlopen_at = _libc_function(pid, dlopen_name or "dlopen", proc_root)
    dlerror_at = _libc_function(pid, "dlerror", proc_root) if dlopen_name == "dlopen" else 0
    syscall_at = _syscall_instruction(pid, proc_root)
    started = time.monotonic()
    memfd = None
    by_folder = needs_folder(pid, library, proc_root)
    if by_folder:  # dlopen'ed by its name, from its folder made the thread's working directory meanwhile
        path = b"./" + os.fsencode(library.name) + b"\0"
    elif sees_library(pid, library, proc_root):
        path = os.fsencode(library) + b"\0"
    else:
        memfd = _memfd_with(pid, library, stub, syscall_at, ranges, wait, proc_root)
        path = b"/proc/self/fd/%d\0" % memfd

    thread = _call_thread(pid, proc_root)
    keep = _keep_single(pid, library, single, proc_root)
    entered: list[tuple[int, int]] = []  # (thread, its working directory's descriptor) to put back

    def start(t: _Thread) -> Callable[[], tuple[int, int]]:
        if by_folder:
            entered.append((t.tid, _enter_folder(t, syscall_at, str(library.parent))))
        return t.run_detached(stub, syscall_at, dlopen_at, -1, RTLD_NOW | RTLD_NODELETE, dlerror_at, path, thread,
                              keep_single=keep)

    try:
        try:
            waiter, t, tried = _on_safe_thread(pid, ranges, start, wait, proc_root)
            handle, error = waiter()
        except NoCallThread:  # no thread to spare: the loader runs on the program's thread, as it can
            thread = None
            waiter, t, tried = _on_safe_thread(pid, ranges, start, wait, proc_root)
            handle, error = waiter()
    finally:
        for tid, cwd in reversed(entered):  # last first: a thread entered twice gets its first directory back
            _leave_folder(pid, tid, cwd, syscall_at, proc_root)
        if memfd is not None:  # the mapping holds the file now; the descriptor is not the program's to keep
            close_at = _libc_function(pid, "close", proc_root)
            _on_safe_thread(pid, ranges, lambda t: t.run_detached(stub, syscall_at, close_at, memfd, 0, 0), wait,
                            proc_root)[0]()
    if handle == 0:
        msg = read_memory(pid, error, 512).split(b"\0", 1)[0].decode(errors="replace") if error else "?"
        raise TargetError(f"dlopen of the sampler failed in process {pid}: {msg}")
    # Single-threaded still (a threadless sampler's process): its libc keeps its fast paths.
    single = single and not single_threaded(pid, proc_root)
    return Injection(
        pid, library, False, t.tid, time.monotonic() - started, tried, [s for s, _ in t.deferred], single,
        memfd=memfd is not None, folder=by_folder,
    )


class _SyscallsOf:
    """A seized thread as agent.process.handover.SyscallThread: its system calls made from `saved` registers."""

    def __init__(self, t: _Thread, syscall_at: int, saved: list[int]) -> None:
        self.t, self.at, self.saved = t, syscall_at, saved

    def call(self, nr: int, *args: int) -> int:
        return self.t._syscall(self.at, self.saved, nr, *args)

    def write(self, address: int, data: bytes) -> None:
        self.t.write(address, data)

    def read(self, address: int, n: int) -> bytes:
        return self.t.read(address, n)


def _enter_folder(t: _Thread, syscall_at: int, folder: str) -> int:
    """handover.enter on seized thread `t` (a page of its own mapped for it, then unmapped); its registers back."""
    saved = t.regs()
    try:
        page = t._map(syscall_at, saved, 4096, 0)
        try:
            return handover.enter(_SyscallsOf(t, syscall_at, saved), t.pid, page, folder)
        finally:
            t._syscall(syscall_at, saved, SYS_MUNMAP, page, 4096)
    finally:
        t.set_regs(saved)


def _leave_folder(pid: int, tid: int, cwd: int, syscall_at: int, proc_root: str) -> None:
    """handover.leave on thread `tid`, seized again wherever it is (two system calls need no safe point)."""
    try:
        mem = os.open(f"{proc_root}/{pid}/mem", os.O_RDWR)
    except OSError:
        return  # gone: its working directory went with it
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    t = _Thread(pid, tid, mem)
    try:
        if not t.seize():
            return  # that thread ended: its own filesystem context went with it
        saved = t.regs()
        try:
            handover.leave(_SyscallsOf(t, syscall_at, saved), pid, cwd)
        finally:
            t.set_regs(saved)
    finally:
        t.release()
        os.close(mem)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def memfd_name(library: Path) -> str:
    """The name a memfd holding `library` has in the target's maps ("/memfd:NAME (deleted)")."""
    return library.name


def _memfd_with(pid: int, library: Path, stub: Stub, syscall_at: int, ranges: UnsafeRanges, wait: float,
                proc_root: str) -> int:
    """A memfd made in the process (its libc's memfd_create, on a thread at a safe point) and filled with
    `library` from here; its descriptor number in the process."""
    try:
        create_at = _libc_function(pid, "memfd_create", proc_root)
    except TargetError:
        raise SamplingRefused(
            f"process {pid} cannot see the sampler library through its own root, and its libc has no memfd_create "
            "to be handed it (glibc before 2.27); use --mode=exact"
        ) from None
    name = memfd_name(library).encode() + b"\0"
    waiter, _, _ = _on_safe_thread(
        pid, ranges, lambda t: t.run_detached(stub, syscall_at, create_at, -1, MFD_CLOEXEC, 0, name), wait, proc_root
    )
    fd, _ = waiter()
    if fd >= 1 << 31:
        raise TargetError(f"process {pid}: memfd_create for the sampler failed")
    try:
        with open(f"{proc_root}/{pid}/fd/{fd}", "wb") as out, open(library, "rb") as src:
            out.write(src.read())
    except OSError as exc:
        raise TargetError(f"process {pid}: cannot fill its memfd with the sampler: {exc.strerror}") from exc
    return fd
