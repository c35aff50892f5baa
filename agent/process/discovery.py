"""Discovery: the target process, its mappings, and the allocator it really uses.

Reads an injectable /proc root so that tests can point it at a fake tree. No bcc here.
The allocator is resolved the way the dynamic linker would for that process: the executable first, then
LD_PRELOAD objects, then DT_NEEDED libraries breadth-first; the first object that defines a function wins.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.segments import InterpSegment

from agent.errors import TargetError
from agent.model.functions import ALLOC_FUNCTIONS, ENTRY_ONLY_KINDS
from agent.model.maps import Mapping, parse_maps, parse_maps_full
from agent.process.recent import RecentAnswers
from agent.process.view import ProcessView
from agent.symbols.elf import ElfError, ElfObject, FileCache, NotElfError, file_identity, open_elf
from agent.symbols.placement import Placement, choose_offset

# Not allocation functions: `run` stops the target at exit() to record its mappings before they go, and
# the loader calls its debugger hook after every change to the loaded objects (new unwind tables).
EXIT_FUNCTION = "exit"
LOADER_HOOK = "_dl_debug_state"
# Probe kinds that are no allocation call: exit(), the loader's hook, and sampled mode's probe functions.
HOOK_KINDS = frozenset({"exit", "loader", "sample_alloc", "sample_free"})

_FAMILIES = (
    ("jemalloc", "jemalloc"), ("tcmalloc", "tcmalloc"), ("mimalloc", "mimalloc"),
    ("musl", "musl"),  # before libc.so: musl's libc is also named so
    ("libc.so", "glibc"),
)  # fmt: skip

def is_glibc_name(name: str) -> bool:
    """glibc's libc by its file name: libc.so.6, or libc-2.31.so as glibc before 2.34 named the file."""
    return name.startswith("libc.so") or re.fullmatch(r"libc-2\.\d+\.so", name) is not None


def is_libc_name(name: str) -> bool:
    """A libc by its file name: glibc's, or musl's (its loader, ld-musl-ARCH.so.1; libc.musl-ARCH.so.1 on
    Alpine)."""
    return is_glibc_name(name) or name.startswith(("ld-musl", "libc.musl"))


_DEFAULT_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")


@dataclass
class ElfFacts:
    """What discovery needs of one ELF object: its dynamic section and the functions it defines."""

    obj: ElfObject
    is_dynamic: bool  # has a dynamic section: exports through .dynsym
    soname: str | None = None
    needed: list[str] = field(default_factory=list)
    rpath: list[str] = field(default_factory=list)  # DT_RPATH/DT_RUNPATH as written ($ORIGIN not expanded)
    defined: dict[str, int] = field(default_factory=dict)  # wanted function -> st_value (defined ones)
    interp: str | None = None  # PT_INTERP: the program's loader (musl's is also its libc)

    @property
    def path(self) -> str:
        return self.obj.path

    @property
    def search_dirs(self) -> list[str]:
        """DT_RPATH/DT_RUNPATH with $ORIGIN expanded for this path (one file is read through many roots)."""
        origin = os.path.dirname(self.path)
        return [d.replace("$ORIGIN", origin) for d in self.rpath]

    def file_offset(self, vaddr: int) -> int:
        try:
            return self.obj.vaddr_to_file_offset(vaddr)
        except ValueError as exc:
            raise TargetError(f"address 0x{vaddr:x} is not in a loadable segment of {self.path}") from exc


_WANTED = frozenset(f.symbol for f in ALLOC_FUNCTIONS) | {EXIT_FUNCTION, LOADER_HOOK}


def elf_facts(path: str) -> ElfFacts:
    """The ElfFacts of a file, read once while the file stays the same, whatever path (each process's own
    /proc/PID/root) it is reached by."""
    try:
        return _facts.get(path)
    except ElfError as exc:
        raise TargetError(f"cannot read {path}: {exc}") from exc


