"""Symbolization the way Valgrind/Massif prints frames: `fn (file:line)`, inlined calls as extra frames.

Input is a recorded list of mappings (from /proc/PID/maps while the target was alive) and runtime addresses;
only files on disk are read afterwards, so a target that has exited can still be symbolized.

What Valgrind 3.19 does, and therefore what this module does:
- The caller frames it shows are return address - 1 (the call instruction), and it prints that address.
- The outermost function at an address is named from the ELF symbol tables (.symtab and .dynsym of the object
  and of its separate debug file), demangled. Aliases of one range are resolved by Valgrind's preference:
  shortest name ignoring `@VERSION`, then versioned, then alphabetical. `__libc_start_main` and friends are
  renamed `(below main)`.
- Inlined levels come from DW_TAG_inlined_subroutine: each level is named by the DW_AT_name of its abstract
  origin (through DW_AT_specification), not demangled; a level's file:line is the call site recorded in the
  next inner level, and the innermost level's file:line comes from the line table.
- Every line-table row counts (is_stmt or not); at one address the last row wins.
- No symbol gives `???`; no line information gives `fn (in /path/to/object)`.

Speed: only the compile unit that holds an address is parsed (found through .debug_aranges, else through a
lazily built index of CU ranges), and everything is cached per build-id.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import re
import threading
import weakref
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, BinaryIO

from elftools.dwarf.compileunit import CompileUnit
from elftools.dwarf.die import DIE
from elftools.dwarf.dwarfinfo import DWARFInfo
from elftools.dwarf.ranges import BaseAddressEntry, RangeEntry
from elftools.elf.elffile import ELFFile

from agent.model.profile import Frame
from agent.symbols.elf import ElfError, ElfObject, ElfSymbol, open_elf

# ----------------------------------------------------------------------------------------------------------
# /proc/PID/maps


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps that maps a file."""

    start: int
    end: int
    offset: int
    path: str
    perms: str = "r-xp"
    build_id: str | None = None  # when recorded, a file on disk with another build-id is not trusted
    shown: str | None = None  # the path as the process names it, where `path` is where we open it (a container)

    @property
    def name(self) -> str:
        """The object's path as the outputs show it."""
        return self.shown or self.path

    def contains(self, address: int) -> bool:
        return self.start <= address < self.end


_DELETED = " (deleted)"


def parse_maps(text: str) -> list[Mapping]:
    """File-backed mappings of /proc/PID/maps text, in file order.

    Anonymous memory, [heap], [stack], [vdso] and the like are left out: they have no file to symbolize
    from. A `(deleted)` suffix is dropped from the path (the file may still be found under that name).
    """
    out: list[Mapping] = []
    for raw in text.splitlines():
        parts = raw.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if not path.startswith("/"):
            continue
        if path.endswith(_DELETED):
            path = path[: -len(_DELETED)]
        try:
            lo, hi = (int(x, 16) for x in parts[0].split("-", 1))
            offset = int(parts[2], 16)
        except ValueError:
            continue
        out.append(Mapping(lo, hi, offset, path, parts[1]))
    return out


# ----------------------------------------------------------------------------------------------------------
# C++ demangling through libstdc++ (the same demangler family Valgrind bundles from libiberty)


class _Demangler:
    def __init__(self) -> None:
        self._fn: Any = None
        self._free: Any = None
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return
        fn = getattr(lib, "__cxa_demangle")  # getattr: a literal __name would be class-mangled
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._fn = fn
        self._free = libc.free
        self._free.argtypes = [ctypes.c_void_p]
        self._free.restype = None

    def __call__(self, name: str) -> str:
        if self._fn is None:
            return name
        status = ctypes.c_int(0)
        ptr = self._fn(name.encode("utf-8", "replace"), None, None, ctypes.byref(status))
        if not ptr:
            return name
        try:
            if status.value != 0:
                return name
            return ctypes.string_at(ptr).decode("utf-8", "replace")
        finally:
            self._free(ptr)


_demangler = _Demangler()


@lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """Itanium C++ demangling of a symbol name; other names (C, versioned `foo@@V`) come back unchanged."""
    if not name.startswith("_Z"):
        return name
    return _demangler(name)


