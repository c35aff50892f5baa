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
from dataclasses import dataclass, field
from functools import lru_cache

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

from agent.errors import TargetError
from agent.placement import Placement, choose_offset

# Allocation functions: symbol -> (probe kind in heap.bpf.c, argument registers the probe reads).
# Kinds: malloc|calloc|realloc|memalign|posix_memalign|valloc|pvalloc|reallocarray (need a return probe),
# free (entry only).
ALLOC_FUNCTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "malloc": ("malloc", ("rdi",)),
    "calloc": ("calloc", ("rdi", "rsi")),
    "realloc": ("realloc", ("rdi", "rsi")),
    "reallocarray": ("reallocarray", ("rdi", "rsi", "rdx")),
    "memalign": ("memalign", ("rdi", "rsi")),
    "aligned_alloc": ("memalign", ("rdi", "rsi")),
    "posix_memalign": ("posix_memalign", ("rdi", "rsi", "rdx")),
    "valloc": ("valloc", ("rdi",)),
    "pvalloc": ("pvalloc", ("rdi",)),
    "free": ("free", ("rdi",)),
    "cfree": ("free", ("rdi",)),
}
# C++ operators, probed only when the allocator itself defines them (tcmalloc, jemalloc's C++ build); the
# ones in libstdc++ call malloc and free, which are probed already.
CXX_OPERATORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_Znwm": ("malloc", ("rdi",)),
    "_Znam": ("malloc", ("rdi",)),
    "_ZnwmRKSt9nothrow_t": ("malloc", ("rdi",)),
    "_ZnamRKSt9nothrow_t": ("malloc", ("rdi",)),
    "_ZdlPv": ("free", ("rdi",)),
    "_ZdaPv": ("free", ("rdi",)),
    "_ZdlPvm": ("free", ("rdi",)),
    "_ZdaPvm": ("free", ("rdi",)),
}

# Not an allocation function: `run` stops the target at exit() to record its mappings before they go.
EXIT_FUNCTION = "exit"

_FAMILIES = (("jemalloc", "jemalloc"), ("tcmalloc", "tcmalloc"), ("mimalloc", "mimalloc"), ("libc.so", "glibc"))

_DEFAULT_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")


@dataclass(frozen=True)
class Mapping:
    """One file-backed line of /proc/PID/maps."""

    start: int
    end: int
    offset: int
    path: str
    perms: str = "r-xp"


_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) ([0-9a-f]+) \S+ (\d+)\s*(.*)$")


def parse_maps(text: str) -> list[Mapping]:
    """File-backed mappings of a /proc/PID/maps text (pseudo entries like [heap] are left out)."""
    out = []
    for line in text.splitlines():
        m = _MAPS_LINE.match(line)
        if not m or not m.group(6).startswith("/") or m.group(5) == "0":
            continue
        path = m.group(6).removesuffix(" (deleted)")
        out.append(Mapping(int(m.group(1), 16), int(m.group(2), 16), int(m.group(4), 16), path, m.group(3)))
    return out


@dataclass
class ElfFacts:
    """What discovery needs of one ELF object."""

    path: str
    is_dynamic: bool  # has PT_INTERP or a dynamic section
    soname: str | None
    needed: list[str]
    search_dirs: list[str]  # DT_RPATH/DT_RUNPATH with $ORIGIN expanded
    defined: dict[str, int] = field(default_factory=dict)  # function symbol -> st_value (defined ones only)

    def file_offset(self, vaddr: int) -> int:
        with open(self.path, "rb") as f:
            elf = ELFFile(f)
            for seg in elf.iter_segments("PT_LOAD"):
                if seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
                    return int(vaddr - seg["p_vaddr"] + seg["p_offset"])
        raise TargetError(f"address 0x{vaddr:x} is not in a loadable segment of {self.path}")

    def code(self, vaddr: int, size: int = 64) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.file_offset(vaddr))
            return f.read(size)


_WANTED = frozenset(ALLOC_FUNCTIONS) | frozenset(CXX_OPERATORS) | {EXIT_FUNCTION}