def _read_facts(path: str) -> ElfFacts:
    try:
        obj = open_elf(path)
        f, elf = obj.open_elffile()
        with f:
            dynamic = elf.get_section_by_name(".dynamic")
            facts = ElfFacts(obj, isinstance(dynamic, DynamicSection))
            for seg in elf.iter_segments():
                if isinstance(seg, InterpSegment):
                    facts.interp = seg.get_interp_name()
            if isinstance(dynamic, DynamicSection):
                for tag in dynamic.iter_tags():
                    kind, value = tag.entry.d_tag, vars(tag)  # pyelftools sets .needed etc. per tag
                    if kind == "DT_NEEDED":
                        facts.needed.append(value["needed"])
                    elif kind == "DT_SONAME":
                        facts.soname = value["soname"]
                    elif kind in ("DT_RPATH", "DT_RUNPATH"):
                        dirs = value["rpath" if kind == "DT_RPATH" else "runpath"]
                        facts.rpath += [d for d in dirs.split(":") if d]
    except NotElfError:
        raise  # remembered with the file (elf_facts says it as any other)
    except (OSError, ElfError, ELFError) as exc:
        raise TargetError(f"cannot read {path}: {exc}") from exc
    # A dynamic object exports through .dynsym only; a static executable has just .symtab.
    for sym in obj.dynsym if facts.is_dynamic else obj.symtab:
        if sym.name in _WANTED and sym.is_defined and sym.is_function and sym.value:
            facts.defined.setdefault(sym.name, sym.value)
    return facts


# A mapped data file (a locale, a database's shared memory) is remembered as not ELF: each process maps a dozen.
_facts: FileCache[ElfFacts] = FileCache(
    _read_facts, lambda facts, path: replace(facts, obj=open_elf(path)), remembered=(NotElfError,)
)


@lru_cache(maxsize=1)
def _ld_cache() -> dict[str, str]:
    """soname -> path from the dynamic linker's cache (`ldconfig -p`)."""
    try:
        text = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\S+) \((libc6,x86-64[^)]*)\) => (\S+)", line)
        if m:
            out.setdefault(m.group(1), m.group(3))
    return out


def library_finder(env: dict[str, str], root: str = "") -> Callable[[str, ElfFacts], str | None]:
    """Find a DT_NEEDED library on disk as the loader would (RPATH/RUNPATH, LD_LIBRARY_PATH, cache, defaults)."""
    ld_path = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]

    def find(name: str, parent: ElfFacts) -> str | None:
        if "/" in name:
            return root + name if os.path.exists(root + name) else None
        for d in [*parent.search_dirs, *ld_path]:
            cand = os.path.join(d, name)
            if os.path.exists(root + cand):
                return root + cand
        cached = _ld_cache().get(name)
        if cached and os.path.exists(root + cached):
            return root + cached
        for d in _DEFAULT_LIB_DIRS:
            cand = os.path.join(d, name)
            if os.path.exists(root + cand):
                return root + cand
        return None

    return find


def mapped_finder(mappings: Sequence[Mapping], root: str) -> Callable[[str, ElfFacts], str | None]:
    """Find a DT_NEEDED library among the objects a live process has mapped."""
    by_name: dict[str, str] = {}
    for m in mappings:
        by_name.setdefault(os.path.basename(m.path), root + m.path)
    for path in list(by_name.values()):
        try:
            soname = elf_facts(path).soname
        except TargetError:
            continue
        if soname:
            by_name.setdefault(soname, path)

    def find(name: str, parent: ElfFacts) -> str | None:
        return by_name.get(os.path.basename(name))

    return find


def load_order(exe: str, preload: Iterable[str], find: Callable[[str, ElfFacts], str | None]) -> list[ElfFacts]:
    """Objects in symbol-lookup order: executable, LD_PRELOAD, then DT_NEEDED breadth-first; last, the program's
    loader (glibc's defines no malloc; musl's is its libc, which a musl program needs as "libc.so")."""
    exe_facts = elf_facts(exe)
    order = [exe_facts]
    seen = {file_identity(exe)}
    queue: deque[tuple[str, ElfFacts]] = deque((p, exe_facts) for p in preload)
    queue.extend((n, exe_facts) for n in exe_facts.needed)
    if exe_facts.interp:
        queue.append((exe_facts.interp, exe_facts))  # breadth-first: after every DT_NEEDED of the program
    while queue:
        name, parent = queue.popleft()
        path = find(name, parent)
        if path is None:
            continue
        identity = file_identity(path)
        if identity in seen:
            continue
        seen.add(identity)
        try:
            facts = elf_facts(path)
        except TargetError:
            continue
        order.append(facts)
        queue.extend((n, facts) for n in facts.needed)
    return order