# Valgrind's "below main" function names on Linux (3.19 m_debuginfo get_fnname_kind), matched as they stand.
_BELOW_MAIN_EXACT = frozenset({"__libc_start_main", "__libc_start_call_main", "generic_start_main", "_start"})
_BELOW_MAIN_PREFIX = ("__libc_start_main.", "generic_start_main.")
BELOW_MAIN = "(below main)"


def is_below_main(name: str) -> bool:
    """A (demangled) function of the C start-up code that calls main."""
    return name in _BELOW_MAIN_EXACT or name.startswith(_BELOW_MAIN_PREFIX)


def display_function_name(raw: str) -> str:
    """A symbol-table name as Valgrind prints it: demangled, with the C start-up code as `(below main)`."""
    name = demangle(raw)
    return BELOW_MAIN if is_below_main(name) else name


# ----------------------------------------------------------------------------------------------------------
# Function symbols, canonicalised like Valgrind's symbol table


def _prefer(a: str, b: str) -> bool:
    """True when Valgrind would show name a rather than name b for one address range."""
    va, vb = a.find("@"), b.find("@")
    la = va if va >= 0 else len(a)
    lb = vb if vb >= 0 else len(b)
    if la and not lb:
        return True
    if lb and not la:
        return False
    blank_a, blank_b = not a.strip(), not b.strip()
    if blank_a != blank_b:
        return blank_b
    if la != lb:
        return la < lb
    if (va >= 0) != (vb >= 0):
        return va >= 0
    return a <= b


def _best_name(names: Sequence[str]) -> str:
    best = names[0]
    for cand in names[1:]:
        if not _prefer(best, cand):
            best = cand
    return best


@dataclass
class _Sym:
    start: int
    end: int  # exclusive
    names: list[str]


