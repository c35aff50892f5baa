"""Symbolizer tests. Judges: Valgrind's Massif labels, addr2line, nm/readelf; no root needed.

The test programs copy /proc/self/maps at the end of main. Run under Valgrind, that copy is the layout
Valgrind chose, so every address Massif printed can be symbolized by us afterwards (the process is gone by
then) and compared with Massif's label, address included.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.model.maps import Mapping, parse_maps
from agent.model.stack import Frame
from agent.symbols import symbolizer as symbolizer_module
from agent.symbols.debugfiles import find_debug_file
from agent.symbols.elf import ElfObject, ElfSymbol, open_elf
from agent.symbols.names import BELOW_MAIN, SymbolTable, demangle, display_function_name
from agent.symbols.symbolizer import Symbolizer

PROGRAMS = Path(__file__).parent / "programs"
LIBC = "/lib/x86_64-linux-gnu/libc.so.6"


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, cwd=cwd).stdout


# ----------------------------------------------------------------------------------------------------------
# Building the test programs


CFLAGS = ["-g", "-fno-omit-frame-pointer"]
BUILDS: dict[str, tuple[str, list[str]]] = {
    "c_O0": ("inline_chain.c", ["-O0"]),
    "c_O2": ("inline_chain.c", ["-O2"]),
    "c_O2_nopie": ("inline_chain.c", ["-O2", "-fno-pie", "-no-pie"]),
    "cpp_O0": ("containers.cpp", ["-O0"]),
    "cpp_O2": ("containers.cpp", ["-O2"]),
    "c_O2_dwarf4": ("inline_chain.c", ["-O2", "-gdwarf-4"]),  # gcc 12 defaults to DWARF 5
    "cpp_O2_dwarf4": ("containers.cpp", ["-O2", "-gdwarf-4"]),
    "uses_lib": ("uses_lib.c", ["-O0"]),
}


class Toolbox:
    """Compiles each test program once per module, and runs Massif on it once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}
        self._massif: dict[str, tuple[str, list[Mapping]]] = {}

    def lib(self) -> Path:
        out = self.root / "libstripped.so"
        if not out.exists():
            run("gcc", *CFLAGS, "-O1", "-fPIC", "-shared", "-o", out, PROGRAMS / "stripped_lib.c")
            run("strip", "--strip-all", out)
        return out

    def build(self, name: str) -> Path:
        if name in self._built:
            return self._built[name]
        source, flags = BUILDS[name]
        out = self.root / name
        compiler = "g++" if source.endswith(".cpp") else "gcc"
        extra: list[str | Path] = []
        if name == "uses_lib":
            lib = self.lib()
            extra = [f"-L{lib.parent}", "-lstripped", f"-Wl,-rpath,{lib.parent}"]
        run(compiler, *CFLAGS, *flags, "-I", PROGRAMS, "-o", out, PROGRAMS / source, *extra)
        self._built[name] = out
        return out

    def massif(self, name: str) -> tuple[str, list[Mapping]]:
        """massif.out text and the mappings the program saw under Valgrind."""
        if name not in self._massif:
            exe = self.build(name)
            out = self.root / f"{name}.massif"
            maps = self.root / f"{name}.vgmaps"
            run(
                "valgrind", "--tool=massif", "--time-unit=B", "--threshold=0.0", "--peak-inaccuracy=0.0",
                "--detailed-freq=1", f"--massif-out-file={out}", exe, maps,
            )  # fmt: skip
            self._massif[name] = (out.read_text(), parse_maps(maps.read_text()))
        return self._massif[name]

    def native(self, name: str) -> tuple[list[Mapping], dict[str, int]]:
        """Run natively: the mappings and the addresses the program recorded (return addresses etc.)."""
        exe = self.build(name)
        maps = self.root / f"{name}.maps"
        addrs = self.root / f"{name}.addrs"
        run(exe, maps, addrs)
        recorded = {}
        for line in addrs.read_text().splitlines():
            tag, value = line.split()
            recorded[tag] = int(value, 16)
        return parse_maps(maps.read_text()), recorded


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> Toolbox:
    return Toolbox(tmp_path_factory.mktemp("symprogs"))


