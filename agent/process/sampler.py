"""The in-process sampler library (probes/sampler/hs_sampler.c): building it, finding it in a target, and
talking to it through its control block.

The library is compiled with gcc on first use into a cache folder that only root can write (the target
runs code from it), under a name that is the hash of its source and flags, so a changed source is a new
file and a loaded old one is never overwritten. `scripts/setup.sh sampler` builds it ahead.

Control (probes/sampler/hs_sampler.h): heapscope writes a request into `hs_control` through /proc/PID/mem
and the sampler's control thread, which polls it, answers in the same block. Before arming, heapscope takes
a duplicate of the lease pipe's write end with pidfd_getfd; the sampler then closes its own copy, so that
heapscope's exit, even by SIGKILL, closes the pipe and the sampler disarms itself. A child forked while its
parent was armed stays armed from its fork on, threadless, on the same lease (it has a copy of the read end):
heapscope takes a share of the parent's (HeldLeases), so that detaching the parent keeps its profiled children
armed, and the pipe closes when the last of them lets go.

A single-threaded process that heapscope's injection loads it into (kept single-threaded: glibc's fast paths), and
a process that can start no thread (RLIMIT_NPROC, as haproxy's workers set it; a cgroup's pids.max), get their
sampler threadless: each request is a call into it on one of the program's threads at a safe point, made by the
caller's `call` (agent.process.inject.call_sampler), and its hooks watch the lease at each sample.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from agent.errors import EnvironmentProblem, TargetError, UsageError
from agent.model.callcounts import ThreadCalls
from agent.model.maps import MapsEntry, parse_maps_full
from agent.process.discovery import ProbePoint, elf_facts
from agent.symbols.elf import open_elf
from agent.symbols.placement import choose_offset

SOURCE_DIR = Path(__file__).resolve().parents[2] / "probes" / "sampler"
SOURCES = ("hs_sampler.c", "hs_sampler.h")
# -fcf-protection=none: nothing may precede the probe functions' 5-byte nop (they are built without a frame;
# the hooks keep frame pointers so that a frame-pointer walk from a probe reaches the program's frames).
# -fexceptions: a C++ exception thrown through an operator-new hook runs its cleanup. initial-exec TLS:
# one %fs access on the fast path. nodelete: dlclose never unloads it. now+relro: its own GOT sealed.
CFLAGS = (
    "-O2", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-ftls-model=initial-exec", "-fno-omit-frame-pointer",
    "-fcf-protection=none", "-fexceptions", "-fno-stack-protector", "-Wall", "-Wextra", "-Werror",
    "-Wl,-z,now", "-Wl,-z,relro", "-Wl,-z,nodelete",
)  # fmt: skip
# libdl and libpthread held dlsym and pthread_create before glibc 2.34 (empty since): needed, used or not.
LIBS = ("-Wl,--no-as-needed", "-l:libdl.so.2", "-l:libpthread.so.0", "-Wl,--as-needed")
MUSL_LIBS: tuple[str, ...] = ()  # musl's libc holds all of it
# musl: no -fexceptions, whose cleanup personality pulls in GCC's unwinder, built for glibc (_dl_find_object).
# The hooks keep their unwind tables; what is lost is only the reset of a hook's busy flag when a C++
# operator new throws through it (bad_alloc), which leaves that thread's later calls uncounted.
# And no initial-exec TLS, which musl's loader refuses in a library it dlopens.
MUSL_CFLAGS = (
    *(
        "-fasynchronous-unwind-tables" if f == "-fexceptions" else f
        for f in CFLAGS if f != "-ftls-model=initial-exec"
    ),
    '-DHS_TLS_MODEL="global-dynamic"',
)
# glibc 2.34+ in a bare chroot (haproxy's worker): the library is handed its folder (agent.process.handover) and its
# loader can open nothing from inside the process's root, so it must need only what the process has loaded: libc
# (2.34 moved dlsym and pthread_create into it, under the old versions the .symver lines ask for too) and not
# libgcc_s, which -fexceptions' cleanup personality needs. Lost, as in the musl build: the reset of a hook's busy
# flag when a C++ operator new throws through it.
BARE_CFLAGS = tuple("-fasynchronous-unwind-tables" if f == "-fexceptions" else f for f in CFLAGS)
DEFAULT_CACHE_DIR = "/var/cache/heapscope"
CONTROL_SYMBOL = "hs_control"
PROBE_FUNCTIONS = ("hs_sample_alloc", "hs_sample_free")

# struct hs_sampler_control, field by field (all 8 bytes; q = signed).
CONTROL_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "Q"), ("version", "Q"), ("request_seq", "Q"), ("request", "Q"), ("sample_rate", "Q"),
    ("ack_seq", "Q"), ("result", "q"), ("state", "Q"), ("lease_fd", "q"), ("lease_ino", "Q"),
    ("disarm_reason", "Q"), ("arm_count", "Q"), ("slots_patched", "Q"), ("slots_unwritable", "Q"),
    ("objects_scanned", "Q"), ("scans", "Q"), ("samples", "Q"), ("sampled_frees", "Q"), ("set_full", "Q"),
    ("realloc_failed_sampled", "Q"), ("control_tid", "Q"), ("hooks_resolved", "Q"), ("lazy_skipped", "Q"),
    ("counts_address", "Q"),
    ("counts_used", "Q"), ("forked_armed", "Q"), ("max_samples", "Q"), ("rate_in_force", "Q"), ("rate_changes", "Q"),
)  # fmt: skip
CONTROL_FORMAT = "<" + "".join(f for _, f in CONTROL_FIELDS)
CONTROL_SIZE = struct.calcsize(CONTROL_FORMAT)
OFFSETS = {name: i * 8 for i, (name, _) in enumerate(CONTROL_FIELDS)}
MAGIC = 0x4853534D504C5231
MAX_RATE = 1 << 40  # hs_sampler.c refuses more
COUNT_SLOTS = 16384  # hs_sampler.h: HS_COUNT_SLOTS
# struct hs_counts, padded to two cache lines (field names as agent.model.callcounts.ThreadCalls has them).
COUNT_FIELDS = ("allocs", "frees", "alloc_bytes", "calloc", "realloc", "memalign", "posix_memalign", "valloc",
                "pvalloc", "realloc_frees", "tid")  # fmt: skip
COUNTS = struct.Struct(f"<{len(COUNT_FIELDS)}Q40x")


def within_budget(budget: int, cap: int) -> bool:
    """Whether a sampler's `budget` (samples a second, 0: none) keeps within `cap`: a forked child keeps the budget
    its parent had when it was lower than the profile's (a daemon's share of its total), not a higher one."""
    return budget == cap or (cap == 0 and budget > 0) or 0 < budget < cap


def thread_calls_of(table: bytes) -> list[ThreadCalls]:
    """A count table (SamplerControl.count_table) as one ThreadCalls a slot."""
    return [ThreadCalls(**dict(zip(COUNT_FIELDS, values, strict=True))) for values in COUNTS.iter_unpack(table)]


def calls_total_of(table: bytes) -> ThreadCalls:
    """A count table's slots summed, column by column in numpy (no object a slot)."""
    if not table:
        return ThreadCalls(0)
    words = np.frombuffer(table, dtype="<u8").reshape(len(table) // COUNTS.size, COUNTS.size // 8)
    sums = words[:, : len(COUNT_FIELDS)].sum(axis=0, dtype=np.uint64)
    return ThreadCalls(0, **{name: int(v) for name, v in zip(COUNT_FIELDS, sums, strict=True) if name != "tid"})


VERSION = 7
REQ_ARM, REQ_DISARM, REQ_LEASE, REQ_RESCAN = 1, 2, 3, 4
FORKED_ARMED, FORKED_CLAIMED = 1, 2  # forked_armed (enum hs_forked)
STATE_NAMES = {0: "loading", 1: "idle", 2: "armed", 3: "broken", 4: "threadless"}
DISARM_REASONS = {0: "none", 1: "requested", 2: "controller gone", 3: "lease descriptor lost"}

_SYS_PIDFD_GETFD = 438  # x86_64
_libc = ctypes.CDLL(None, use_errno=True)


# ---- building ------------------------------------------------------------------------------------------


def _source_hash(cc: str, source: str, flags: tuple[str, ...]) -> str:
    # Every attach asks (the stub is built before each call into a target): the sources' stamps are looked at,
    # and their text and the compiler read again only when one changed.
    names = tuple(sorted({source, *SOURCES}))
    stamps = tuple((st.st_mtime_ns, st.st_size) for st in (os.stat(SOURCE_DIR / n) for n in names))
    compiler = shutil.which(cc) or cc
    try:
        cc_stat = os.stat(compiler)
        cc_stamp = (cc_stat.st_ino, cc_stat.st_mtime_ns)
    except OSError:
        cc_stamp = (0, 0)
    return _hash_of(cc, names, flags, stamps, cc_stamp)


@lru_cache(maxsize=16)
def _hash_of(cc: str, names: tuple[str, ...], flags: tuple[str, ...], stamps: object, cc_stamp: object) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update((SOURCE_DIR / name).read_bytes())
    h.update("\0".join(flags).encode())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    h.update(version.encode())
    return h.hexdigest()[:16]


def _check_private_dir(path: Path) -> None:
    """The folder the target loads code from: ours, and writable by nobody else."""
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise EnvironmentProblem(
            f"sampler cache {path} must belong to uid {os.geteuid()} and not be group/other-writable "
            "(processes load code from it)"
        )


def cache_dir() -> Path:
    return Path(os.environ.get("HEAPSCOPE_CACHE_DIR", DEFAULT_CACHE_DIR))


def build_stub(directory: Path | None = None, cc: str = "gcc") -> Path:
    """The injection stub (probes/sampler/inject_stub.S) assembled, built if it is not in the cache yet."""
    return _build(directory, cc, "inject_stub.S", "inject_stub", ".o", ("-c",), ())


def build_sampler(directory: Path | None = None, cc: str = "gcc", libc: str = "glibc") -> Path:
    """The sampler library for the current source and a target's libc ("glibc"; "musl": the same source
    built with musl-gcc, for musl's loader to load; "glibc-bare": for glibc 2.34+ in a bare chroot, needing libc
    alone), built if it is not in the cache yet."""
    if libc == "musl":
        return _build(directory, "musl-gcc", "hs_sampler.c", "libhs_sampler-musl", ".so", MUSL_CFLAGS, MUSL_LIBS)
    if libc == "glibc-bare":
        return _build(directory, cc, "hs_sampler.c", "libhs_sampler-bare", ".so", BARE_CFLAGS, ())
    return _build(directory, cc, "hs_sampler.c", "libhs_sampler", ".so", CFLAGS, LIBS)


def libc_of_process(pid: int) -> str:
    """ "musl" for a process whose loader is musl's (its libc), else "glibc"."""
    musl = read_map_lines(pid, keep=lambda line: "/ld-musl" in line)
    return "musl" if any(os.path.basename(m.path).startswith("ld-musl") for m in musl) else "glibc"


def libc_of_program(path: str) -> str:
    """The same for a program not started yet: its PT_INTERP."""
    return "musl" if "ld-musl" in (elf_facts(path).interp or "") else "glibc"


_compilers_found: set[str] = set()


def _compiler_found(cc: str) -> bool:
    """Whether `cc` is on the PATH; once found, not looked for again (a PATH walk at each target's attach, twice
    for each new worker of a prefork server). Not found is looked for again: it may be installed meanwhile."""
    if cc not in _compilers_found and shutil.which(cc) is not None:
        _compilers_found.add(cc)
    return cc in _compilers_found


def _build(directory: Path | None, cc: str, source: str, stem: str, suffix: str, flags: tuple[str, ...],
           libs: tuple[str, ...]) -> Path:
    if not _compiler_found(cc):
        package = " (musl-tools), for a musl process," if cc == "musl-gcc" else ""
        raise EnvironmentProblem(f"sampled mode builds its sampler with {cc}{package} which is not installed")
    directory = directory or cache_dir()
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    _check_private_dir(directory)
    target = directory / f"{stem}-{_source_hash(cc, source, flags + libs)}{suffix}"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, str(SOURCE_DIR / source), *libs]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise EnvironmentProblem(f"building {source} failed: {first}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # atomic: a process never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# ---- finding it in a target ----------------------------------------------------------------------------


def read_map_lines(pid: int, keep: Callable[[str], bool] | None = None) -> list[MapsEntry]:
    """The process's mappings; with `keep`, only the lines it keeps are parsed (a database's backend maps hundreds
    of lines, and an attach asks for the sampler's own several times)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise TargetError(f"process {pid} exited") from exc
    except PermissionError as exc:
        raise TargetError(f"no permission to read /proc/{pid}/maps (heapscope needs root)", 4) from exc
    if keep is not None:
        text = "\n".join(line for line in text.splitlines() if keep(line))
    return parse_maps_full(text)


def _library_lines(pid: int, library: Path) -> list[MapsEntry]:
    """The mappings of `library` in process `pid`: by device and inode (a path seen differently from inside a
    container still matches), or by the name of the memfd it was handed over in (agent.process.inject)."""
    known = _known_lines.get(str(library))
    if known and _still_mapped(pid, known):
        return list(known)
    st = os.stat(library)
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    memfd = f"/memfd:{library.name}"
    inode = f" {st.st_ino} "
    lines = [m for m in read_map_lines(pid, keep=lambda line: inode in line or memfd in line)
             if (*m.device, m.inode) == wanted or m.path in (memfd, memfd + " (deleted)")]
    if lines:
        _known_lines[str(library)] = tuple(lines)
    return lines


# The library's mappings as last found, by its path. An attach asks where the library is some eight times, and a
# forked child (a backend, a prefork worker) has it where its parent had it: one stat a mapping checks them, where
# reading a database backend's maps again took a third of a millisecond.
_known_lines: dict[str, tuple[MapsEntry, ...]] = {}


def _still_mapped(pid: int, lines: tuple[MapsEntry, ...]) -> bool:
    """Each of `lines` is a mapping of process `pid`, of the same file (its exec or exit ends them)."""
    for m in lines:
        try:
            st = os.stat(f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}")
        except OSError:
            return False
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) != (*m.device, m.inode):
            return False
    return True


def mapped_base(pid: int, library: Path) -> int | None:
    """Load address of `library` in process `pid`, or None when it is not loaded."""
    return next((m.start for m in _library_lines(pid, library) if m.offset == 0), None)


def library_range(pid: int, library: Path) -> tuple[int, int] | None:
    """[lowest start, highest end) of the mappings of `library` in process `pid`, or None."""
    spans = [(m.start, m.end) for m in _library_lines(pid, library)]
    if not spans:
        return None
    return min(lo for lo, _ in spans), max(hi for _, hi in spans)


def loaded_file(pid: int, library: Path) -> str:
    """The file the kernel's uprobes go on for `library` as process `pid` has it mapped: the library itself,
    or, when it was handed over in a memfd (another inode), that memfd through /proc/PID/map_files."""
    lines = _library_lines(pid, library)
    memfd = next((m for m in lines if m.path.startswith("/memfd:")), None)
    return str(library) if memfd is None else f"/proc/{pid}/map_files/{memfd.start:x}-{memfd.end:x}"


def probe_points(library: Path, loaded_as: str | None = None) -> list[ProbePoint]:
    """The uprobes of sampled mode: hs_sample_alloc(ptr, size, weight, fn) and hs_sample_free(ptr), each on the
    5-byte nop it starts with (no trap on Linux 6.18: its uprobe runs through a trampoline). `loaded_as`: the
    file they go on, where it is not the library's path (loaded_file)."""
    obj = open_elf(str(library))
    points = []
    for name, kind, regs in (("hs_sample_alloc", "sample_alloc", ("rdi", "rsi", "rdx", "rcx")),
                             ("hs_sample_free", "sample_free", ("rdi",))):  # fmt: skip
        found = obj.find_symbol(name)
        if found is None:
            raise EnvironmentProblem(f"{library} has no symbol {name}: not a heapscope sampler")
        placement = choose_offset(obj.code_bytes(found[0], 16), regs)
        offset = obj.vaddr_to_file_offset(found[0] + placement.offset)
        points.append(ProbePoint(name, kind, loaded_as or str(library), found[0], offset, placement))
    return points


CALL_OPCODE = 0xE8  # call rel32: how the kernel's optimized uprobe reaches its trampoline
TRAMPOLINE_MAPPING = "[uprobes-trampoline]"


def stale_probe_code(found: bytes, own: bytes, address: int, trampolines: Sequence[tuple[int, int]]) -> bool:
    """Whether the code a process holds at a probe function (`found`, where the library has `own`) is left over
    from another process's uprobe: its last four bytes are not the library's, and it is not a call into a
    trampoline this process has. A forked child inherits its parent's optimized uprobe (`e8` and a call's offset)
    but not the trampoline page; calling it faults, and the kernel, taking a probe that trapped on top of it off
    again, restores the first byte only (`0f` and the call's offset: an invalid instruction). An int3 on the
    library's own bytes (a probe not optimized yet) is not stale."""
    if found[1:] == own[1:]:
        return False
    if found[0] == CALL_OPCODE:
        target = address + len(found) + int.from_bytes(found[1:5], "little", signed=True)
        return not any(lo <= target < hi for lo, hi in trampolines)
    return True


def mend_probe_code(pid: int, library: Path) -> list[str]:
    """Put the library's own bytes back at each probe function whose code in process `pid` is stale
    (stale_probe_code), before heapscope's probes go on it: the kernel then installs, optimizes and, however
    heapscope ends, removes them cleanly. Only while no thread of the process can run these functions: its sampler
    disarmed, or armed since its fork and not claimed (it reports no sample). The names of those mended."""
    base = mapped_base(pid, library)
    if base is None:
        return []
    elf = open_elf(str(library))
    trampolines = [(m.start, m.end) for m in read_map_lines(pid, keep=lambda line: TRAMPOLINE_MAPPING in line)]
    mended = []
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    except OSError as exc:
        raise TargetError(f"cannot open the memory of process {pid}: {exc.strerror}") from exc
    try:
        for name in PROBE_FUNCTIONS:
            vaddr = symbol_value(library, name)
            own = elf.code_bytes(vaddr, 5)
            found = os.pread(mem, len(own), base + vaddr)
            if len(found) == len(own) and stale_probe_code(found, own, base + vaddr, trampolines):
                os.pwrite(mem, own, base + vaddr)
                mended.append(name)
    except OSError as exc:
        raise TargetError(f"process {pid}: cannot put back its sampler's probe functions: {exc.strerror}") from exc
    finally:
        os.close(mem)
    return mended


KEPT_SINGLE_SYMBOL = "hs_kept_single_threaded"  # set where the library kept a single-threaded process so


def symbol_value(library: Path, name: str) -> int:
    found = open_elf(str(library)).find_symbol(name)
    if found is None:
        raise EnvironmentProblem(f"{library} has no symbol {name}: not a heapscope sampler")
    return found[0]


# ---- the control block ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControlState:
    fields: dict[str, int]

    def __getitem__(self, name: str) -> int:
        return self.fields[name]

    @property
    def state(self) -> str:
        return STATE_NAMES.get(self.fields["state"], str(self.fields["state"]))

    @property
    def disarm_reason(self) -> str:
        return DISARM_REASONS.get(self.fields["disarm_reason"], str(self.fields["disarm_reason"]))

    @property
    def threadless(self) -> bool:
        """No control thread: idle as "threadless", or armed with no control thread's id."""
        return self.state == "threadless" or (self.state == "armed" and self.fields["control_tid"] == 0)


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    got = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise TargetError(f"pidfd_getfd of the sampler's lease failed: {os.strerror(err)}")
    return int(got)


class HeldLeases:
    """The write ends of the leases this heapscope holds, by the pipe's inode, each with how many samplers it keeps
    armed: a parent's, and those of its children forked while it was armed, which watch the same pipe. The pipe is
    closed when the last of them lets go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, list[int]] = {}  # inode -> [descriptor, users]

    def hold(self, ino: int, fd: int) -> int:
        """A lease just taken: the descriptor that stands for it. A second descriptor of a pipe held already (its
        inode cannot be another pipe's while one is open) only counts one user more."""
        with self._lock:
            entry = self._held.get(ino)
            if entry is None:
                self._held[ino] = [fd, 1]
                return fd
            entry[1] += 1
        os.close(fd)
        return entry[0]

    def share(self, ino: int) -> int | None:
        """One user more of a lease held: its descriptor; None if this heapscope does not hold it."""
        with self._lock:
            entry = self._held.get(ino)
            if entry is None:
                return None
            entry[1] += 1
            return entry[0]

    def holds(self, ino: int) -> bool:
        with self._lock:
            return ino in self._held

    def release(self, ino: int) -> None:
        """One user fewer; the last one closes the pipe (every sampler on it lets go)."""
        with self._lock:
            entry = self._held.get(ino)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._held[ino]
        os.close(entry[0])


LEASES = HeldLeases()


# A threadless sampler's request, made by calling into the process: (request, argument) -> result (-errno).
SamplerCall = Callable[[int, int], int]


class SamplerControl:
    """The sampler loaded in one process. Holding the lease (after arm()) keeps it armed; close() or the
    end of this process lets it go inert. `call` makes a threadless sampler's requests (none: such a sampler
    cannot be armed from here)."""

    def __init__(self, pid: int, library: Path, timeout: float = 3.0, call: SamplerCall | None = None) -> None:
        self.pid = pid
        self.library = library
        self.timeout = timeout
        self._call = call
        self.threadless = False  # armed by calls (known from arm() on)
        self.inherited = False  # armed since its fork, on its parent's lease (known from arm() on)
        base = mapped_base(pid, library)
        if base is None:
            raise TargetError(f"the sampler is not loaded in process {pid}")
        self.address = base + symbol_value(library, CONTROL_SYMBOL)
        self.base = base
        try:
            self._mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        except OSError as exc:
            raise TargetError(f"cannot open the memory of process {pid}: {exc.strerror}") from exc
        self._lease: int | None = None
        self._lease_ino = 0

    def read(self) -> ControlState:
        raw = os.pread(self._mem, CONTROL_SIZE, self.address)
        if len(raw) != CONTROL_SIZE:
            raise TargetError(f"process {self.pid}: short read of the sampler's control block")
        values = struct.unpack(CONTROL_FORMAT, raw)
        return ControlState({name: v for (name, _), v in zip(CONTROL_FIELDS, values, strict=True)})

    def kept_single(self) -> bool:
        """The library kept a single-threaded process so (no control thread: hs_sampler.c
        single_threaded_program); False for a library without the mark."""
        found = open_elf(str(self.library)).find_symbol(KEPT_SINGLE_SYMBOL)
        return found is not None and os.pread(self._mem, 4, self.base + found[0]) != bytes(4)

    def set_budget(self, max_samples: int) -> None:
        """The budget of an armed sampler, moved: read at its next sample (its rate in force follows when its
        window closes). A daemon shares its total among its targets so (agent.model.sampling.share_level)."""
        self._write("max_samples", max_samples)

    def _write(self, name: str, value: int) -> None:
        fmt = "<" + dict(CONTROL_FIELDS)[name]
        os.pwrite(self._mem, struct.pack(fmt, value), self.address + OFFSETS[name])

    def wait_ready(self) -> ControlState:
        """Wait for the control thread to start (just after the library is loaded)."""
        deadline = time.monotonic() + self.timeout
        while True:
            st = self.read()
            if (st["magic"] != MAGIC or st["version"] != VERSION) and time.monotonic() <= deadline:
                # `run`: the loader maps the library's first segment, then its data over a reserved span: a
                # control block read in between is not there yet.
                time.sleep(0.001)
                continue
            if st["magic"] != MAGIC or st["version"] != VERSION:
                raise TargetError(f"process {self.pid}: the sampler's control block is not version {VERSION}")
            if st.state == "broken":
                raise TargetError(
                    f"process {self.pid}: the sampler loaded in it cannot run (it failed to start, or this process "
                    "is a forked child of one it was loaded in, which has no control thread); use --mode=exact")
            if st.state != "loading" and (st["control_tid"] != 0 or st.threadless):
                return st
            if time.monotonic() > deadline:
                raise TargetError(f"process {self.pid}: the sampler's control thread did not start")
            time.sleep(0.005)

    def _request(self, request: int) -> ControlState:
        st = self.read()
        seq = st["ack_seq"] + 1
        self._write("request", request)
        self._write("request_seq", seq)  # last: the sampler acts on a new sequence number
        self._wake()
        deadline = time.monotonic() + self.timeout
        while True:
            st = self.read()
            if st["ack_seq"] == seq:
                return st
            if time.monotonic() > deadline:
                raise TargetError(f"process {self.pid}: the sampler did not answer within {self.timeout:.0f} s")
            time.sleep(0.005)

    def _wake(self) -> None:
        """A byte into the lease, whose read end an idle sampler's control thread also waits on: it answers now,
        not at its next tick (500 ms idle). Never blocks; a sampler that does not read it (armed, or an older
        build) leaves it in a pipe that goes at its next disarm."""
        if self._lease is None:
            return
        with contextlib.suppress(OSError):  # full (never here), or the sampler gone: its answer says so
            os.write(self._lease, b"\0")

    def arm(self, rate: int, max_samples: int = 0) -> ControlState:
        """Arm at `rate` bytes between samples, with a budget of `max_samples` samples a second (0: none)."""
        if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= MAX_RATE:
            raise UsageError(f"--sample-rate must be a whole number of bytes from 1 to {MAX_RATE}, not {rate!r}")
        st = self.wait_ready()
        if st.state == "armed" and st["forked_armed"] and self._share_lease(st):
            self.threadless = True
            if st["sample_rate"] == rate:
                self.inherited = True
                if not within_budget(st["max_samples"], max_samples):
                    self.set_budget(max_samples)
                    st = self.read()
                return st
            # Armed at its parent's rate, not this profile's: armed again at this one.
            self._disarm_by_call()
            self._release_lease()
            return self._arm_threadless(rate, max_samples)
        if st.threadless:
            return self._arm_threadless(rate, max_samples)
        if st.state == "armed":
            raise TargetError(f"process {self.pid}: its sampler is already armed by another heapscope")
        if st["lease_fd"] < 0:
            raise TargetError(f"process {self.pid}: the sampler has no lease to give (held by another heapscope)")
        self._take_lease(st)
        self._write("max_samples", max_samples)  # read by the arm
        self._write("sample_rate", rate)
        st = self._request(REQ_ARM)
        if st["result"] != 0:
            self.close()
            raise TargetError(f"process {self.pid}: the sampler refused to arm: {os.strerror(-st['result'])}")
        return st

    def _arm_threadless(self, rate: int, max_samples: int) -> ControlState:
        """Arm by calls: a fresh lease (the last heapscope's lost, if it ended armed), taken; then the arming."""
        if self._call is None:
            raise TargetError(f"process {self.pid}: its sampler has no control thread and is armed only by calls")
        self.threadless = True
        lease = self._call(REQ_LEASE, 0)
        if lease == -errno.EBUSY:
            raise TargetError(f"process {self.pid}: its sampler is already armed by another heapscope")
        if lease < 0:
            raise TargetError(f"process {self.pid}: the sampler has no lease to give: {os.strerror(-lease)}")
        self._take_lease(self.read())
        self._write("max_samples", max_samples)  # read by the arm
        result = self._call(REQ_ARM, rate)
        if result != 0:
            self.close()
            raise TargetError(f"process {self.pid}: the sampler refused to arm: {os.strerror(-result)}")
        return self.read()

    def rescan(self) -> None:
        """Threadless: patch the objects loaded since arming (the control thread's own poll elsewhere)."""
        if self._call is not None and self.threadless:
            self._call(REQ_RESCAN, 0)

    def _share_lease(self, st: ControlState) -> bool:
        """A child forked while its parent was armed under a lease this heapscope holds: a share of it, and the
        child claimed (another heapscope's LEASE call no longer takes it over)."""
        if self._call is None:
            return False  # requests to it are calls, which this control cannot make
        fd = LEASES.share(st["lease_ino"])
        if fd is None:
            return False
        self._lease, self._lease_ino = fd, st["lease_ino"]
        self._write("forked_armed", FORKED_CLAIMED)
        now = self.read()
        if now.state != "armed" or now["lease_ino"] != st["lease_ino"]:  # taken over meanwhile
            self._release_lease()
            return False
        return True

    @property
    def lease_ino(self) -> int:
        """The inode of the lease this control holds a share of (0: none)."""
        return self._lease_ino if self._lease is not None else 0

    def _release_lease(self) -> None:
        if self._lease is not None:
            self._lease = None
            LEASES.release(self._lease_ino)

    def _take_lease(self, st: ControlState) -> None:
        """A duplicate of the lease's write end, from then on the only one once the sampler arms."""
        pidfd = os.pidfd_open(self.pid)
        try:
            lease = _pidfd_getfd(pidfd, st["lease_fd"])
        finally:
            os.close(pidfd)
        fst = os.fstat(lease)
        if not stat.S_ISFIFO(fst.st_mode) or fst.st_ino != st["lease_ino"]:
            os.close(lease)  # the program reused that descriptor number: not our pipe
            raise TargetError(f"process {self.pid}: the sampler's lease descriptor was taken over by the program")
        os.set_blocking(lease, False)  # its only write is _wake's, which must never wait
        self._lease, self._lease_ino = LEASES.hold(fst.st_ino, lease), fst.st_ino

    def count_table(self) -> bytes:
        """The per-thread counts since arming as the sampler keeps them (struct hs_counts a slot: read it with
        thread_calls_of or calls_total_of). One read of the used slots, nothing parsed: the daemon looks at
        every look, and a thread-per-connection server fills all 16,384 slots."""
        st = self.read()
        used = min(st["counts_used"], COUNT_SLOTS)
        raw = os.pread(self._mem, used * COUNTS.size, st["counts_address"]) if used else b""
        return raw[: len(raw) // COUNTS.size * COUNTS.size]

    def thread_calls(self) -> list[ThreadCalls]:
        """Exact counts since arming, one entry per thread slot (agent.model.callcounts)."""
        return thread_calls_of(self.count_table())

    def counts(self) -> dict[str, int]:
        """Exact counts since arming, all threads together: allocs, frees, alloc_bytes."""
        t = calls_total_of(self.count_table())
        return {"allocs": t.allocs, "frees": t.frees, "alloc_bytes": t.alloc_bytes}

    def disarm(self) -> ControlState:
        st = self._disarm_by_call() if self.threadless and self._call is not None else self._request(REQ_DISARM)
        self.close()
        return st

    def _disarm_by_call(self) -> ControlState:
        assert self._call is not None
        result = self._call(REQ_DISARM, 0)
        st = self.read()
        if result != 0:
            raise TargetError(f"process {self.pid}: the sampler refused to disarm: {os.strerror(-result)}")
        return st

    def descriptors(self) -> str:
        """What this control's descriptors are now (for a failed read: one taken over shows what took it)."""
        out = []
        for name, fd in (("memory", self._mem), ("lease", self._lease)):
            try:
                what = os.readlink(f"/proc/self/fd/{fd}") if fd is not None and fd >= 0 else "closed by us"
            except OSError as exc:
                what = exc.strerror or "unreadable"
            out.append(f"{name} fd {fd}: {what}")
        return ", ".join(out)

    def close(self) -> None:
        self._release_lease()
        if self._mem >= 0:
            os.close(self._mem)
            self._mem = -1