class SymbolTable:
    """Non-overlapping function ranges, each with one display name (Valgrind's canonicalised symtab)."""

    def __init__(self, symbols: Iterator[ElfSymbol] | Sequence[ElfSymbol]) -> None:
        syms: list[_Sym] = []
        for s in symbols:
            # Valgrind ignores nameless, zero-sized and zero-valued symbols.
            if not s.is_function or not s.name or s.size == 0 or s.value == 0:
                continue
            syms.append(_Sym(s.value, s.value + s.size, [s.name]))
        canon = self._canonicalise(syms)
        self._starts = [s.start for s in canon]
        self._ends = [s.end for s in canon]
        self._names = [_best_name(s.names) for s in canon]

    @staticmethod
    def _canonicalise(syms: list[_Sym]) -> list[_Sym]:
        while True:
            syms.sort(key=lambda s: (s.start, s.end))
            merged: list[_Sym] = []
            for s in syms:  # identical ranges become one entry with all the names
                if merged and merged[-1].start == s.start and merged[-1].end == s.end:
                    merged[-1].names.extend(n for n in s.names if n not in merged[-1].names)
                else:
                    merged.append(s)
            syms = merged
            changed = False
            for i in range(len(syms) - 1):
                a, b = syms[i], syms[i + 1]
                if a.end <= b.start:
                    continue
                changed = True
                if a.start < b.start:
                    a.end = b.start  # an enclosing symbol is cut where the next one starts
                elif a.end < b.end:
                    b.start = a.end  # same start: the longer one keeps only its tail
                # equal ranges cannot be neighbours here: they were merged above
            if not changed:
                return [s for s in syms if s.end > s.start]
            syms = [s for s in syms if s.end > s.start]

    def lookup(self, vaddr: int) -> str | None:
        """The raw (not demangled) display name of the function holding vaddr, or None."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i >= 0 and vaddr < self._ends[i]:
            return self._names[i]
        return None

    def __len__(self) -> int:
        return len(self._starts)


# ----------------------------------------------------------------------------------------------------------
# DWARF


@dataclass(frozen=True)
class InlinedCall:
    """One DW_TAG_inlined_subroutine covering an address: the inlined function and where it was called."""

    function: str
    call_file: str | None
    call_line: int | None


@dataclass(frozen=True)
class SourceInfo:
    """DWARF facts for one address: line-table location and the inline chain (outermost call first)."""

    file: str | None
    line: int | None
    inlined: tuple[InlinedCall, ...] = ()


_SCOPE_TAGS = frozenset({"DW_TAG_lexical_block", "DW_TAG_subprogram", "DW_TAG_try_block", "DW_TAG_catch_block"})
_UNKNOWN_INLINED = "UnknownInlinedFun"  # Valgrind's text for an origin in another unit
_ORIGIN_NOT_FOUND = "AbsOriFnNameNotFound"
_LOCAL_REF_FORMS = frozenset({"DW_FORM_ref1", "DW_FORM_ref2", "DW_FORM_ref4", "DW_FORM_ref8", "DW_FORM_ref_udata"})


class _CuInfo:
    """What one compile unit gives: a Valgrind-style line table and its concrete subprograms' ranges."""

    def __init__(self, dwarf: _Dwarf, cu: CompileUnit) -> None:
        self.cu = cu
        self.dwarf = dwarf
        top = cu.get_top_DIE()
        low = top.attributes.get("DW_AT_low_pc")
        self.base = low.value if low is not None else 0
        self.files: list[str | None] = []
        self.file_index_base = 0 if cu.header.version >= 5 else 1
        self._line_starts: list[int] = []
        self._line_ends: list[int] = []
        self._line_rows: list[tuple[int, int]] = []  # (file number, line)
        self._read_lines()
        self._sp_starts: list[int] = []
        self._sp_entries: list[tuple[int, int, int]] = []  # (lo, hi, die offset)
        self._read_subprograms(top)

    # -- line table --

    def _read_lines(self) -> None:
        lp = self.dwarf.info.line_program_for_CU(self.cu)
        if lp is None:
            return
        for entry in lp.header.file_entry:
            name = entry.name
            self.files.append(name.decode("utf-8", "replace") if isinstance(name, bytes) else name)
        # Every row counts, is_stmt or not: Valgrind 3.19 (like addr2line) reports the last row at an
        # address, and gcc's -O2 views put the precise line in non-statement rows.
        rows: list[tuple[int, int, int, int]] = []
        last: tuple[int, int, int] | None = None  # (address, file, line) of the previous row
        for entry in lp.get_entries():
            st = entry.state
            if st is None:
                continue
            if last is not None and last[0]:
                rows.append((last[0], st.address, last[1], last[2]))
            last = None if st.end_sequence else (st.address, st.file, st.line)
        rows = [r for r in rows if r[1] != r[0]]  # zero-sized rows say nothing
        rows.sort(key=lambda r: r[0])
        for lo, hi, fileno, line in rows:
            self._line_starts.append(lo)
            self._line_ends.append(hi if hi > lo else lo + 1)
            self._line_rows.append((fileno, line))

    def file_name(self, number: int | None) -> str | None:
        if number is None:
            return None
        i = number - self.file_index_base
        if 0 <= i < len(self.files):
            return self.files[i]
        return None

    def line_at(self, vaddr: int) -> tuple[str | None, int] | None:
        i = bisect.bisect_right(self._line_starts, vaddr) - 1
        if i < 0 or vaddr >= self._line_ends[i]:
            return None
        fileno, line = self._line_rows[i]
        return self.file_name(fileno), line

    # -- DIEs --

    def _read_subprograms(self, top: DIE) -> None:
        entries: list[tuple[int, int, int]] = []
        for child in top.iter_children():
            if child.tag != "DW_TAG_subprogram":
                continue
            for lo, hi in self.dwarf.die_ranges(child, self.base) or ():
                entries.append((lo, hi, child.offset))
        entries.sort()
        self._sp_entries = entries
        self._sp_starts = [e[0] for e in entries]

    def inline_chain(self, vaddr: int) -> tuple[InlinedCall, ...]:
        i = bisect.bisect_right(self._sp_starts, vaddr) - 1
        # A function split in hot/cold parts has several entries; look at the few nearest ones.
        for j in range(i, max(-1, i - 8), -1):
            lo, hi, off = self._sp_entries[j]
            if lo <= vaddr < hi:
                chain: list[InlinedCall] = []
                self._descend(self.cu.get_DIE_from_refaddr(off), vaddr, chain)
                return tuple(chain)
        return ()

    def _descend(self, die: DIE, vaddr: int, chain: list[InlinedCall]) -> bool:
        for child in die.iter_children():
            tag = child.tag
            if tag == "DW_TAG_inlined_subroutine":
                ranges = self.dwarf.die_ranges(child, self.base)
                if ranges and any(lo <= vaddr < hi for lo, hi in ranges):
                    chain.append(self._inlined_call(child))
                    self._descend(child, vaddr, chain)
                    return True
            elif tag in _SCOPE_TAGS and child.has_children:
                ranges = self.dwarf.die_ranges(child, self.base)
                if ranges is None:
                    # A block without pc info is only a container: look inside, then go on.
                    if tag != "DW_TAG_subprogram" and self._descend(child, vaddr, chain):
                        return True
                elif any(lo <= vaddr < hi for lo, hi in ranges):
                    self._descend(child, vaddr, chain)
                    return True
        return False

    def _inlined_call(self, die: DIE) -> InlinedCall:
        attrs = die.attributes
        call_file = attrs.get("DW_AT_call_file")
        call_line = attrs.get("DW_AT_call_line")
        return InlinedCall(
            function=self._origin_name(die, "DW_AT_abstract_origin", 0),
            call_file=self.file_name(call_file.value) if call_file is not None else None,
            call_line=call_line.value if call_line is not None else None,
        )

    def _origin_name(self, die: DIE, attr_name: str, depth: int) -> str:
        attr = die.attributes.get(attr_name)
        if attr is None:
            return _ORIGIN_NOT_FOUND
        # Valgrind reads the origin only inside the same unit of the same file; else a fixed text.
        if attr.form not in _LOCAL_REF_FORMS:
            if attr.form != "DW_FORM_ref_addr":
                return _UNKNOWN_INLINED
            target_off = attr.value
            if not (self.cu.cu_offset <= target_off < self.cu.cu_offset + self.cu.size):
                return _UNKNOWN_INLINED
        try:
            origin = die.get_DIE_from_attribute(attr_name)
        except Exception:
            return _ORIGIN_NOT_FOUND
        name = origin.attributes.get("DW_AT_name")
        if name is not None:
            value = name.value
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if depth < 8 and "DW_AT_specification" in origin.attributes:
            return self._origin_name(origin, "DW_AT_specification", depth + 1)
        return _ORIGIN_NOT_FOUND


