"""Unwind tables for the in-kernel stack walker: DWARF CFI compiled into sorted, fixed-size rows.

Debian's libc, libstdc++ and loader have no frame pointers, so the BPF program walks stacks with the call-frame
information instead. It cannot interpret DWARF itself; it binary-searches a table of rows built here from
`.eh_frame` (or `.debug_frame` where that is all there is). x86-64 only.

Row layout (ROW, 12 bytes, little-endian), the contract with probes/heap.bpf.c:

    pc          u32  start of the range, an ELF virtual address of the object; a row covers [pc, next row's pc)
    cfa_type    u8   CFA_RSP / CFA_RBP: CFA = rsp|rbp + cfa_offset
                     CFA_PLT: CFA = rsp + 8, plus 8 when (pc & 15) >= 11 (the standard .plt expression)
                     CFA_NONE: no rule (gap between FDEs, or a rule we cannot express): stop or use frame pointers
                     CFA_END: outermost frame (return address undefined: _start, clone's child), and
                     the C start-up code that calls main (__libc_start_call_main...) where the object's
                     symbols or its debug file name it: Massif keeps no frame outside it, so the walk stops
    flags       u8   FLAG_RBP_SAVED: rbp was saved at CFA + rbp_offset
                     FLAG_RBP_UNKNOWN: rbp's rule is undefined or not expressible (keep the current rbp)
    (the values of CFA_* and FLAG_* are probes/heap.h's enum hs_cfa_type and HS_RBP_*)
    cfa_offset  i16
    rbp_offset  i16
    pad         u16  0

The return address is always at CFA - 8: rows of FDEs that say otherwise get CFA_NONE and are counted.
Lookups for a caller's frame use (return address - 1), like every CFI unwinder, because a call to a noreturn
function can be the last instruction of its FDE.

pyelftools parses the sections (headers, pointer encodings, CIE versions 1/3/4, instruction operands); the
instructions are interpreted here because its `get_decoded()` rejects DW_CFA_GNU_args_size (libstdc++ has
~150), scales DW_CFA_def_cfa_sf by the code alignment factor instead of the data alignment factor, and
deep-copies the whole row at every DW_CFA_remember_state.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import io
import json
import logging
import os
import struct
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from elftools.dwarf.callframe import CIE, FDE, CallFrameInfo
from elftools.dwarf.constants import DW_CFA
from elftools.dwarf.structs import DWARFStructs
from elftools.elf.elffile import ELFFile

from agent.contract import HEAP_H
from agent.symbols.debugfiles import DEFAULT_DEBUG_ROOTS, PROCESS_ROOT, find_debug_file
from agent.symbols.elf import ElfObject, open_elf
from agent.symbols.names import is_below_main

log = logging.getLogger(__name__)

ROW = struct.Struct("<IBBhhH")  # struct hs_row (probes/heap.h)

_CFA = HEAP_H.enum("hs_cfa_type")
CFA_RSP, CFA_RBP, CFA_PLT, CFA_NONE, CFA_END = (
    _CFA[f"HS_CFA_{name}"] for name in ("RSP", "RBP", "PLT", "NONE", "END")
)
FLAG_RBP_SAVED, FLAG_RBP_UNKNOWN = HEAP_H.value("HS_RBP_SAVED"), HEAP_H.value("HS_RBP_UNKNOWN")

# x86-64 DWARF register numbers (System V psABI, figure 3.36).
REG_RBP, REG_RSP, REG_RA = 6, 7, 16
REG_NAMES = ("rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp", *(f"r{i}" for i in range(8, 16)), "rip")

# The CFA expression binutils emits for every 16-byte .plt entry: the stub pushes once more from offset 11 on.
# DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_lit11; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus
PLT_EXPRESSION = bytes((0x77, 0x08, 0x80, 0x00, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22))

Source = Literal["eh_frame", "debug_frame", "eh_frame+debug_frame", "none"]

_MAX_PC = 0xFFFFFFFF  # a row's pc is a u32, and the last FDE's end needs a row too
FORMAT_VERSION = 4  # bump when the rows or the rules change: old cache files are then ignored
DEFAULT_CACHE_ROOT = "/var/cache/heapscope"

# Why a row got CFA_NONE (keys of UnwindTable.reasons).
WHY_CFA_EXPR = "CFA is a DWARF expression other than the .plt one"
WHY_CFA_REG = "CFA is based on a register other than rsp/rbp"
WHY_CFA_RANGE = "CFA offset does not fit in 16 bits"
WHY_RA_RULE = "return address not at CFA-8"
WHY_SIGNAL = "signal trampoline (CIE augmentation 'S')"
WHY_SET_LOC = "DW_CFA_set_loc in .eh_frame"
WHY_NO_CFA = "no CFA rule"


class UnwindError(Exception):
    """The object's call-frame information could not be read."""