@dataclass(frozen=True)
class ProbePoint:
    """One function to probe: where it is on disk and where in it the probe sits."""

    symbol: str
    kind: str  # an allocation function's kind (agent.model.functions), or "exit" / "loader"
    path: str  # the ELF object (as opened by us: may be under /proc/PID/root)
    vaddr: int  # symbol value in the object
    file_offset: int  # of the probed instruction: what the kernel's uprobe API takes
    placement: Placement

    @property
    def needs_return(self) -> bool:
        """An allocation call: the kernel reads its result at the return probe."""
        return self.kind not in ENTRY_ONLY_KINDS and self.kind not in HOOK_KINDS


@dataclass(frozen=True)
class Allocator:
    family: str  # glibc, jemalloc, tcmalloc, mimalloc, static, or the object's name
    path: str  # the object that provides malloc
    probes: tuple[ProbePoint, ...]
    exit_probe: ProbePoint | None = None  # libc's exit(), for `run`
    loader_probe: ProbePoint | None = None  # the dynamic loader's _dl_debug_state

    def points(self, run: bool, heap: bool) -> list[ProbePoint]:
        """The uprobes a profile attaches: the allocation functions (unless `heap` is off: --pages-as-heap
        counts pages, not malloc, as in Massif), exit() under `run`, and the loader's hook."""
        points = list(self.probes) if heap else []
        if run and self.exit_probe is not None:
            points.append(self.exit_probe)
        if self.loader_probe is not None:
            points.append(self.loader_probe)
        return points

    def describe(self) -> list[str]:
        lines = [f"allocator: {self.family} ({self.path})"]
        for p in self.probes:
            where = os.path.basename(p.path)
            lines.append(f"  probe {p.symbol}@{where}+{p.placement.offset}: {p.placement.reason}")
        return lines


def _family(path: str, is_exe: bool, is_dynamic: bool) -> str:
    base = os.path.basename(path)
    if is_glibc_name(base):
        return "glibc"
    for needle, family in _FAMILIES:
        if needle in base:
            return family
    if is_exe and not is_dynamic:
        return "static executable"
    return base


def resolve_allocator(order: Sequence[ElfFacts]) -> Allocator:
    """Each allocation function from the first object in `order` that defines it."""
    provider = next((o for o in order if "malloc" in o.defined), None)
    if provider is None:
        raise TargetError(
            "unknown allocator: no loaded object defines malloc (objects searched: "
            + ", ".join(os.path.basename(o.path) for o in order)
            + ")"
        )
    probes: list[ProbePoint] = []
    seen_addresses: set[tuple[tuple[int, int] | str, int]] = set()
    wanted = [f for f in ALLOC_FUNCTIONS if not f.cxx or f.symbol in provider.defined]
    for f in wanted:
        name = f.symbol
        owner = next((o for o in order if name in o.defined), None)
        if owner is None:
            continue
        key = (file_identity(owner.path), owner.defined[name])
        if key in seen_addresses:  # aliases (aligned_alloc = memalign): one probe serves both
            continue
        seen_addresses.add(key)
        probes.append(_probe_point(owner, name, f.kind, f.registers))
    hooks = []
    for name, kind in ((EXIT_FUNCTION, "exit"), (LOADER_HOOK, "loader")):
        owner = next((o for o in order if name in o.defined), None)
        hooks.append(_probe_point(owner, name, kind, ()) if owner else None)
    family = _family(provider.path, provider is order[0], provider.is_dynamic)
    return Allocator(family, provider.path, tuple(probes), hooks[0], hooks[1])


def _probe_point(owner: ElfFacts, name: str, kind: str, regs: tuple[str, ...]) -> ProbePoint:
    vaddr = owner.defined[name]
    placement = choose_offset(owner.obj.code_bytes(vaddr, 64), regs)
    return ProbePoint(name, kind, owner.path, vaddr, owner.file_offset(vaddr + placement.offset), placement)


# ---- processes ---------------------------------------------------------------------------------------


@dataclass
class ProcessInfo:
    pid: int
    exe: str  # path of the executable as seen from our mount namespace
    cmdline: list[str]
    environ: dict[str, str]