class _Dwarf:
    """The DWARF of one file, parsed one compile unit at a time."""

    def __init__(self, obj: ElfObject) -> None:
        self.path = obj.path
        self._fh: BinaryIO = open(obj.path, "rb")  # noqa: SIM115 - closed once unreachable (below)
        weakref.finalize(self, self._fh.close)  # a shared build's DWARF has no one owner to close it
        base_dir = os.path.dirname(obj.path)

        def loader(p: str) -> BinaryIO:
            # .gnu_debugaltlink (dwz) names are absolute or relative to the debug file.
            return open(p if os.path.isabs(p) else os.path.join(base_dir, p), "rb")

        elf = ELFFile(self._fh, stream_loader=loader)
        relocate = obj.elf_type == "ET_REL"
        try:
            self.info: DWARFInfo = elf.get_dwarf_info(relocate_dwarf_sections=relocate)
        except Exception:  # a missing or broken supplementary file: do without it
            self.info = elf.get_dwarf_info(relocate_dwarf_sections=relocate, follow_links=False)
        self._aranges: Any = None
        self._aranges_read = False
        self._cu_ranges: tuple[list[int], list[tuple[int, int, int]]] | None = None
        self._cus: dict[int, _CuInfo] = {}
        self._ranges_cache: dict[tuple[int, int], list[tuple[int, int]] | None] = {}
        self._range_lists: Any = self.info.range_lists()

    def die_ranges(self, die: DIE, cu_base: int) -> list[tuple[int, int]] | None:
        """The pc ranges of a DIE; None when it has no pc information at all."""
        key = (die.cu.cu_offset, die.offset)
        if key in self._ranges_cache:
            return self._ranges_cache[key]
        result: list[tuple[int, int]] | None = None
        attrs = die.attributes
        low = attrs.get("DW_AT_low_pc")
        ranges = attrs.get("DW_AT_ranges")
        if low is not None and ranges is None:
            lo = low.value
            high = attrs.get("DW_AT_high_pc")
            if high is None:
                result = [(lo, lo + 1)]
            else:
                hi = high.value if high.form == "DW_FORM_addr" else lo + high.value
                result = [(lo, hi)] if hi > lo else []
        elif ranges is not None and self._range_lists is not None:
            result = []
            base = cu_base
            try:
                entries = self._range_lists.get_range_list_at_offset(ranges.value, cu=die.cu)
            except Exception:
                entries = []
            for e in entries:
                if isinstance(e, BaseAddressEntry):
                    base = e.base_address
                elif isinstance(e, RangeEntry):
                    lo, hi = e.begin_offset, e.end_offset
                    if not e.is_absolute:
                        lo, hi = base + lo, base + hi
                    if hi > lo:
                        result.append((lo, hi))
        self._ranges_cache[key] = result
        return result

    def _cu_offset_for(self, vaddr: int) -> int | None:
        if not self._aranges_read:
            self._aranges_read = True
            try:
                self._aranges = self.info.get_aranges()
            except Exception:
                self._aranges = None
        if self._aranges is not None:
            off = self._aranges.cu_offset_at_addr(vaddr)
            if off is not None:
                return int(off)
        # No .debug_aranges entry: index the CUs' own ranges, once.
        if self._cu_ranges is None:
            self._cu_ranges = self._index_cu_ranges()
        starts, entries = self._cu_ranges
        i = bisect.bisect_right(starts, vaddr) - 1
        while i >= 0:
            lo, hi, off = entries[i]
            if lo <= vaddr < hi:
                return off
            i -= 1
            if vaddr - lo > 1 << 26:  # ranges are sorted by start; stop once far away
                break
        return None

    def _index_cu_ranges(self) -> tuple[list[int], list[tuple[int, int, int]]]:
        entries: list[tuple[int, int, int]] = []
        for cu in self.info.iter_CUs():
            top = cu.get_top_DIE()
            low = top.attributes.get("DW_AT_low_pc")
            base = low.value if low is not None else 0
            for lo, hi in self.die_ranges(top, base) or ():
                entries.append((lo, hi, cu.cu_offset))
        entries.sort()
        return [e[0] for e in entries], entries

    def cu_info(self, vaddr: int) -> _CuInfo | None:
        off = self._cu_offset_for(vaddr)
        if off is None:
            return None
        info = self._cus.get(off)
        if info is None:
            info = _CuInfo(self, self.info.get_CU_at(off))
            self._cus[off] = info
        return info

    def source_info(self, vaddr: int) -> SourceInfo | None:
        """Line and inline chain at vaddr; None when the line table does not cover it (Valgrind then
        shows no inlined frames either)."""
        cu = self.cu_info(vaddr)
        if cu is None:
            return None
        loc = cu.line_at(vaddr)
        if loc is None:
            return None
        return SourceInfo(file=loc[0], line=loc[1], inlined=cu.inline_chain(vaddr))