@pytest.fixture(scope="module")
def symbolizer() -> Iterator[Symbolizer]:
    with Symbolizer() as sym:
        yield sym


# ----------------------------------------------------------------------------------------------------------
# Reading Massif's trees


NODE = re.compile(r"^( *)n\d+: \d+ (.*)$")


def massif_frame_groups(text: str) -> set[tuple[str, ...]]:
    """Every run of consecutive frames at one address along a tree path: Massif's frames for one address,
    innermost inlined function first."""
    groups: set[tuple[str, ...]] = set()
    path: list[str] = []
    for line in text.splitlines():
        m = NODE.match(line)
        if not m:
            continue
        depth = len(m.group(1))
        del path[depth:]
        path.append(m.group(2))
        if depth == 0:
            continue
        groups.update(_split_by_address(path[1:]))
    # A run cut short (a prefix of a longer one at the same address) is not a complete answer.
    return {g for g in groups if not any(len(h) > len(g) and h[: len(g)] == g for h in groups)}


def _split_by_address(frames: list[str]) -> Iterator[tuple[str, ...]]:
    run_: list[str] = []
    for label in frames:
        if not label.startswith("0x"):
            return
        if run_ and label.split(":", 1)[0] != run_[0].split(":", 1)[0]:
            yield tuple(run_)
            run_ = []
        run_.append(label)
    # The last run of a path may continue deeper in another path; only whole runs ending at a leaf count,
    # so yield it too and let the prefix filter drop truncated ones.
    if run_:
        yield tuple(run_)


# ----------------------------------------------------------------------------------------------------------
# Pure logic


def test_parse_maps_keeps_file_mappings_only() -> None:
    text = (
        "55d0c8a00000-55d0c8a01000 r--p 00000000 fd:01 1234 /usr/bin/prog\n"
        "55d0c8a01000-55d0c8a02000 r-xp 00001000 fd:01 1234 /usr/bin/prog\n"
        "55d0c9000000-55d0c9021000 rw-p 00000000 00:00 0    [heap]\n"
        "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n"
        "7f1000000000-7f1000002000 r-xp 00002000 fd:01 99 /tmp/lib with space.so (deleted)\n"
        "7ffd000000-7ffd001000 r-xp 00000000 00:00 0 [vdso]\n"
        "garbage line\n"
    )
    maps = parse_maps(text)
    assert maps == [
        Mapping(0x55D0C8A00000, 0x55D0C8A01000, 0, "/usr/bin/prog", "r--p"),
        Mapping(0x55D0C8A01000, 0x55D0C8A02000, 0x1000, "/usr/bin/prog", "r-xp"),
        Mapping(0x7F1000000000, 0x7F1000002000, 0x2000, "/tmp/lib with space.so", "r-xp"),
    ]
    assert maps[1].contains(0x55D0C8A01FFF) and not maps[1].contains(0x55D0C8A02000)


def _sym(name: str, value: int, size: int, typ: int = 2, bind: int = 1) -> ElfSymbol:
    return ElfSymbol(name, value, size, typ, bind, section_index=14)


def test_symbol_table_prefers_valgrinds_alias() -> None:
    table = SymbolTable(
        [
            # glibc's malloc aliases: the shortest name wins.
            _sym("__libc_malloc", 0x1000, 0x100),
            _sym("malloc", 0x1000, 0x100),
            _sym("__malloc", 0x1000, 0x100, bind=0),
            # Equal length ignoring the version: the versioned name wins, then alphabetical order.
            _sym("start", 0x2000, 0x10),
            _sym("start@@V_2", 0x2000, 0x10),
            _sym("start@V_1", 0x2000, 0x10),
            # Ignored: zero size, zero value, data objects.
            _sym("empty", 0x3000, 0),
            _sym("zero", 0, 0x10),
            _sym("table", 0x4000, 0x100, typ=1),
            # An IFUNC counts as a function.
            _sym("memcpy", 0x5000, 0x40, typ=10),
        ]
    )
    assert table.lookup(0x1000) == "malloc"
    assert table.lookup(0x10FF) == "malloc"
    assert table.lookup(0x1100) is None
    assert table.lookup(0x2008) == "start@@V_2"
    assert table.lookup(0x3000) is None
    assert table.lookup(0x4010) is None
    assert table.lookup(0x5000) == "memcpy"