@dataclass(frozen=True)
class Rule:
    """What the table says for one address: the row that covers it."""

    pc: int  # start of the row (ELF virtual address)
    cfa_type: int
    flags: int
    cfa_offset: int
    rbp_offset: int

    @property
    def rbp_saved(self) -> bool:
        return bool(self.flags & FLAG_RBP_SAVED)


@dataclass(frozen=True)
class UnwindTable:
    """The unwind rows of one ELF object, ROW-packed and sorted by pc."""

    build_id: str | None
    rows: bytes
    n_rows: int
    source: Source
    build_seconds: float  # time build_table took (a cached table keeps the figure of its build)
    unsupported: int  # CFI rows (one per location change, as readelf lists them) that got CFA_NONE
    reasons: tuple[tuple[str, int], ...] = ()  # unsupported, broken down by cause (sorted by cause)
    skipped_fdes: int = 0  # FDEs outside every executable PT_LOAD segment, or ending above 4 GiB

    def iter_rules(self) -> Iterable[Rule]:
        for pc, cfa_type, flags, cfa_off, rbp_off, _pad in ROW.iter_unpack(self.rows):
            yield Rule(pc, cfa_type, flags, cfa_off, rbp_off)

    def type_counts(self) -> dict[int, int]:
        """Rows per cfa_type (after merging)."""
        return dict(Counter(row[1] for row in ROW.iter_unpack(self.rows)))


# ---------------------------------------------------------------------------------------------------------
# Interpreting the CFI program
#
# Only three columns matter to the walker: the CFA, rbp and the return address. A register rule is a small
# tuple: (SAME,) unspecified or same_value; (OFFSET, n) saved at CFA+n; (UNDEF,); (OTHER, kind) any rule the
# format cannot express (kind 0 register, 1 expression or val_expression, 2 val_offset).

SAME, OFFSET, UNDEF, OTHER = 0, 1, 2, 3
_SAME_RULE: tuple[int, ...] = (SAME,)

# State: (cfa_reg, cfa_offset, cfa_expr, rbp_rule, ra_rule); cfa_reg is -1 for an expression, -2 if unset.
_State = tuple[int, int, bytes, tuple[int, ...], tuple[int, ...]]
_Encoded = tuple[int, int, int, int, str | None]  # cfa_type, flags, cfa_offset, rbp_offset, reason


def _encode(state: _State) -> _Encoded:
    cfa_reg, cfa_off, cfa_expr, rbp_rule, ra_rule = state
    if ra_rule[0] == UNDEF:
        return CFA_END, 0, 0, 0, None
    if ra_rule != (OFFSET, -8):
        return CFA_NONE, 0, 0, 0, WHY_RA_RULE
    if cfa_reg == -1:
        if cfa_expr != PLT_EXPRESSION:
            return CFA_NONE, 0, 0, 0, WHY_CFA_EXPR
        cfa_type, cfa_off = CFA_PLT, 8
    elif cfa_reg == REG_RSP:
        cfa_type = CFA_RSP
    elif cfa_reg == REG_RBP:
        cfa_type = CFA_RBP
    elif cfa_reg == -2:
        return CFA_NONE, 0, 0, 0, WHY_NO_CFA
    else:
        return CFA_NONE, 0, 0, 0, WHY_CFA_REG
    if not -0x8000 <= cfa_off < 0x8000:
        return CFA_NONE, 0, 0, 0, WHY_CFA_RANGE
    if rbp_rule[0] == OFFSET and rbp_rule[1] < 0 and rbp_rule[1] % 8 == 0 and rbp_rule[1] >= -0x8000:
        return cfa_type, FLAG_RBP_SAVED, cfa_off, rbp_rule[1], None
    if rbp_rule[0] == SAME:
        return cfa_type, 0, cfa_off, 0, None
    return cfa_type, FLAG_RBP_UNKNOWN, cfa_off, 0, None


