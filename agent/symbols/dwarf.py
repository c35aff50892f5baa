"""Source lines and inlined calls from DWARF, the way Valgrind 3.19 reads them.

- Inlined levels come from DW_TAG_inlined_subroutine: each level is named by the DW_AT_name of its abstract
  origin (through DW_AT_specification), not demangled; a level's file:line is the call site recorded in the
  next inner level, and the innermost level's file:line comes from the line table.
- Every line-table row counts (is_stmt or not); at one address the last row wins.

Speed: only the compile unit that holds an address is parsed (found through .debug_aranges, else through a
lazily built index of CU ranges).
"""

from __future__ import annotations

import bisect
import os
import weakref
from dataclasses import dataclass
from typing import Any, BinaryIO

from elftools.dwarf.compileunit import CompileUnit
from elftools.dwarf.die import DIE
from elftools.dwarf.dwarfinfo import DWARFInfo
from elftools.dwarf.ranges import BaseAddressEntry, RangeEntry
from elftools.elf.elffile import ELFFile

from agent.symbols.elf import ElfObject


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

    def __init__(self, dwarf: Dwarf, cu: CompileUnit) -> None:
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


class Dwarf:
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