def read_process(pid: int, proc: str = "/proc") -> ProcessInfo:
    base = f"{proc}/{pid}"
    if not os.path.isdir(base):
        raise TargetError(f"no process with PID {pid}")
    try:
        exe_link = os.readlink(f"{base}/exe")
        with open(f"{base}/cmdline", "rb") as f:
            cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"{base}/environ", "rb") as f:
            environ = dict(e.decode(errors="replace").split("=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except PermissionError as exc:
        raise TargetError(f"no permission to read process {pid} (heapscope needs root): {exc}", 4) from exc
    except FileNotFoundError as exc:
        raise TargetError(f"process {pid} exited or is a kernel thread") from exc
    return ProcessInfo(pid, ProcessView.of(pid, proc).through(exe_link.removesuffix(" (deleted)")), cmdline, environ)


def read_maps_text(pid: int, proc: str = "/proc") -> str:
    try:
        with open(f"{proc}/{pid}/maps") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise TargetError(f"process {pid} exited") from exc
    except PermissionError as exc:
        raise TargetError(f"no permission to read /proc/{pid}/maps (heapscope needs root)", 4) from exc


# The allocators of processes looked at lately (finding one again: some 95 objects' facts, 240 stats through
# /proc/PID/root, 2-3 ms), each with the root its paths go through.
_recent_allocators: RecentAnswers[tuple[str, Allocator]] = RecentAnswers()


def allocator_of_process(pid: int, proc: str = "/proc", info: ProcessInfo | None = None) -> Allocator:
    """The allocator a running process uses, from the objects it has mapped. `info`: its read_process, when
    the caller has it."""
    info = info or read_process(pid, proc)
    root = f"{proc}/{pid}/root"
    preload = [p for p in re.split(r"[ :]", info.environ.get("LD_PRELOAD", "")) if p]
    view = ProcessView.of(pid, proc)  # a chroot's maps show the host's paths: made relative to its root
    text = read_maps_text(pid, proc)
    # The same root, program, environment for the loader and mapped code (by device and inode): the same answer,
    # its paths through this process's root. Only code: a backend maps shared memory segments of its own.
    files = {e.path: (e.dev, e.inode) for e in parse_maps_full(text) if e.is_file and "x" in e.perms}
    exe = info.exe.removeprefix(root)  # its path inside its root: not this process's own
    key = (view.root, view.namespace, exe, tuple(preload), info.environ.get("LD_LIBRARY_PATH"), tuple(files.items()))
    known = _recent_allocators.get(key)
    if known is not None:
        return _rerooted(known[1], known[0], root)
    firsts: dict[str, Mapping] = {}  # each file once (it has a mapping a segment), in the maps' order
    for m in parse_maps(text):
        firsts.setdefault(m.path, m)
    mapped = mapped_finder([replace(m, path=view.through(m.path)) for m in firsts.values()], "")
    # Caught at its exec, a process has only its program and the loader mapped: its libraries are found as the
    # loader is about to find them (probes are set on the files, and fire once they are mapped).
    on_disk = library_finder(info.environ, root)
    order = load_order(info.exe, preload, lambda name, parent: mapped(name, parent) or on_disk(name, parent))
    found = resolve_allocator(order)
    _recent_allocators.put(key, (root, found))
    return found


def _rerooted(allocator: Allocator, old: str, new: str) -> Allocator:
    """`allocator`, found through the root `old` (/proc/PID/root of another process), with its paths through
    `new`: the other process may be gone."""
    if old == new:
        return allocator

    def path(p: str) -> str:
        return new + p[len(old) :] if p.startswith(old + "/") else p

    def point(p: ProbePoint | None) -> ProbePoint | None:
        return None if p is None else replace(p, path=path(p.path))

    return replace(
        allocator,
        path=path(allocator.path),
        probes=tuple(replace(p, path=path(p.path)) for p in allocator.probes),
        exit_probe=point(allocator.exit_probe),
        loader_probe=point(allocator.loader_probe),
    )


def allocator_of_program(exe: str, env: dict[str, str]) -> Allocator:
    """The allocator a program will use once started with `env`."""
    preload = [p for p in re.split(r"[ :]", env.get("LD_PRELOAD", "")) if p]
    return resolve_allocator(load_order(exe, preload, library_finder(env)))