@dataclass
class _Cie:
    code_align: int
    data_align: int
    ra_reg: int
    signal: bool
    initial: _State


def _rule_for(reg: int, state: _State, rule: tuple[int, ...], ra_reg: int) -> _State:
    if reg == REG_RBP:
        return state[0], state[1], state[2], rule, state[4]
    if reg == ra_reg:
        return state[0], state[1], state[2], state[3], rule
    return state


_ADVANCES = (DW_CFA.advance_loc, DW_CFA.advance_loc1, DW_CFA.advance_loc2, DW_CFA.advance_loc4)
_OFFSETS = (DW_CFA.offset, DW_CFA.offset_extended, DW_CFA.offset_extended_sf)
_VAL_OFFSETS = (DW_CFA.val_offset, DW_CFA.val_offset_sf)
_IGNORED = (DW_CFA.nop, DW_CFA.GNU_args_size)


def _run(
    instructions: list[Any],
    cie: _Cie,
    pc: int,
    state: _State,
    rows: list[tuple[int, _State]] | None,
    for_eh_frame: bool,
) -> tuple[_State, int, str | None]:
    """Interpret a CFI program from (pc, state). Appends (pc, state) to rows at each advance (as readelf does)
    and returns the final state and pc. For a CIE's own program rows is None.

    The reason is set when the program cannot be followed: the caller marks the code from pc on unsupported.
    """
    code_align, data_align, ra_reg = cie.code_align, cie.data_align, cie.ra_reg
    stack: list[_State] = []
    for ins in instructions:
        op = ins.opcode
        args = ins.args
        if op in _ADVANCES:
            if rows is not None:
                rows.append((pc, state))
            pc += args[0] * code_align
        elif op in _OFFSETS:
            state = _rule_for(args[0], state, (OFFSET, args[1] * data_align), ra_reg)
        elif op == DW_CFA.def_cfa_offset:
            state = (state[0], args[0], state[2], state[3], state[4])
        elif op == DW_CFA.def_cfa:
            state = (args[0], args[1], b"", state[3], state[4])
        elif op == DW_CFA.def_cfa_register:
            # After an expression there is no offset to keep; DWARF calls that ill-formed, treat it as 0.
            state = (args[0], state[1] if state[0] >= 0 else 0, b"", state[3], state[4])
        elif op == DW_CFA.def_cfa_sf:
            state = (args[0], args[1] * data_align, b"", state[3], state[4])
        elif op == DW_CFA.def_cfa_offset_sf:
            state = (state[0], args[0] * data_align, state[2], state[3], state[4])
        elif op == DW_CFA.def_cfa_expression:
            state = (-1, 0, bytes(args[0]), state[3], state[4])
        elif op == DW_CFA.remember_state:
            stack.append(state)
        elif op == DW_CFA.restore_state:
            if not stack:
                return state, pc, "DW_CFA_restore_state without remember_state"
            state = stack.pop()
        elif op in (DW_CFA.restore, DW_CFA.restore_extended):
            if rows is None:
                return state, pc, "DW_CFA_restore in a CIE"
            reg = args[0]
            initial = cie.initial[3] if reg == REG_RBP else cie.initial[4] if reg == ra_reg else _SAME_RULE
            state = _rule_for(reg, state, initial, ra_reg)
        elif op == DW_CFA.undefined:
            state = _rule_for(args[0], state, (UNDEF,), ra_reg)
        elif op == DW_CFA.same_value:
            state = _rule_for(args[0], state, _SAME_RULE, ra_reg)
        elif op == DW_CFA.register:
            state = _rule_for(args[0], state, (OTHER, 0), ra_reg)
        elif op in (DW_CFA.expression, DW_CFA.val_expression):
            state = _rule_for(args[0], state, (OTHER, 1), ra_reg)
        elif op in _VAL_OFFSETS:
            state = _rule_for(args[0], state, (OTHER, 2), ra_reg)
        elif op in _IGNORED:
            pass
        elif op == DW_CFA.set_loc:
            # pyelftools reads the operand as a plain address; in .eh_frame it uses the FDE's pointer encoding.
            if for_eh_frame:
                return state, pc, WHY_SET_LOC
            if rows is not None:
                rows.append((pc, state))
            pc = args[0]
        else:
            return state, pc, f"unknown CFI opcode {int(op):#x}"
    if rows is not None:
        rows.append((pc, state))
    return state, pc, None