@lru_cache(maxsize=256)
def elf_facts(path: str) -> ElfFacts:
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            facts = ElfFacts(path, False, None, [], [])
            facts.is_dynamic = elf.get_section_by_name(".dynamic") is not None
            origin = os.path.dirname(path)
            for sec in elf.iter_sections():
                if isinstance(sec, DynamicSection):
                    for tag in sec.iter_tags():
                        if tag.entry.d_tag == "DT_NEEDED":
                            facts.needed.append(tag.needed)
                        elif tag.entry.d_tag == "DT_SONAME":
                            facts.soname = tag.soname
                        elif tag.entry.d_tag in ("DT_RPATH", "DT_RUNPATH"):
                            value = tag.rpath if tag.entry.d_tag == "DT_RPATH" else tag.runpath
                            facts.search_dirs += [d.replace("$ORIGIN", origin) for d in value.split(":") if d]
            # A static executable has only .symtab; a dynamic object exports through .dynsym.
            names = (".dynsym",) if facts.is_dynamic else (".symtab",)
            for name in names:
                symtab = elf.get_section_by_name(name)
                if symtab is None:
                    continue
                for sym in symtab.iter_symbols():
                    if (
                        sym.name in _WANTED
                        and sym["st_shndx"] != "SHN_UNDEF"
                        and sym["st_info"]["type"] in ("STT_FUNC", "STT_GNU_IFUNC")
                        and sym["st_value"]
                    ):
                        facts.defined.setdefault(sym.name, sym["st_value"])
            return facts
    except (OSError, ELFError) as exc:
        raise TargetError(f"cannot read {path}: {exc}") from exc


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
    """Objects in symbol-lookup order: executable, LD_PRELOAD, then DT_NEEDED breadth-first."""
    exe_facts = elf_facts(exe)
    order = [exe_facts]
    seen = {os.path.realpath(exe)}
    queue: deque[tuple[str, ElfFacts]] = deque((p, exe_facts) for p in preload)
    queue.extend((n, exe_facts) for n in exe_facts.needed)
    while queue:
        name, parent = queue.popleft()
        path = find(name, parent)
        if path is None or os.path.realpath(path) in seen:
            continue
        seen.add(os.path.realpath(path))
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
    kind: str  # probe kind, see ALLOC_FUNCTIONS
    path: str  # the ELF object (as opened by us: may be under /proc/PID/root)
    vaddr: int  # symbol value in the object
    file_offset: int  # of the probed instruction: what the kernel's uprobe API takes
    placement: Placement


@dataclass(frozen=True)
class Allocator:
    family: str  # glibc, jemalloc, tcmalloc, mimalloc, static, or the object's name
    path: str  # the object that provides malloc
    probes: tuple[ProbePoint, ...]
    exit_probe: ProbePoint | None = None  # libc's exit(), for `run`

    def describe(self) -> list[str]:
        lines = [f"allocator: {self.family} ({self.path})"]
        for p in self.probes:
            where = os.path.basename(p.path)
            lines.append(f"  probe {p.symbol}@{where}+{p.placement.offset}: {p.placement.reason}")
        return lines


def _family(path: str, is_exe: bool, is_dynamic: bool) -> str:
    base = os.path.basename(path)
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
    seen_addresses: set[tuple[str, int]] = set()
    wanted = list(ALLOC_FUNCTIONS.items()) + [
        (name, spec) for name, spec in CXX_OPERATORS.items() if name in provider.defined
    ]
    for name, (kind, regs) in wanted:
        owner = next((o for o in order if name in o.defined), None)
        if owner is None:
            continue
        key = (os.path.realpath(owner.path), owner.defined[name])
        if key in seen_addresses:  # aliases (aligned_alloc = memalign): one probe serves both
            continue
        seen_addresses.add(key)
        probes.append(_probe_point(owner, name, kind, regs))
    exit_owner = next((o for o in order if EXIT_FUNCTION in o.defined), None)
    exit_probe = _probe_point(exit_owner, EXIT_FUNCTION, "exit", ()) if exit_owner else None
    family = _family(provider.path, provider is order[0], provider.is_dynamic)
    return Allocator(family, provider.path, tuple(probes), exit_probe)


def _probe_point(owner: ElfFacts, name: str, kind: str, regs: tuple[str, ...]) -> ProbePoint:
    vaddr = owner.defined[name]
    placement = choose_offset(owner.code(vaddr), regs)
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
            environ = dict(
                e.decode(errors="replace").split("=", 1) for e in f.read().split(b"\0") if b"=" in e
            )
    except PermissionError as exc:
        raise TargetError(f"no permission to read process {pid} (heapscope needs root): {exc}", 4) from exc
    except FileNotFoundError as exc:
        raise TargetError(f"process {pid} exited or is a kernel thread") from exc
    exe_link = exe_link.removesuffix(" (deleted)")
    return ProcessInfo(pid, f"{proc}/{pid}/root{exe_link}", cmdline, environ)


def read_maps(pid: int, proc: str = "/proc") -> list[Mapping]:
    try:
        with open(f"{proc}/{pid}/maps") as f:
            return parse_maps(f.read())
    except FileNotFoundError as exc:
        raise TargetError(f"process {pid} exited") from exc
    except PermissionError as exc:
        raise TargetError(f"no permission to read /proc/{pid}/maps (heapscope needs root)", 4) from exc


def allocator_of_process(pid: int, proc: str = "/proc") -> Allocator:
    """The allocator a running process uses, from the objects it has mapped."""
    info = read_process(pid, proc)
    root = f"{proc}/{pid}/root"
    preload = [p for p in re.split(r"[ :]", info.environ.get("LD_PRELOAD", "")) if p]
    order = load_order(info.exe, preload, mapped_finder(read_maps(pid, proc), root))
    return resolve_allocator(order)


def allocator_of_program(exe: str, env: dict[str, str]) -> Allocator:
    """The allocator a program will use once started with `env`."""
    preload = [p for p in re.split(r"[ :]", env.get("LD_PRELOAD", "")) if p]
    return resolve_allocator(load_order(exe, preload, library_finder(env)))
