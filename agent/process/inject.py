"""Bringing the sampler library into a running process: ptrace, then a call of the target's own dlopen.

Own code over ctypes rather than pyinjector (kubo/injector): the safety rules below need control of which
thread runs the call and when, which that library does not give (it calls dlopen from whichever thread it
attached, and its README warns that a thread stopped inside malloc deadlocks the process).

How a call is made safe:
- One thread at a time is seized (PTRACE_SEIZE + PTRACE_INTERRUPT); the others run on, so any lock they hold
  is released as usual. The seized thread is used only at a safe point: its instruction pointer and every
  word of its live stack (a conservative scan from %rsp up) lie outside the allocator (malloc and its
  internal functions, the whole allocator library when it is not libc, C++ operators new/delete), the
  loader (ld.so, libc's dl* functions) and fork, and outside a signal handler (__restore_rt on its stack).
  A stale word can only make a thread look unsafe, never safe: it is then released and another one, or the
  same one a little later, is tried.
- The call runs on the thread's own stack below the red zone, 16-byte aligned, with orig_rax = -1 so an
  interrupted system call is not restarted in the middle of the call; it returns to address 0, and the
  SIGSEGV stop that gives is the end of the call.
- Afterwards every register is put back: the general ones (orig_rax and rax included, so the interrupted
  system call restarts as if nothing had happened: no EINTR reaches the program) and the whole XSAVE area
  (x87, SSE, AVX, AVX-512). The stack bytes written are restored too. Signals that arrived during the call
  are held and delivered after it.
- The library is loaded RTLD_NOW | RTLD_NODELETE and never dlclosed: a second attach finds it mapped and
  injects nothing.

Refused, with one line and an exit code: ptrace forbidden (yama ptrace_scope 3, or already traced), a
target under seccomp (its filter may kill the process on a system call dlopen or the sampler makes), a
process without glibc's dlopen (static, musl), an allocator linked into the executable (its calls do not go
through the GOT), a sampler library the target cannot see through its own root (containers).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import signal
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from agent.errors import EnvironmentProblem, TargetError
from agent.process.discovery import allocator_of_process
from agent.process.sampler import MapLine, mapped_base, read_map_lines
from agent.symbols.elf import ElfObject, open_elf
from agent.symbols.symbolizer import DEFAULT_DEBUG_ROOTS, find_debug_file

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
STACK_SCAN = 32 * 1024  # bytes of live stack checked for return addresses into the allocator or loader
XSTATE_MAX = 16384
SIGINFO_SIZE = 128
EFLAGS_TF, EFLAGS_DF = 0x100, 0x400

# Functions a thread must not be inside when it runs the call: exact names and name prefixes.
UNSAFE_NAMES = frozenset(
    {
        "malloc", "free", "calloc", "realloc", "reallocarray", "memalign", "aligned_alloc", "posix_memalign",
        "valloc", "pvalloc", "cfree", "malloc_trim", "malloc_usable_size", "mallinfo", "mallinfo2",
        "malloc_stats", "malloc_info", "mallopt", "fork", "_Fork", "vfork", "dlopen", "dlclose", "dlsym",
        "dlvsym", "dladdr", "dladdr1", "dlinfo", "dlmopen", "dlerror", "dl_iterate_phdr", "__restore_rt",
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


# ---- refusals ------------------------------------------------------------------------------------------


def _status_fields(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    except FileNotFoundError as exc:
        raise TargetError(f"no process with PID {pid}") from exc


def _libc_mapping(maps: Iterable[MapLine]) -> MapLine | None:
    for m in maps:
        if m.offset == 0 and os.path.basename(m.path).startswith("libc.so"):
            return m
    return None


def preflight_ptrace(pid: int) -> dict[str, str]:
    """Refuse where ptrace itself is not allowed or not safe."""
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    if yama.exists() and yama.read_text().strip() == "3":
        raise EnvironmentProblem("ptrace is disabled on this machine (kernel.yama.ptrace_scope=3); use --mode=exact")
    status = _status_fields(pid)
    if status.get("TracerPid", "0").strip() != "0":
        raise TargetError(f"process {pid} is already traced by PID {status['TracerPid'].strip()}; use --mode=exact")
    seccomp = status.get("Seccomp", "0").strip()
    if seccomp != "0":
        raise TargetError(
            f"process {pid} runs under seccomp (mode {seccomp}): its filter could kill it on a system call the "
            "sampler makes; use --mode=exact"
        )
    if status.get("State", "").startswith(("T", "t")):
        raise TargetError(f"process {pid} is stopped; resume it or use --mode=exact")
    return status


def preflight(pid: int, library: Path, proc_root: str = "/proc") -> None:
    """Refuse, with one line, where injecting cannot be made safe."""
    preflight_ptrace(pid)
    try:
        inside = os.stat(f"{proc_root}/{pid}/root{library}")
    except FileNotFoundError:
        inside = None
    ours = os.stat(library)
    if inside is None or (inside.st_dev, inside.st_ino) != (ours.st_dev, ours.st_ino):
        raise TargetError(
            f"process {pid} cannot see the sampler library {library} through its own root (a container?); "
            "use --mode=exact"
        )
    maps = read_map_lines(pid)
    libc = _libc_mapping(maps)
    if libc is None or open_elf(f"{proc_root}/{pid}/root{libc.path}").find_symbol("dlopen") is None:
        raise TargetError(f"process {pid} has no glibc dlopen (a static or non-glibc program); use --mode=exact")
    allocator = allocator_of_process(pid, proc_root)
    exe = os.path.realpath(f"{proc_root}/{pid}/exe")
    if os.path.realpath(allocator.path) == exe:
        raise TargetError(
            f"process {pid}'s allocator ({allocator.family}) is linked into its executable: its calls do not go "
            "through the GOT and cannot be sampled; use --mode=exact"
        )


# ---- the unsafe ranges ---------------------------------------------------------------------------------


def _is_unsafe_name(name: str) -> bool:
    bare = name.split("@", 1)[0]
    return bare in UNSAFE_NAMES or bare.startswith(UNSAFE_PREFIXES)


def _symbol_ranges(obj: ElfObject, debug: ElfObject | None) -> list[tuple[int, int]]:
    ranges = []
    for source in (obj, debug) if debug is not None else (obj,):
        for sym in source.function_symbols():
            if sym.size and _is_unsafe_name(sym.name):
                ranges.append((sym.value, sym.value + sym.size))
    return ranges


def unsafe_ranges(pid: int, proc_root: str = "/proc") -> list[tuple[int, int]]:
    """Address ranges of the target where a thread must not be (or return to) when it runs the call."""
    maps = read_map_lines(pid)
    allocator = allocator_of_process(pid, proc_root)
    allocator_real = os.path.realpath(allocator.path)
    out: list[tuple[int, int]] = []
    by_path: dict[str, list[MapLine]] = {}
    for m in maps:
        if m.path.startswith("/"):
            by_path.setdefault(m.path, []).append(m)
    for path, lines in by_path.items():
        base = min(m.start for m in lines if m.offset == 0) if any(m.offset == 0 for m in lines) else None
        execs = [m for m in lines if "x" in m.perms]
        if not execs or base is None:
            continue
        name = os.path.basename(path)
        seen_as = f"{proc_root}/{pid}/root{path}"
        whole = name.startswith("ld-linux") or (
            os.path.realpath(seen_as) == allocator_real and not name.startswith("libc.so")
        )
        if whole:  # the loader, or an allocator library (jemalloc, tcmalloc, mimalloc): all of its code
            out.extend((m.start, m.end) for m in execs)
            continue
        if not (name.startswith(("libc.so", "libstdc++", "libc++")) or os.path.realpath(seen_as) == allocator_real):
            continue
        try:
            obj = open_elf(seen_as)
        except Exception:  # unreadable object: all of its code counts as unsafe
            out.extend((m.start, m.end) for m in execs)
            continue
        debug = find_debug_file(obj, DEFAULT_DEBUG_ROOTS)
        bias = base if obj.is_pie_or_shared else 0
        out.extend((lo + bias, hi + bias) for lo, hi in _symbol_ranges(obj, debug))
    return _merge(out)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ranges joined (aliases of one function overlap)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _inside(ranges: list[tuple[int, int]], address: int) -> bool:
    i = bisect.bisect_right(ranges, (address, 1 << 64)) - 1
    return i >= 0 and ranges[i][0] <= address < ranges[i][1]


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
        deadline = time.monotonic() + timeout
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
            if time.monotonic() > deadline:
                return None
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

    def call(self, function: int, args: tuple[int, ...], extra: bytes = b"", timeout: float = 30.0) -> tuple[int, int]:
        """Call function(*args) on this thread; `extra` is copied to its stack first and its address replaces
        each argument equal to -1. Returns (rax, address of extra). Every register and the stack are restored."""
        saved = self.regs()
        saved_x = self.xstate()
        sp = (saved[REG["rsp"]] - RED_ZONE - len(extra) - 64) & ~0xF
        extra_at = sp
        sp -= 16
        low = sp - 8
        stack_before = self.read(low, saved[REG["rsp"]] - RED_ZONE - low)
        try:
            self.write(extra_at, extra)
            self.write(sp - 8, struct.pack("<Q", 0))  # return address 0: the call ends in a SIGSEGV stop
            regs = list(saved)
            regs[REG["rsp"]] = sp - 8  # at entry (rsp + 8) % 16 == 0, as after a call
            regs[REG["rip"]] = function
            regs[REG["orig_rax"]] = -1  # not inside a system call: no restart in the middle of our call
            regs[REG["rax"]] = 0
            regs[REG["eflags"]] &= ~(EFLAGS_TF | EFLAGS_DF)
            for reg, value in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), args, strict=False):
                regs[REG[reg]] = extra_at if value == -1 else value
            self.set_regs(regs)
            _ptrace(PTRACE_CONT, self.tid, 0, 0)
            while True:
                status = self._wait(timeout)
                if status is None:
                    raise TargetError(
                        f"the call in thread {self.tid} of process {self.pid} did not return within {timeout:.0f} s"
                    )
                if os.WIFSTOPPED(status) and (status >> 16) == 0:
                    sig = os.WSTOPSIG(status)
                    now = self.regs()
                    if sig == signal.SIGSEGV and now[REG["rip"]] == 0:
                        return now[REG["rax"]], extra_at
                    if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE):
                        raise TargetError(
                            f"the injected call faulted in process {self.pid} ({signal.Signals(sig).name} at "
                            f"0x{now[REG['rip']]:x})"
                        )
                    self._defer(sig)
                _ptrace(PTRACE_CONT, self.tid, 0, 0)
        finally:
            self.write(low, stack_before)
            self.set_xstate(saved_x)
            self.set_regs(saved)

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


def _tgkill(pid: int, tid: int, sig: int) -> None:
    _libc.syscall(234, pid, tid, sig)  # SYS_tgkill on x86_64


def _at_safe_point(t: _Thread, ranges: list[tuple[int, int]], maps: list[MapLine]) -> bool:
    regs = t.regs()
    if _inside(ranges, regs[REG["rip"]]):
        return False
    rsp = regs[REG["rsp"]]
    stack = next((m for m in maps if m.start <= rsp < m.end), None)
    if stack is None:
        return False
    end = min(stack.end, rsp + STACK_SCAN)
    try:
        data = t.read(rsp, end - rsp)
    except OSError:
        return False
    return not any(_inside(ranges, w) for (w,) in struct.iter_unpack("<Q", data[: len(data) // 8 * 8]))


# ---- the injection -------------------------------------------------------------------------------------


def _libc_function(pid: int, name: str, proc_root: str) -> int:
    libc = _libc_mapping(read_map_lines(pid))
    found = open_elf(f"{proc_root}/{pid}/root{libc.path}").find_symbol(name) if libc else None
    if libc is None or found is None:
        raise TargetError(f"process {pid} has no glibc {name}")
    return libc.start + found[0]


def _on_safe_thread(
    pid: int, ranges: list[tuple[int, int]], work: Callable[[_Thread], T], wait: float, proc_root: str, rotate: int = 0
) -> tuple[T, _Thread, int]:
    """Run work(thread) on the first thread found at a safe point; returns (its result, the thread, how many
    threads were seized and found unsafe). `rotate` changes which thread is tried first."""
    deadline = time.monotonic() + wait
    tried = 0
    maps = read_map_lines(pid)
    mem = os.open(f"{proc_root}/{pid}/mem", os.O_RDWR)
    # Ctrl-C or SIGTERM in the middle of a call would leave the thread running our call with nobody to
    # restore it: hold them until the thread is released.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        while time.monotonic() < deadline:
            tids = sorted(int(t) for t in os.listdir(f"{proc_root}/{pid}/task"))
            k = rotate % len(tids) if tids else 0
            for tid in tids[k:] + tids[:k]:
                t = _Thread(pid, tid, mem)
                try:
                    if not t.seize():
                        continue
                    if not _at_safe_point(t, ranges, maps):
                        tried += 1
                        continue
                    return work(t), t, tried
                finally:
                    t.release()
            time.sleep(0.01)
            maps = read_map_lines(pid)
        raise TargetError(
            f"no thread of process {pid} reached a safe point (outside the allocator and the loader) in {wait:.0f} s"
        )
    finally:
        os.close(mem)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def call_function(pid: int, name: str, wait: float = 5.0, proc_root: str = "/proc", rotate: int = 0) -> tuple[int, int]:
    """Call libc's `name`() (no arguments) in the target as inject() calls dlopen; returns (rax, thread).
    For checking the injection path itself (tests, diagnostics)."""
    preflight_ptrace(pid)
    function = _libc_function(pid, name, proc_root)
    ranges = unsafe_ranges(pid, proc_root)
    rax, t, _ = _on_safe_thread(pid, ranges, lambda t: t.call(function, ())[0], wait, proc_root, rotate)
    return rax, t.tid


def inject(pid: int, library: Path, wait: float = 5.0, proc_root: str = "/proc") -> Injection:
    """Load `library` into process `pid` (no-op if it is loaded already)."""
    library = Path(os.path.realpath(library))
    if mapped_base(pid, library) is not None:
        return Injection(pid, library, reused=True)
    preflight(pid, library, proc_root)
    ranges = unsafe_ranges(pid, proc_root)
    dlopen_at = _libc_function(pid, "dlopen", proc_root)
    dlerror_at = _libc_function(pid, "dlerror", proc_root)
    started = time.monotonic()

    def load(t: _Thread) -> int:
        handle, _ = t.call(dlopen_at, (-1, RTLD_NOW | RTLD_NODELETE), os.fsencode(library) + b"\0")
        if handle == 0:
            msg_at, _ = t.call(dlerror_at, ())
            msg = t.read(msg_at, 512).split(b"\0", 1)[0].decode(errors="replace") if msg_at else "?"
            raise TargetError(f"dlopen of the sampler failed in process {pid}: {msg}")
        return handle

    _, t, tried = _on_safe_thread(pid, ranges, load, wait, proc_root)
    return Injection(pid, library, False, t.tid, time.monotonic() - started, tried, [s for s, _ in t.deferred])