# ----------------------------------------------------------------------------------------------------------
# Separate debug files


def _crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


DEFAULT_DEBUG_ROOTS = ("/usr/lib/debug",)


_PROCESS_ROOT = re.compile(r"^/proc/\d+/root(?=/)")


def find_debug_file(obj: ElfObject, debug_roots: Sequence[str]) -> ElfObject | None:
    """The separate debug file of an object: by build-id under each root's .build-id/, else by
    .gnu_debuglink next to the object, in its .debug/ folder, or under each root plus the object's folder.
    An object read through a process's root (a container's) is looked for inside that root first, then on the
    host by build id (a debug file found by its name alone must match the object's build id or CRC)."""
    inside = _PROCESS_ROOT.match(obj.path)
    if inside is not None:
        debug_roots = [inside.group(0) + r for r in debug_roots] + list(debug_roots)
    if obj.build_id and len(obj.build_id) > 2:
        for root in debug_roots:
            cand = os.path.join(root, ".build-id", obj.build_id[:2], obj.build_id[2:] + ".debug")
            dbg = _try_open(cand)
            if dbg is not None and dbg.build_id == obj.build_id and dbg.has_dwarf:
                return dbg
    if obj.debuglink is not None:
        name, crc = obj.debuglink
        # realpath would follow /proc/PID/root out of the container: its folder is taken as the process sees it
        folder = os.path.dirname(obj.path if inside is not None else os.path.realpath(obj.path))
        cands = [os.path.join(folder, name), os.path.join(folder, ".debug", name)]
        own = os.path.dirname(obj.path[inside.end():]) if inside is not None else folder  # as the process names it
        cands += [os.path.join(root, own.lstrip("/"), name) for root in debug_roots]
        for cand in cands:
            if os.path.realpath(cand) == os.path.realpath(obj.path):
                continue
            dbg = _try_open(cand)
            if dbg is None or not dbg.has_dwarf:
                continue
            if obj.build_id and dbg.build_id:
                if dbg.build_id == obj.build_id:
                    return dbg
            elif _crc32_of(cand) == crc:
                return dbg
    return None