def test_symbol_table_truncates_overlaps() -> None:
    table = SymbolTable(
        [
            _sym("outer", 0x100, 0x100),  # encloses "inner": cut where inner starts
            _sym("inner", 0x140, 0x20),
            _sym("short", 0x300, 0x10),  # same start, "long" keeps only its tail
            _sym("long", 0x300, 0x40),
        ]
    )
    assert table.lookup(0x13F) == "outer"
    assert table.lookup(0x140) == "inner"
    assert table.lookup(0x160) is None
    assert table.lookup(0x30F) == "short"
    assert table.lookup(0x310) == "long"
    assert table.lookup(0x33F) == "long"


@pytest.mark.needs("c++filt")
def test_demangle_matches_cxxfilt() -> None:
    names = [
        "_ZNSt6vectorIiSaIiEE9push_backEOi",
        "_ZN2ns3BoxIiE4growEi",
        "_ZN2ns6WidgetC2Ev",
        "_Znwm",
    ]
    expected = run("c++filt", *names).splitlines()
    assert [demangle(n) for n in names] == expected
    assert demangle("main") == "main"
    assert demangle("_ZNotMangled@@GLIBCXX_3.4") == "_ZNotMangled@@GLIBCXX_3.4"


def test_below_main_names() -> None:
    for raw in ("__libc_start_main", "__libc_start_call_main", "generic_start_main", "__libc_start_main.x"):
        assert display_function_name(raw) == BELOW_MAIN
    # Valgrind compares the exact name, so the versioned alias is shown as it is.
    assert display_function_name("__libc_start_main@@GLIBC_2.34") == "__libc_start_main@@GLIBC_2.34"
    assert display_function_name("main") == "main"


# ----------------------------------------------------------------------------------------------------------
# ELF objects