# ---------------------------------------------------------------------------------------------------------
# Building a table


@dataclass
class _Fde:
    start: int
    end: int
    rows: list[tuple[int, _Encoded]]  # (pc, encoded rule), in program order, all within [start, end)


class _CallFrameInfo(CallFrameInfo):
    """pyelftools' parser, also accepting the "S" augmentation gas writes into .debug_frame CIEs of signal
    trampolines (pyelftools insists on a leading "z"; without one there is no augmentation data to skip)."""

    def _parse_cie_augmentation(self, header: Any, entry_structs: DWARFStructs) -> Any:
        augmentation = header.get("augmentation") or b""
        if augmentation and not augmentation.startswith(b"z") and set(augmentation) <= set(b"S"):
            return b"", {}
        return super()._parse_cie_augmentation(header, entry_structs)


def _cfi_entries(elf: ELFFile, name: str) -> list[Any] | None:
    sec = elf.get_section_by_name(name)
    if sec is None or sec["sh_type"] == "SHT_NOBITS" or sec.data_size == 0:
        return None
    data = sec.data()
    structs = DWARFStructs(little_endian=elf.little_endian, dwarf_format=32, address_size=elf.elfclass // 8)
    cfi = _CallFrameInfo(
        stream=io.BytesIO(data),
        size=len(data),
        address=sec["sh_addr"],
        base_structs=structs,
        for_eh_frame=name == ".eh_frame",
    )
    return cfi.get_entries()


def _compile_fdes(entries: list[Any], for_eh_frame: bool) -> list[_Fde]:
    cies: dict[int, _Cie] = {}
    memo: dict[_State, _Encoded] = {}
    out: list[_Fde] = []
    for entry in entries:
        if isinstance(entry, CIE):
            continue
        if not isinstance(entry, FDE) or entry.cie is None:
            continue  # ZERO terminators
        cie = cies.get(entry.cie.offset)
        if cie is None:
            cie = _compile_cie(entry.cie)
            cies[entry.cie.offset] = cie
        start = entry.header["initial_location"]
        end = start + entry.header["address_range"]
        if end <= start:
            continue
        raw: list[tuple[int, _State]] = []
        _final, stop_pc, failed = _run(entry.instructions, cie, start, cie.initial, raw, for_eh_frame)
        if failed is not None:
            # The code from the instruction we could not follow on has no known rule.
            raw = [r for r in raw if r[0] < stop_pc]
        rows: list[tuple[int, _Encoded]] = []
        for pc, st in raw:
            if pc >= end or (rows and pc < rows[-1][0]):
                continue
            if cie.ra_reg != REG_RA:
                enc: _Encoded = (CFA_NONE, 0, 0, 0, WHY_RA_RULE)
            elif cie.signal:
                enc = (CFA_NONE, 0, 0, 0, WHY_SIGNAL)
            else:
                enc = memo.get(st) or memo.setdefault(st, _encode(st))
            if rows and rows[-1][0] == pc:
                rows[-1] = (pc, enc)  # a zero advance: the later rule wins
            else:
                rows.append((pc, enc))
        if failed is not None and stop_pc < end:
            if rows and rows[-1][0] == stop_pc:
                rows.pop()
            rows.append((stop_pc, (CFA_NONE, 0, 0, 0, failed)))
        if not rows or rows[0][0] != start:
            rows.insert(0, (start, _encode(cie.initial)))
        out.append(_Fde(start, end, rows))
    return out


def _compile_cie(cie: CIE) -> _Cie:
    aug = cie.header.get("augmentation") or b""
    base = _Cie(
        code_align=cie["code_alignment_factor"],
        data_align=cie["data_alignment_factor"],
        ra_reg=cie["return_address_register"],
        signal=b"S" in aug,
        initial=(-2, 0, b"", _SAME_RULE, _SAME_RULE),
    )
    initial, _pc, _failed = _run(cie.instructions, base, 0, base.initial, None, False)
    # A CIE program cannot be split by location; a failure leaves the rules it had reached.
    base.initial = initial
    return base


def _executable_ranges(obj: ElfObject) -> list[tuple[int, int]]:
    return sorted((s.vaddr, s.vaddr + s.memsz) for s in obj.segments if s.executable)


def _within(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(lo <= start and end <= hi for lo, hi in ranges)


def _assemble(fdes: list[_Fde], reasons: Counter[str]) -> bytes:
    """Sort the FDEs, cut overlaps, end each one with a no-rule row, merge identical neighbours, pack."""
    fdes.sort(key=lambda f: f.start)
    packed: list[bytes] = []
    last: tuple[int, int, int, int] | None = None

    def emit(pc: int, enc: _Encoded) -> None:
        nonlocal last
        key = enc[:4]
        if key == last:
            return
        last = key
        packed.append(ROW.pack(pc, *key, 0))

    for i, fde in enumerate(fdes):
        end = fde.end
        nxt = fdes[i + 1].start if i + 1 < len(fdes) else None
        if nxt is not None and nxt < end:
            end = nxt  # overlapping FDEs: the later one wins from its start on
        if fde.start >= end:
            continue
        for pc, enc in fde.rows:
            if pc >= end:
                break
            if enc[4] is not None:
                reasons[enc[4]] += 1
            emit(pc, enc)
        if nxt is None or nxt > end:
            emit(end, (CFA_NONE, 0, 0, 0, None))
    return b"".join(packed)


def build_table(path: str) -> UnwindTable:
    """Compile the CFI of one ELF object into an UnwindTable. Reads the file; no cache.

    `.eh_frame` is used first; `.debug_frame` FDEs fill the code that `.eh_frame` does not cover (an executable
    built with -fno-asynchronous-unwind-tables has .eh_frame only for the C runtime's _start).
    Raises agent.symbols.elf.ElfError for a missing or non-ELF file, UnwindError for CFI that cannot be parsed.
    """
    t0 = time.perf_counter()
    obj = open_elf(path)
    ranges = _executable_ranges(obj)
    reasons: Counter[str] = Counter()
    fh, elf = obj.open_elffile()
    with fh:
        if elf.get_machine_arch() != "x64":
            raise UnwindError(f"{path}: unwind tables are built for x86-64 only, not {elf.get_machine_arch()}")
        per_section: dict[str, list[_Fde]] = {}
        for name in (".eh_frame", ".debug_frame"):
            try:
                entries = _cfi_entries(elf, name)
            except Exception as exc:  # pyelftools raises assertion, construct and ELF errors alike
                raise UnwindError(f"{path}: cannot parse {name}: {exc}") from exc
            if entries is not None:
                per_section[name] = _compile_fdes(entries, name == ".eh_frame")

    fdes: list[_Fde] = []
    skipped = 0
    used: list[str] = []
    for name in (".eh_frame", ".debug_frame"):
        taken = 0
        covered = sorted((f.start, f.end) for f in fdes)
        for fde in per_section.get(name, []):
            if not _within(ranges, fde.start, fde.end) or fde.end > _MAX_PC:
                skipped += 1  # discarded code (address 0 or a tombstone), or beyond the u32 pc of a row
                continue
            if covered and _overlaps(covered, fde.start, fde.end):
                continue  # .eh_frame already describes this code
            fdes.append(fde)
            taken += 1
        if taken:
            used.append(name[1:])
    outermost = _below_main_ranges(obj)
    if outermost:
        # Each start-up function becomes one outermost row; FDEs inside one give way.
        fdes = [f for f in fdes if not any(lo <= f.start and f.end <= hi for lo, hi in outermost)]
        fdes += [_Fde(lo, hi, [(lo, (CFA_END, 0, 0, 0, None))]) for lo, hi in outermost]
    rows = _assemble(fdes, reasons)
    source: Source = "+".join(used) if used else "none"  # type: ignore[assignment]
    return UnwindTable(
        build_id=obj.build_id,
        rows=rows,
        n_rows=len(rows) // ROW.size,
        source=source,
        build_seconds=time.perf_counter() - t0,
        unsupported=sum(reasons.values()),
        reasons=tuple(sorted(reasons.items())),
        skipped_fdes=skipped,
    )


def _below_main_ranges(obj: ElfObject) -> list[tuple[int, int]]:
    """Where the C start-up functions that call main lie, by the symbols of the object and its debug file.

    Massif cuts every stack at main, or without main at the innermost of these: nothing outside them is ever
    shown, so the kernel's walk ends in them instead of reading two or three more frames per call.

    Valgrind matches the name as its symbol table has it, version included: glibc's
    `__libc_start_main@@GLIBC_2.34` is not below main for it, so the stacks of static constructors (run from
    there, with no main) go on to the program's entry point. A range is outermost only when every symbol on it
    has a below-main name as it stands.
    """
    names: dict[tuple[int, int], list[str]] = {}
    debug = find_debug_file(obj, DEFAULT_DEBUG_ROOTS)
    for source in (obj, debug):
        if source is None:
            continue
        for sym in source.function_symbols():
            if sym.size:
                names.setdefault((sym.value, sym.value + sym.size), []).append(sym.name)
    return sorted(r for r, found in names.items() if all(is_below_main(n) for n in found))


def _overlaps(covered: list[tuple[int, int]], start: int, end: int) -> bool:
    i = bisect.bisect_right(covered, (start, 1 << 64))
    if i > 0 and covered[i - 1][1] > start:
        return True
    return i < len(covered) and covered[i][0] < end


# ---------------------------------------------------------------------------------------------------------
# Lookup and the reference walker


def lookup(table: UnwindTable, vaddr: int) -> Rule:
    """The row covering an ELF virtual address (what the BPF binary search does). No row: CFA_NONE."""
    rows = table.rows
    i = bisect.bisect_right(range(table.n_rows), vaddr, key=lambda k: ROW.unpack_from(rows, k * ROW.size)[0])
    if i == 0:
        return Rule(vaddr, CFA_NONE, 0, 0, 0)
    pc, cfa_type, flags, cfa_off, rbp_off, _pad = ROW.unpack_from(rows, (i - 1) * ROW.size)
    return Rule(pc, cfa_type, flags, cfa_off, rbp_off)


# ---------------------------------------------------------------------------------------------------------
# The on-disk cache
#
# File: header, JSON metadata, rows, SHA-256 of everything before it. Anything that does not check out is
# rebuilt. Named by build-id (or by a hash of path, size and mtime for objects without one) and FORMAT_VERSION.

_MAGIC = b"HSUNWIND"
_HEADER = struct.Struct("<8sIII")  # magic, format version, metadata length, rows length
_DIGEST = 32


def default_cache_dir() -> str:
    """$HEAPSCOPE_CACHE_DIR/unwind, else /var/cache/heapscope/unwind."""
    return os.path.join(os.environ.get("HEAPSCOPE_CACHE_DIR") or DEFAULT_CACHE_ROOT, "unwind")


def cache_key(path: str, build_id: str | None, with_debug: bool = False) -> str:
    """The cache file's name. A table built with the object's debug file differs (its start-up code is marked
    outermost), so installing the debug file later builds the table again."""
    suffix = f"{'.dbg' if with_debug else ''}.v{FORMAT_VERSION}.uwt"
    if build_id and all(c in "0123456789abcdef" for c in build_id.lower()):
        return f"{build_id.lower()}{suffix}"
    st = os.stat(path)
    ident = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return f"path-{hashlib.sha256(ident).hexdigest()[:40]}{suffix}"


def serialize(table: UnwindTable) -> bytes:
    meta = json.dumps(
        {
            "build_id": table.build_id,
            "n_rows": table.n_rows,
            "source": table.source,
            "build_seconds": table.build_seconds,
            "unsupported": table.unsupported,
            "reasons": [list(r) for r in table.reasons],
            "skipped_fdes": table.skipped_fdes,
        },
        sort_keys=True,
    ).encode()
    body = _HEADER.pack(_MAGIC, FORMAT_VERSION, len(meta), len(table.rows)) + meta + table.rows
    return body + hashlib.sha256(body).digest()


def deserialize(data: bytes) -> UnwindTable | None:
    """The table stored in a cache file, or None when the file is not one, is truncated or was altered."""
    if len(data) < _HEADER.size + _DIGEST:
        return None
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        return None
    magic, version, meta_len, rows_len = _HEADER.unpack_from(body)
    if magic != _MAGIC or version != FORMAT_VERSION or _HEADER.size + meta_len + rows_len != len(body):
        return None
    try:
        meta = json.loads(body[_HEADER.size : _HEADER.size + meta_len])
        rows = body[_HEADER.size + meta_len :]
        if rows_len % ROW.size or meta["n_rows"] != rows_len // ROW.size:
            return None
        return UnwindTable(
            build_id=meta["build_id"],
            rows=bytes(rows),
            n_rows=meta["n_rows"],
            source=meta["source"],
            build_seconds=float(meta["build_seconds"]),
            unsupported=int(meta["unsupported"]),
            reasons=tuple((str(k), int(v)) for k, v in meta["reasons"]),
            skipped_fdes=int(meta["skipped_fdes"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


# Tables read from the cache lately, by cache file (its name is the build's): a daemon's every further target maps
# the same objects, and reading and checking libc's table again took milliseconds of each attach. Room for a few
# programs' every object: postgres alone maps 43, and a smaller room read each again at every new backend.
_RECENT_TABLES = 256
_recent_tables: OrderedDict[str, tuple[tuple[int, int, int], UnwindTable]] = OrderedDict()
_recent_lock = threading.Lock()


# Whether an object has a debug file, as looked up lately: the look is a dozen stats and real paths, at every
# object of every new process; a debug package installed meanwhile is seen within this time.
_DEBUG_LOOK_SECONDS = 30.0
_debug_looks: dict[tuple[str, str, tuple[int, int] | None], tuple[float, bool]] = {}


def _has_debug_file(obj: ElfObject) -> bool:
    inside = PROCESS_ROOT.match(obj.path)
    try:  # a container's debug files are looked for inside it first: the look is its root's (not its PID's)
        root = os.stat(inside.group(0)) if inside else None
    except OSError:
        return find_debug_file(obj, DEFAULT_DEBUG_ROOTS) is not None
    key = (obj.build_id or obj.path, str(obj.debuglink), (root.st_dev, root.st_ino) if root else None)
    now = time.monotonic()
    with _recent_lock:
        known = _debug_looks.get(key)
    if known is not None and now - known[0] < _DEBUG_LOOK_SECONDS:
        return known[1]
    found = find_debug_file(obj, DEFAULT_DEBUG_ROOTS) is not None
    with _recent_lock:
        if len(_debug_looks) > 4096:  # one entry a build and process root: dropped wholesale once many
            _debug_looks.clear()
        _debug_looks[key] = (now, found)
    return found


def load_table(path: str, cache_dir: str | None = None) -> UnwindTable:
    """build_table(path), through the on-disk cache (default_cache_dir() unless cache_dir is given).

    A cache that cannot be written (no permission, full disk) is logged and the built table returned.
    """
    directory = cache_dir if cache_dir is not None else default_cache_dir()
    obj = open_elf(path)
    with_debug = _has_debug_file(obj)
    target = os.path.join(directory, cache_key(path, obj.build_id, with_debug))
    try:
        with open(target, "rb") as fh:
            st = os.fstat(fh.fileno())
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)  # the file as it is now, rewritten or not
            with _recent_lock:
                known = _recent_tables.get(target)
                if known is not None and known[0] == ident:
                    _recent_tables.move_to_end(target)
                    return known[1]
            cached = deserialize(fh.read())
        if cached is not None and cached.build_id == obj.build_id:
            with _recent_lock:
                _recent_tables[target] = (ident, cached)
                while len(_recent_tables) > _RECENT_TABLES:
                    _recent_tables.popitem(last=False)
            return cached
        log.warning("unwind cache %s is corrupt or stale: rebuilding it", target)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot read unwind cache %s: %s", target, exc)
    table = build_table(path)
    try:
        _write_atomically(directory, target, serialize(table))
    except OSError as exc:
        log.warning("cannot write unwind cache %s: %s", target, exc)
    return table


def _write_atomically(directory: str, target: str, data: bytes) -> None:
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".uwt")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)  # readers see the old file or the whole new one, never a part
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


__all__ = [
    "CFA_END",
    "CFA_NONE",
    "CFA_PLT",
    "CFA_RBP",
    "CFA_RSP",
    "FLAG_RBP_SAVED",
    "FLAG_RBP_UNKNOWN",
    "ROW",
    "Rule",
    "UnwindError",
    "UnwindTable",
    "build_table",
    "default_cache_dir",
    "load_table",
    "lookup",
]