def _try_open(path: str) -> ElfObject | None:
    if not os.path.isfile(path):
        return None
    try:
        return open_elf(path)
    except ElfError:
        return None


# ----------------------------------------------------------------------------------------------------------
# Per-object state


# One resolved level: (function or None, file or None, line or None).
_Level = tuple[str | None, str | None, int | None]


class _ObjectInfo:
    """Everything known about one build of one object; shared by all paths with that build-id."""

    def __init__(self, obj: ElfObject, debug_roots: Sequence[str]) -> None:
        self.obj = obj
        self._debug_roots = tuple(debug_roots)
        self._lock = threading.RLock()
        self._debug: ElfObject | None = None
        self._debug_looked = False
        self._symbols: SymbolTable | None = None
        self._dwarf: _Dwarf | None = None
        self._dwarf_failed = False
        self._levels: dict[int, tuple[_Level, ...]] = {}

    @property
    def debug_object(self) -> ElfObject | None:
        """The file that holds this object's DWARF: itself, a separate debug file, or None."""
        if not self._debug_looked:
            self._debug_looked = True
            self._debug = self.obj if self.obj.has_dwarf else find_debug_file(self.obj, self._debug_roots)
        return self._debug

    @property
    def symbols(self) -> SymbolTable:
        if self._symbols is None:
            syms: list[ElfSymbol] = list(self.obj.function_symbols())
            dbg = self.debug_object
            if dbg is not None and dbg is not self.obj:
                syms.extend(dbg.function_symbols())
            self._symbols = SymbolTable(syms)
        return self._symbols

    def _dwarf_for(self) -> _Dwarf | None:
        if self._dwarf is None and not self._dwarf_failed:
            dbg = self.debug_object
            if dbg is None:
                self._dwarf_failed = True
            else:
                try:
                    self._dwarf = _Dwarf(dbg)
                except Exception:  # unreadable DWARF: fall back to symbols only
                    self._dwarf_failed = True
        return self._dwarf

    def levels(self, vaddr: int) -> tuple[_Level, ...]:
        """Frames at vaddr as (function, file, line), innermost inlined function first."""
        with self._lock:
            cached = self._levels.get(vaddr)
            if cached is not None:
                return cached
            result = self._resolve(vaddr)
            self._levels[vaddr] = result
            return result

    def _resolve(self, vaddr: int) -> tuple[_Level, ...]:
        raw = self.symbols.lookup(vaddr)
        outer_name = display_function_name(raw) if raw is not None else None
        dwarf = self._dwarf_for()
        src: SourceInfo | None = None
        if dwarf is not None:
            try:
                src = dwarf.source_info(vaddr)
            except Exception:  # malformed DWARF in one unit must not break the whole stack
                src = None
        if src is None:
            return ((outer_name, None, None),)
        if not src.inlined:
            return ((outer_name, src.file, src.line),)
        chain = src.inlined  # outermost first
        levels: list[_Level] = [(chain[-1].function, src.file, src.line)]
        for k in range(len(chain) - 1, 0, -1):
            levels.append((chain[k - 1].function, chain[k].call_file, chain[k].call_line))
        levels.append((outer_name, chain[0].call_file, chain[0].call_line))
        return tuple(levels)