@pytest.mark.needs("gcc", "g++")
@pytest.mark.needs("binutils")
@pytest.mark.parametrize("name,pie", [("c_O2", True), ("c_O2_nopie", False)])
def test_elf_object_against_binutils(tools: Toolbox, name: str, pie: bool) -> None:
    exe = str(tools.build(name))
    obj = open_elf(exe)
    assert open_elf(exe) is obj  # cached
    assert obj.is_pie_or_shared is pie
    note = run("readelf", "-n", exe)
    assert obj.build_id == re.search(r"Build ID: ([0-9a-f]+)", note).group(1)  # type: ignore[union-attr]

    nm = {}
    for line in run("nm", "-S", "--defined-only", exe).splitlines():
        parts = line.split()
        if len(parts) == 4:
            nm[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
    for fn in ("main", "leaf", "middle"):
        assert obj.find_symbol(fn) == nm[fn]
    assert obj.symbols_named(["leaf", "no_such_function"]) == {"leaf": nm["leaf"]}

    # Bytes at a virtual address equal the bytes objdump shows for main's first instructions.
    value, _size = nm["main"]
    dump = run("objdump", "-d", f"--start-address={value}", f"--stop-address={value + 8}", exe)
    hexbytes = "".join(
        "".join(re.findall(r"\b[0-9a-f]{2}\b", line.split("\t")[1]))
        for line in dump.splitlines()
        if re.match(r"^\s+[0-9a-f]+:\t", line)
    )
    assert obj.code_bytes(value, 8).hex() == hexbytes[:16]
    offset = obj.vaddr_to_file_offset(value)
    assert obj.file_offset_to_vaddr(offset) == value
    with open(exe, "rb") as fh:
        fh.seek(offset)
        assert fh.read(8) == obj.code_bytes(value, 8)


@pytest.mark.needs("nm")
def test_elf_object_libc() -> None:
    obj = open_elf(LIBC)
    assert obj.is_pie_or_shared
    found = obj.find_symbol("malloc")
    assert found is not None and found[1] > 0
    nm = run("nm", "-D", "-S", "--defined-only", LIBC)
    line = next(x for x in nm.splitlines() if x.split()[-1] in ("malloc", "malloc@@GLIBC_2.2.5"))
    assert found == (int(line.split()[0], 16), int(line.split()[1], 16))
    with pytest.raises(ValueError):
        obj.vaddr_to_file_offset(0x7FFF_FFFF_0000)


# ----------------------------------------------------------------------------------------------------------
# Massif as the judge


MASSIF_CASES = ["c_O0", "c_O2", "c_O2_nopie", "cpp_O0", "cpp_O2", "c_O2_dwarf4", "cpp_O2_dwarf4", "uses_lib"]


@pytest.mark.needs("gcc", "g++")
@pytest.mark.needs("valgrind")
@pytest.mark.parametrize("name", MASSIF_CASES)
def test_labels_match_massif(tools: Toolbox, symbolizer: Symbolizer, name: str) -> None:
    text, maps = tools.massif(name)
    groups = massif_frame_groups(text)
    assert groups, "Massif printed no frames"
    mismatches = []
    for group in sorted(groups):
        address = int(group[0].split(":", 1)[0], 16)
        # Massif prints return address - 1; we are handed the return address.
        frames = symbolizer.symbolize(maps, address + 1)
        ours = tuple(f.label for f in frames)
        # Inlined calls are marked, the real function is not: how a stack is split into IPs (ip_groups).
        assert [f.inlined for f in frames] == [True] * (len(frames) - 1) + [False]
        if ours != group:
            mismatches.append((group, ours))
    assert not mismatches, "\n".join(f"massif: {g}\nours:   {o}" for g, o in mismatches)

    labels = [label for g in groups for label in g]
    if name.startswith("c_"):
        # strdup's call into malloc: libc's debug file found through its build-id.
        assert any(re.search(r": strdup \(strdup\.c:\d+\)$", x) for x in labels)
    if name not in ("cpp_O0", "uses_lib"):
        assert any(len(g) > 1 for g in groups), "no inlined frames to compare"
    if name == "uses_lib":
        lib = str(tools.lib())
        assert any(x.endswith(f": exported (in {lib})") for x in labels)
        assert any(x.endswith(f": ??? (in {lib})") for x in labels)
    if name.startswith("cpp_"):
        assert any("ns::Box<int>::grow(int)" in x for x in labels)


# ----------------------------------------------------------------------------------------------------------
# addr2line as the judge for DWARF (file:line of every inline level)


def _identity_maps(obj: ElfObject) -> list[Mapping]:
    """Mappings that load an object at its link addresses (bias 0)."""
    return [Mapping(seg.vaddr & ~0xFFF, seg.vaddr + seg.filesz, seg.offset & ~0xFFF, obj.path) for seg in obj.segments]


def _call_return_addresses(exe: str) -> list[int]:
    """The return address of every direct call in the program's own functions."""
    out = []
    current = ""
    for line in run("objdump", "-d", "--no-show-raw-insn", exe).splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            current = head.group(1)
            continue
        if current not in ("main", "leaf", "middle", "level1") and not current.startswith("_ZN2ns"):
            continue
        m = re.match(r"^\s+([0-9a-f]+):\s+call\s", line)
        if m:
            out.append(int(m.group(1), 16))
    # objdump gives the call's address; the next instruction is the return address.
    starts = sorted(int(x, 16) for x in re.findall(r"^\s+([0-9a-f]+):", run("objdump", "-d", exe), re.M))
    return [starts[starts.index(a) + 1] for a in out]


def _addr2line(exe: str, vaddr: int) -> list[tuple[str, str, int]]:
    lines = run("addr2line", "-f", "-i", "-C", "-e", exe, hex(vaddr)).splitlines()
    out = []
    for fn, loc in zip(lines[::2], lines[1::2], strict=True):
        path, _, line = loc.rpartition(":")
        out.append((fn, os.path.basename(path), int(line.split()[0])))
    return out


@pytest.mark.needs("gcc", "g++")
@pytest.mark.needs("binutils")
@pytest.mark.parametrize("name", ["c_O0", "c_O2", "cpp_O0", "cpp_O2", "c_O2_dwarf4", "cpp_O2_dwarf4"])
def test_inline_levels_match_addr2line(tools: Toolbox, symbolizer: Symbolizer, name: str) -> None:
    exe = str(tools.build(name))
    maps = _identity_maps(open_elf(exe))
    ras = _call_return_addresses(exe)
    assert ras
    saw_inline = False
    for ra in ras:
        frames = symbolizer.symbolize(maps, ra)
        judge = _addr2line(exe, ra - 1)
        assert [(f.file, f.line) for f in frames] == [(j[1], j[2]) for j in judge], hex(ra)
        if name.startswith("c_"):
            # In C the DWARF name is the symbol name, so function names agree too.
            assert [f.function for f in frames] == [j[0] for j in judge], hex(ra)
        assert all(f.address == ra - 1 for f in frames)
        saw_inline |= len(frames) > 1
    assert saw_inline or name == "cpp_O0"  # -O0 C++ inlines nothing


# ----------------------------------------------------------------------------------------------------------
# Native runs: real load addresses of PIE, non-PIE and shared objects


@pytest.mark.needs("gcc", "g++")
@pytest.mark.needs("binutils")
@pytest.mark.parametrize("name", ["c_O2", "c_O2_nopie"])
def test_native_return_addresses(tools: Toolbox, symbolizer: Symbolizer, name: str) -> None:
    exe = str(tools.build(name))
    maps, rec = tools.native(name)
    bias = rec["main"] - open_elf(exe).find_symbol("main")[0]  # type: ignore[index]
    assert (bias == 0) is (name == "c_O2_nopie")
    for tag, caller in (("ra_in_middle", "middle"), ("ra_in_main", "main")):
        frames = symbolizer.symbolize(maps, rec[tag])
        judge = _addr2line(exe, rec[tag] - bias - 1)
        assert [(f.function, f.file, f.line) for f in frames] == judge
        assert frames[-1].function == caller
        assert frames[0].obj == exe


@pytest.mark.needs("gcc", "g++")
@pytest.mark.needs("binutils")
def test_native_shared_library_without_debug_info(tools: Toolbox, symbolizer: Symbolizer) -> None:
    maps, rec = tools.native("uses_lib")
    lib = str(tools.lib())
    value, size = open_elf(lib).find_symbol("exported")  # type: ignore[misc]
    bias = rec["exported"] - value
    assert value <= rec["ra_in_exported"] - 1 - bias < value + size
    frames = symbolizer.symbolize(maps, rec["ra_in_exported"])
    assert [f.label for f in frames] == [f"0x{rec['ra_in_exported'] - 1:X}: exported (in {lib})"]


# ----------------------------------------------------------------------------------------------------------
# Separate debug files


def _split_debug(tmp_path: Path, build_id: bool) -> tuple[Path, Path, int]:
    """inline_chain.c built, then split: the stripped program, its debug file, and a call's return
    address (taken before stripping, while objdump can still name functions)."""
    exe = tmp_path / "prog"
    flags = [] if build_id else ["-Wl,--build-id=none"]
    run("gcc", *CFLAGS, "-O2", "-I", PROGRAMS, *flags, "-o", exe, PROGRAMS / "inline_chain.c")
    ra = _call_return_addresses(str(exe))[0]
    dbg = tmp_path / "prog.debug"
    run("objcopy", "--only-keep-debug", exe, dbg)
    run("strip", "--strip-all", exe)
    return exe, dbg, ra


def _expected_from_debug(dbg: Path, ra: int) -> list[tuple[str, str, int]]:
    return _addr2line(str(dbg), ra - 1)


@pytest.mark.needs("gcc", "g++")
@pytest.mark.needs("binutils")
@pytest.mark.parametrize("where", ["same_dir", "dot_debug"])
def test_gnu_debuglink(tmp_path: Path, where: str) -> None:
    exe, dbg, ra = _split_debug(tmp_path, build_id=False)
    if where == "dot_debug":
        (tmp_path / ".debug").mkdir()
        dbg = dbg.rename(tmp_path / ".debug" / dbg.name)
    run("objcopy", f"--add-gnu-debuglink={dbg}", exe)
    obj = open_elf(str(exe))
    assert obj.build_id is None and not obj.has_dwarf
    found = find_debug_file(obj, [str(tmp_path / "no-root")])
    assert found is not None and found.path == str(dbg)
    with Symbolizer(debug_roots=[str(tmp_path / "no-root")]) as sym:
        frames = sym.symbolize(_identity_maps(obj), ra)
    judge = _expected_from_debug(dbg, ra)
    assert [(f.function, f.file, f.line) for f in frames] == judge


@pytest.mark.needs("gcc", "g++")
@pytest.mark.needs("binutils")
def test_build_id_debug_root(tmp_path: Path) -> None:
    exe, dbg, ra = _split_debug(tmp_path, build_id=True)
    obj = open_elf(str(exe))
    assert obj.build_id is not None
    root = tmp_path / "debugroot"
    target = root / ".build-id" / obj.build_id[:2] / (obj.build_id[2:] + ".debug")
    target.parent.mkdir(parents=True)
    dbg.rename(target)
    with Symbolizer(debug_roots=[str(tmp_path / "elsewhere")]) as sym:
        without = sym.symbolize(_identity_maps(obj), ra)
    assert without[0].file is None  # no DWARF: `fn (in /path)`
    assert without[0].label.endswith(f" (in {exe})")
    with Symbolizer(debug_roots=[str(root)]) as sym:
        frames = sym.symbolize(_identity_maps(obj), ra)
    assert [(f.function, f.file, f.line) for f in frames] == _expected_from_debug(target, ra)


# ----------------------------------------------------------------------------------------------------------
# libc through its build-id debug file, and the cost of a lookup


def _libc_strdup_malloc_return(obj: ElfObject) -> int:
    """The return address of strdup's call to malloc, found in libc's own code."""
    value, size = obj.find_symbol("strdup")  # type: ignore[misc]
    dump = run("objdump", "-d", f"--start-address={value}", f"--stop-address={value + size}", LIBC)
    addrs = [int(a, 16) for a in re.findall(r"^\s+([0-9a-f]+):", dump, re.M)]
    for i, line in enumerate(re.findall(r"^\s+[0-9a-f]+:.*$", dump, re.M)):
        if "call" in line and "<malloc@plt>" in line:
            return addrs[i + 1]
    raise AssertionError("strdup does not call malloc@plt")


@pytest.mark.needs("binutils")
def test_libc_separate_debug_info_and_speed() -> None:
    obj = open_elf(LIBC)
    if obj.build_id is None or not os.path.exists(
        f"/usr/lib/debug/.build-id/{obj.build_id[:2]}/{obj.build_id[2:]}.debug"
    ):
        pytest.skip("libc6-dbg is not installed")
    ra = _libc_strdup_malloc_return(obj)
    base = 0x7F12_3400_0000  # any page-aligned load address
    maps = [Mapping(base + m.start, base + m.end, m.offset, LIBC) for m in _identity_maps(obj)]
    with Symbolizer() as sym:
        t0 = time.perf_counter()
        first = sym.symbolize(maps, base + ra)
        t1 = time.perf_counter()
        again = sym.symbolize(maps, base + ra)
        t2 = time.perf_counter()
    debug = f"/usr/lib/debug/.build-id/{obj.build_id[:2]}/{obj.build_id[2:]}.debug"
    judge = _addr2line(debug, ra - 1)
    assert [(f.file, f.line) for f in first] == [(j[1], j[2]) for j in judge]
    # addr2line names glibc's internal alias (__GI___strdup); Valgrind shows the preferred symbol.
    assert first[-1].function == "strdup" and first[-1].file == "strdup.c"
    assert first == again
    # Only the compile unit of the address is parsed, so the first lookup stays well under the time a
    # full parse of libc's DWARF takes (tens of seconds in pyelftools); cached lookups are dictionary hits.
    assert t1 - t0 < 5.0
    assert t2 - t1 < 0.005


@pytest.mark.needs("objdump")
def test_symbolizers_share_a_builds_dwarf_and_close_it_with_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon has a symbolizer per target, and every target maps the same libc: its DWARF (some 16 MiB once read)
    is read once for them all, kept while it is among the builds used last (the next process of the same program
    finds it), and closed once the last symbolizer that holds it is gone and other builds have taken its place."""
    obj = open_elf(LIBC)
    if obj.build_id is None or not os.path.exists(
        f"/usr/lib/debug/.build-id/{obj.build_id[:2]}/{obj.build_id[2:]}.debug"
    ):
        pytest.skip("libc6-dbg is not installed")
    ra = _libc_strdup_malloc_return(obj)
    base = 0x7F12_3400_0000
    maps = [Mapping(base + m.start, base + m.end, m.offset, LIBC) for m in _identity_maps(obj)]
    # Roots of this test's own (the extra one is empty): other tests' symbolizers share the default roots' state.
    roots = ("/usr/lib/debug", str(tmp_path))

    first, second = Symbolizer(roots), Symbolizer(roots)
    frames = first.symbolize(maps, base + ra)
    assert second.symbolize(maps, base + ra) == frames and frames[-1].function == "strdup"
    shared = first.object_info(LIBC)
    assert shared is not None and second.object_info(LIBC) is shared
    assert shared._dwarf is not None
    debug_file = shared._dwarf._fh  # the open debug file; holding it does not hold the state
    held = weakref.ref(shared)
    del shared
    first.close()
    gc.collect()
    assert held() is not None and not debug_file.closed  # the second still holds it
    second.close()
    gc.collect()
    assert held() is not None and not debug_file.closed  # one of the builds used last
    with Symbolizer(roots) as third:  # a further process of it: nothing read again
        assert third.symbolize(maps, base + ra) == frames and third.object_info(LIBC) is held()
    monkeypatch.setattr(symbolizer_module, "_RECENT_BUILDS", 1)
    other = open_elf(sys.executable if open_elf(sys.executable).build_id else "/bin/ls")
    assert other.build_id and other.build_id != obj.build_id
    with Symbolizer(roots) as fourth:
        assert fourth.object_info(other.path) is not None  # another build, used last: libc's state is let go
    gc.collect()
    assert held() is None and debug_file.closed
    with Symbolizer(roots) as fifth:  # read again when asked again
        assert fifth.symbolize(maps, base + ra) == frames


# ----------------------------------------------------------------------------------------------------------
# Unknown addresses and vanished files


def test_unknown_address_and_missing_file(tmp_path: Path) -> None:
    gone = str(tmp_path / "deleted.so")
    maps = [Mapping(0x1000, 0x2000, 0, gone)]
    with Symbolizer() as sym:
        assert [f.label for f in sym.symbolize(maps, 0x9001)] == ["0x9000: ???"]
        assert [f.label for f in sym.symbolize(maps, 0x1801)] == [f"0x1800: ??? (in {gone})"]
        # An instruction pointer (not a return address) is looked up as it is.
        assert sym.symbolize(maps, 0x1801, is_return_address=False) == [Frame(0x1801, obj=gone)]


@pytest.mark.needs("gcc", "g++")
def test_recorded_build_id_mismatch_is_not_trusted(tools: Toolbox) -> None:
    exe = str(tools.build("c_O0"))
    obj = open_elf(exe)
    good = [Mapping(m.start, m.end, m.offset, m.path, build_id=obj.build_id) for m in _identity_maps(obj)]
    other = [Mapping(m.start, m.end, m.offset, m.path, build_id="00" * 20) for m in _identity_maps(obj)]
    main_at = obj.find_symbol("main")[0]  # type: ignore[index]
    with Symbolizer() as sym:
        assert sym.symbolize(good, main_at + 1, is_return_address=False)[-1].function == "main"
        assert sym.symbolize(other, main_at + 1, is_return_address=False) == [Frame(main_at + 1, obj=exe)]


def test_symbolize_stack_flattens_inline_levels() -> None:
    calls: list[tuple[int, bool]] = []

    class Recording(Symbolizer):
        def symbolize(self, mappings: object, address: int, *, is_return_address: bool = True) -> list[Frame]:
            calls.append((address, is_return_address))
            return [Frame(address, "inner"), Frame(address, "outer")] if address == 2 else [Frame(address)]

    frames = Recording().symbolize_stack([], [1, 2, 3], first_is_return_address=False)
    assert calls == [(1, False), (2, True), (3, True)]
    assert [f.function for f in frames] == [None, "inner", "outer", None]


def test_maps_recorder_keeps_the_main_stack_end(tmp_path: Path) -> None:
    """The stack walk's reads stop just above argc on the main thread's stack (/proc/PID/stat startstack),
    read with the maps."""
    from agent.process.maps import MapsRecorder

    (tmp_path / "42").mkdir()
    fields = ["0"] * 50
    fields[28 - 3] = str(0x7FFD1C020F30)
    (tmp_path / "42" / "stat").write_text("42 (prog) " + " ".join(fields) + "\n")
    maps = tmp_path / "42" / "maps"
    maps.write_text(
        "55d0c0000000-55d0c0001000 r-xp 00000000 08:01 1234 /usr/bin/prog\n"
        "7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0 [stack]\n"
        "7ffd1c1f0000-7ffd1c1f2000 r-xp 00000000 00:00 0 [vdso]\n"
    )
    rec = MapsRecorder(42, proc=str(tmp_path))
    assert rec.refresh()
    assert rec.stack_end == 0x7FFD1C020F38
    (tmp_path / "42" / "stat").unlink()
    maps.write_text("55d0c0000000-55d0c0001000 r-xp 00000000 08:01 1234 /usr/bin/prog\n")
    rec.refresh()
    assert rec.stack_end == 0  # no stat: no limit known


def test_maps_recorder_reads_on_only_for_new_code(tmp_path: Path) -> None:
    """A server maps data and anonymous memory per request (zlib's state, a file sent with mmap): its maps text
    changes at each look, but only new code is news to the symbolizer and the stack walk, and only code
    mappings are kept (the daemon must not grow with every file a server ever mapped)."""
    from agent.process.maps import MapsRecorder

    (tmp_path / "42").mkdir()
    maps = tmp_path / "42" / "maps"
    prog = "55d0c0001000-55d0c0002000 r-xp 00001000 08:01 1234 /usr/bin/prog\n"
    maps.write_text("55d0c0000000-55d0c0001000 r--p 00000000 08:01 1234 /usr/bin/prog\n" + prog)
    rec = MapsRecorder(42, proc=str(tmp_path))
    assert rec.refresh()
    assert [(m.start, m.path) for m in rec.current] == [(0x55D0C0001000, "/usr/bin/prog")]
    maps.write_text(
        prog
        + "7f0000000000-7f0000042000 rw-p 00000000 00:00 0 \n"
        + "7f0000100000-7f0000101000 r--s 00000000 08:01 99 /var/www/html/index.html\n"
    )
    assert not rec.refresh()  # data and anonymous memory: nothing new
    assert [m.path for m in rec.mappings] == ["/usr/bin/prog"]
    maps.write_text(prog + "7f0000200000-7f0000201000 r-xp 00000000 08:01 77 /usr/lib/mod_deflate.so\n")
    assert rec.refresh()
    assert [m.path for m in rec.mappings] == ["/usr/lib/mod_deflate.so", "/usr/bin/prog"]  # newest first