# One state per build, shared by every symbolizer that holds it: a daemon's targets all map the same libc, whose
# DWARF alone is some 16 MiB once read, and a state per target made each busy or ended target pay for it again.
_shared: weakref.WeakValueDictionary[tuple[str, tuple[str, ...]], _ObjectInfo] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def _shared_info(obj: ElfObject, debug_roots: tuple[str, ...]) -> _ObjectInfo:
    """The state of obj's build (it has a build-id), made when no symbolizer holds one."""
    key = (obj.build_id or "", debug_roots)
    with _shared_lock:
        info = _shared.get(key)
        if info is None:
            info = _shared[key] = _ObjectInfo(obj, debug_roots)
        return info


# ----------------------------------------------------------------------------------------------------------
# The symbolizer


@dataclass
class _MappingIndex:
    starts: list[int] = field(default_factory=list)
    mappings: list[Mapping] = field(default_factory=list)


class Symbolizer:
    """Runtime address + recorded mappings -> Massif-style frames. Thread-safe; caches per build-id."""

    def __init__(self, debug_roots: Sequence[str] = DEFAULT_DEBUG_ROOTS) -> None:
        self.debug_roots = tuple(debug_roots)
        self._lock = threading.RLock()
        self._by_key: dict[object, _ObjectInfo] = {}
        self._by_path: dict[str, _ObjectInfo | None] = {}
        self._index_src: tuple[Mapping, ...] | None = None
        self._index = _MappingIndex()

    def close(self) -> None:
        """Let go of the objects' state; a build's DWARF is closed once no symbolizer holds it."""
        with self._lock:
            self._by_key.clear()
            self._by_path.clear()

    def __enter__(self) -> Symbolizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def object_info(self, path: str) -> _ObjectInfo | None:
        """The cached per-build state of the object at path (None when the file is gone or not ELF)."""
        with self._lock:
            if path in self._by_path:
                return self._by_path[path]
            try:
                obj = open_elf(path)
            except ElfError:
                self._by_path[path] = None
                return None
            key: object = obj.build_id if obj.build_id else (path, obj)
            info = self._by_key.get(key)
            if info is None:
                info = _shared_info(obj, self.debug_roots) if obj.build_id else _ObjectInfo(obj, self.debug_roots)
                self._by_key[key] = info
            self._by_path[path] = info
            return info

    def _find_mapping(self, mappings: Sequence[Mapping], address: int) -> Mapping | None:
        if isinstance(mappings, tuple):
            with self._lock:
                if self._index_src is not mappings:
                    ordered = sorted(mappings, key=lambda m: m.start)
                    self._index = _MappingIndex([m.start for m in ordered], ordered)
                    self._index_src = mappings
                index = self._index
            i = bisect.bisect_right(index.starts, address) - 1
            if i >= 0 and index.mappings[i].contains(address):
                return index.mappings[i]
            return None
        for m in mappings:
            if m.contains(address):
                return m
        return None

    def symbolize(self, mappings: Sequence[Mapping], address: int, *, is_return_address: bool = True) -> list[Frame]:
        """Frames for one address, innermost inlined function first, all at the same address.

        For a return address the call instruction (address - 1) is looked up, and that is also the
        address the frames carry, because it is the address Valgrind prints.
        """
        look = address - 1 if is_return_address else address
        m = self._find_mapping(mappings, look)
        if m is None:
            return [Frame(address=look)]
        info = self.object_info(m.path)
        if info is None or (m.build_id is not None and info.obj.build_id != m.build_id):
            return [Frame(address=look, obj=m.name)]
        vaddr = info.obj.file_offset_to_vaddr(look - m.start + m.offset)
        if vaddr is None:
            return [Frame(address=look, obj=m.name)]
        levels = info.levels(vaddr)
        return [
            Frame(address=look, function=fn, file=file, line=line, obj=m.name, inlined=i + 1 < len(levels))
            for i, (fn, file, line) in enumerate(levels)
        ]

    def symbolize_stack(
        self, mappings: Sequence[Mapping], addresses: Sequence[int], *, first_is_return_address: bool = True
    ) -> list[Frame]:
        """A whole stack (innermost first) as one flat list of frames; every address is taken as a return
        address except possibly the first (an instruction pointer sampled in place)."""
        maps = tuple(mappings)
        frames: list[Frame] = []
        for i, addr in enumerate(addresses):
            frames.extend(self.symbolize(maps, addr, is_return_address=first_is_return_address or i > 0))
        return frames
