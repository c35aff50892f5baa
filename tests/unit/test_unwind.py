"""Unwind-table tests. Judges: readelf's interpretation of the CFI (`--debug-dump=frames-interp`) and gdb's
backtraces (gdb unwinds with the same CFI). No root needed.

Three layers:
- crafted CFI (an assembly file with explicit .cfi directives, in .eh_frame and in .debug_frame with CIE versions
  1 and 4): every rule kind lands in the row the DWARF standard says, and readelf agrees;
- every row of libc, libstdc++, the loader and gcc-built programs equals readelf's row for that address;
- real stacks: programs stopped by gdb inside -fomit-frame-pointer code called back by libc's qsort (main thread
  and a pthread, at a function's entry and after its prologue, in malloc called by strdup) are walked by
  unwind_python() over gdb's register and stack dump, and give gdb's frames.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.symbols.elf import open_elf
from agent.symbols.unwind import (
    CFA_END,
    CFA_NONE,
    CFA_PLT,
    CFA_RBP,
    CFA_RSP,
    FLAG_RBP_SAVED,
    FLAG_RBP_UNKNOWN,
    ROW,
    Rule,
    UnwindTable,
    build_table,
    cache_key,
    default_cache_dir,
    load_table,
    lookup,
    serialize,
)
from tests.support.capability import require
from tests.support.reference import unwind_python

SYSTEM_LIBS = {
    "libc": "/lib/x86_64-linux-gnu/libc.so.6",
    "libstdc++": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
    "ld.so": "/lib64/ld-linux-x86-64.so.2",
}


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, cwd=cwd).stdout


def readelf(*args: str | Path) -> str:
    # readelf exits 1 on the loader without saying why (its output is complete), so judge the output instead.
    proc = subprocess.run(["readelf", *map(str, args)], capture_output=True, text=True)
    assert "Contents of the" in proc.stdout, proc.stderr
    return proc.stdout


# ----------------------------------------------------------------------------------------------------------
# readelf as the judge


@dataclass
class Fde:
    section: str
    offset: int
    start: int
    end: int
    cie: int  # offset of its CIE in the same section
    rows: list[tuple[int, dict[str, str]]] = field(default_factory=list)


@dataclass
class Cie:
    augmentation: str
    ra_column: int
    rows: list[tuple[int, dict[str, str]]] = field(default_factory=list)


# How readelf spells the CFA expression of a .plt entry (which the table stores as CFA_PLT).
PLT_EXPRESSION_TEXT = (
    "DW_OP_breg7 (rsp): 8; DW_OP_breg16 (rip): 0; DW_OP_lit15; DW_OP_and; DW_OP_lit11; DW_OP_ge; "
    "DW_OP_lit3; DW_OP_shl; DW_OP_plus"
)


def readelf_cfa_expressions(path: Path | str) -> dict[tuple[str, int], set[str]]:
    """The DW_CFA_def_cfa_expression operands of each FDE, as `readelf --debug-dump=frames` decodes them."""
    out = readelf("--wide", "--debug-dump=frames", path)
    found: dict[tuple[str, int], set[str]] = {}
    section, entry = "", -1
    for line in out.splitlines():
        if m := _SECTION.match(line):
            section = m.group(1)
        elif m := _ENTRY.match(line):
            entry = int(m.group(1), 16)
        elif m := re.match(r"^\s+DW_CFA_def_cfa_expression \((.*)\)$", line):
            found.setdefault((section, entry), set()).add(m.group(1))
    return found


_SECTION = re.compile(r"^Contents of the (\.\w+) section")
_ENTRY = re.compile(r"^([0-9a-f]{8,16}) [0-9a-f]{8,16} [0-9a-f]{8,16} (CIE|FDE) (.*)$")
_CIE_HDR = re.compile(r'^"(.*)" cf=-?\d+ df=-?\d+ ra=(\d+)')
_FDE_HDR = re.compile(r"^cie=([0-9a-f]+) pc=([0-9a-f]+)\.\.([0-9a-f]+)")
_ROW = re.compile(r"^([0-9a-f]{8,16}) (.*)$")
_REGISTER_RULE = re.compile(r"\b(r\d+) \(\w+\)")  # "r9 (r9)": register rules print a name in parentheses


def readelf_frames(path: Path | str) -> tuple[dict[tuple[str, int], Cie], list[Fde]]:
    """Parse `readelf --debug-dump=frames-interp`: CIEs by (section, offset) and FDEs with their rows."""
    out = readelf("--wide", "--debug-dump=frames-interp", path)
    cies: dict[tuple[str, int], Cie] = {}
    fdes: list[Fde] = []
    section = ""
    current: Cie | Fde | None = None
    columns: list[str] = []
    for line in out.splitlines():
        if m := _SECTION.match(line):
            section, current = m.group(1), None
            continue
        if m := _ENTRY.match(line):
            offset, kind, rest = int(m.group(1), 16), m.group(2), m.group(3)
            if kind == "CIE":
                h = _CIE_HDR.match(rest)
                assert h, line
                current = Cie(h.group(1), int(h.group(2)))
                cies[(section, offset)] = current
            else:
                h = _FDE_HDR.match(rest)
                assert h, line
                current = Fde(section, offset, int(h.group(2), 16), int(h.group(3), 16), int(h.group(1), 16))
                fdes.append(current)
            continue
        stripped = line.strip()
        if stripped.startswith("LOC"):
            columns = stripped.split()[1:]
            continue
        if current is not None and (m := _ROW.match(line)):
            values = _REGISTER_RULE.sub(r"\1", m.group(2)).split()
            assert len(values) == len(columns), line
            current.rows.append((int(m.group(1), 16), dict(zip(columns, values, strict=True))))
        elif not stripped:
            current = None
    return cies, fdes


@dataclass(frozen=True)
class Expected:
    cfa_type: int
    cfa_offset: int = 0
    rbp_saved_at: int | None = None  # rbp_offset when FLAG_RBP_SAVED is expected
    rbp_may_be_unknown: bool = False  # readelf's "u": not yet saved (flags 0) or DW_CFA_undefined (bit1)
    rbp_unknown: bool = False


def expected_rule(cols: dict[str, str], cie: Cie, plt_expression: bool) -> Expected:
    """The row readelf's columns call for, under the contract in agent/symbols/unwind.py."""
    ra = cols.get("ra", "s")
    if ra == "u":
        return Expected(CFA_END)
    if cie.ra_column != 16 or ra != "c-8" or "S" in cie.augmentation:
        return Expected(CFA_NONE)
    cfa = cols["CFA"]
    if cfa == "exp":
        return Expected(CFA_PLT, 8) if plt_expression else Expected(CFA_NONE)
    m = re.fullmatch(r"(rsp|rbp)([+-]\d+)", cfa)
    if not m or not -0x8000 <= int(m.group(2)) < 0x8000:
        return Expected(CFA_NONE)
    cfa_type = CFA_RSP if m.group(1) == "rsp" else CFA_RBP
    rbp = cols.get("rbp", "s")
    if (r := re.fullmatch(r"c(-\d+)", rbp)) and int(r.group(1)) % 8 == 0 and int(r.group(1)) >= -0x8000:
        return Expected(cfa_type, int(m.group(2)), rbp_saved_at=int(r.group(1)))
    if rbp == "s":
        return Expected(cfa_type, int(m.group(2)))
    if rbp == "u":
        return Expected(cfa_type, int(m.group(2)), rbp_may_be_unknown=True)
    return Expected(cfa_type, int(m.group(2)), rbp_unknown=True)


def matches(rule: Rule, exp: Expected) -> bool:
    if rule.cfa_type != exp.cfa_type:
        return False
    if exp.cfa_type in (CFA_NONE, CFA_END):
        return rule.flags == 0 and rule.cfa_offset == 0 and rule.rbp_offset == 0
    if rule.cfa_offset != exp.cfa_offset:
        return False
    if exp.rbp_saved_at is not None:
        return rule.flags == FLAG_RBP_SAVED and rule.rbp_offset == exp.rbp_saved_at
    if exp.rbp_unknown:
        return rule.flags == FLAG_RBP_UNKNOWN and rule.rbp_offset == 0
    allowed = {0, FLAG_RBP_UNKNOWN} if exp.rbp_may_be_unknown else {0}
    return rule.flags in allowed and rule.rbp_offset == 0


BELOW_MAIN_NAMES = {"__libc_start_main", "__libc_start_call_main", "generic_start_main"}


def readelf_below_main(path: Path | str) -> list[tuple[int, int]]:
    """The C start-up functions that call main, from readelf's symbol tables of the object and of its debug
    file under /usr/lib/debug/.build-id: the table marks them outermost (CFA_END)."""
    files = [str(path)]
    build_id = open_elf(str(path)).build_id
    if build_id:
        debug = f"/usr/lib/debug/.build-id/{build_id[:2]}/{build_id[2:]}.debug"
        if os.path.exists(debug):
            files.append(debug)
    # Valgrind matches names as they stand: a range with a versioned name (__libc_start_main@@GLIBC_2.34) or
    # any other name is not below main for it.
    names: dict[tuple[int, int], list[str]] = {}
    for file in files:
        out = subprocess.run(["readelf", "-sW", file], capture_output=True, text=True).stdout
        for line in out.splitlines():
            cols = line.split()  # Num: Value Size Type Bind Vis Ndx Name
            if len(cols) < 8 or cols[3] != "FUNC" or cols[6] == "UND":
                continue
            size = int(cols[2], 0)
            if size:
                names.setdefault((int(cols[1], 16), int(cols[1], 16) + size), []).append(cols[7])

    def below(name: str) -> bool:
        return name in BELOW_MAIN_NAMES or name.startswith(("__libc_start_main.", "generic_start_main."))

    return sorted(r for r, found in names.items() if all(below(n) for n in found))


def compare_with_readelf(path: Path | str) -> tuple[UnwindTable, int]:
    """Check every readelf row (and every FDE end) against lookup(); return the table and the rows checked.
    The start-up code that calls main must be one CFA_END row each instead of its FDE's rows."""
    table = build_table(str(path))
    cies, fdes = readelf_frames(path)
    obj = open_elf(str(path))
    exec_ranges = [(s.vaddr, s.vaddr + s.memsz) for s in obj.segments if s.executable]
    expressions = readelf_cfa_expressions(path)
    below_main = readelf_below_main(path)
    fdes = [f for f in fdes if not any(lo <= f.start and f.end <= hi for lo, hi in below_main)]

    # The same choice build_table documents: .eh_frame first, .debug_frame for code .eh_frame leaves out.
    chosen: list[Fde] = []
    for section in (".eh_frame", ".debug_frame"):
        taken = [(f.start, f.end) for f in chosen]
        for fde in fdes:
            if fde.section != section or fde.end <= fde.start:
                continue
            if not any(lo <= fde.start and fde.end <= hi for lo, hi in exec_ranges):
                continue
            if any(s < fde.end and fde.start < e for s, e in taken):
                continue
            chosen.append(fde)
    chosen.sort(key=lambda f: f.start)
    starts = {f.start for f in chosen} | {lo for lo, _hi in below_main}

    mismatches: list[str] = []
    boundaries: set[int] = set()
    checked = 0
    unsupported = 0
    for fde in chosen:
        cie = cies[(fde.section, fde.cie)]
        rows = {pc: cols for pc, cols in (fde.rows or [(fde.start, cie.rows[-1][1])]) if fde.start <= pc < fde.end}
        boundaries.update(rows)
        boundaries.add(fde.end)
        for pc, cols in rows.items():
            exp = expected_rule(cols, cie, expressions.get((fde.section, fde.offset)) == {PLT_EXPRESSION_TEXT})
            unsupported += exp.cfa_type == CFA_NONE
            got = lookup(table, pc)
            checked += 1
            if not matches(got, exp):
                mismatches.append(f"{fde.section} 0x{pc:x}: readelf {cols} -> {exp}, table {got}")
        if fde.end not in starts:
            got = lookup(table, fde.end)
            checked += 1
            if got.cfa_type != CFA_NONE:
                mismatches.append(f"0x{fde.end:x}: end of FDE 0x{fde.start:x} has rule {got}")
    for lo, hi in below_main:
        boundaries.update((lo, hi))
        for pc in (lo, hi - 1):
            checked += 1
            if lookup(table, pc).cfa_type != CFA_END:
                mismatches.append(f"0x{pc:x}: start-up code calling main has rule {lookup(table, pc)}, not CFA_END")
    extra = [r.pc for r in table.iter_rules() if r.pc not in boundaries]
    assert not mismatches, f"{len(mismatches)} of {checked} rows differ:\n" + "\n".join(mismatches[:20])
    assert not extra, f"table rows at addresses where readelf has none: {[hex(pc) for pc in extra[:20]]}"
    assert table.unsupported == unsupported
    return table, checked


# ----------------------------------------------------------------------------------------------------------
# Test programs (written to tmp_path)

CHAIN_C = r"""
#include <alloca.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

volatile int sink;
volatile int phase;
static const char *const names[4] = {"alpha", "beta", "gamma", "delta"};

__attribute__((noinline)) int leaf(int x) {
    volatile char buf[40];
    buf[x & 31] = (char)x;
    char *s = strdup(names[x & 3]);        /* malloc called from inside libc */
    sink = buf[3] + s[0];
    free(s);
    return x + sink;
}

__attribute__((noinline)) int with_vla(int x) {
    char *p = alloca((size_t)(x & 63) + 16); /* alloca makes gcc keep rbp as frame pointer here */
    memset(p, x, 16);
    return leaf(x + p[1]) + 1;
}

__attribute__((noinline)) int level2(int x) {
    volatile long pad[9];
    pad[x & 7] = x;
    return with_vla(x + (int)pad[1]) * 3;
}

__attribute__((noinline)) int level1(int x) { return level2(x ^ 5) + 7; }

__attribute__((noinline)) int recurse(int n, int x) {
    if (n == 0)
        return level1(x);
    return recurse(n - 1, x + n) * 2 + 1;
}

static int cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    if (x == 2 && y == 1)
        sink += recurse(4, x);
    return (x > y) - (x < y);
}

static int sort_once(int seed) {
    int v[8] = {5, 3, 2, 1, 8, 7, 6, 4};
    v[5] += seed;
    qsort(v, 8, sizeof v[0], cmp);
    return v[0];
}

static void *worker(void *arg) {
    (void)arg;
    sink += sort_once(0);
    return NULL;
}

int main(int argc, char **argv) {
    (void)argv;
    int first = sort_once(argc - 1);
    phase = 1;
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_join(t, NULL);
    return first == 1 ? 0 : 1;
}
"""

CONTAINERS_CPP = r"""
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

__attribute__((noinline)) int thrower(int x) {
    if (x > 3)
        throw std::runtime_error("too big");
    return x;
}

__attribute__((noinline)) int catcher(std::vector<int> &v) {
    int sum = 0;
    for (int x : v) {
        try {
            sum += thrower(x);
        } catch (const std::exception &e) {
            sum += static_cast<int>(std::string(e.what()).size());
        }
    }
    return sum;
}

int main(int argc, char **) {
    std::vector<int> v;
    std::map<int, std::string> m;
    for (int i = 0; i < 10 + argc; ++i) {
        v.push_back(i);
        m[i] = std::to_string(i);
    }
    return catcher(v) == 0;
}
"""

# Every rule kind the contract distinguishes. `p_*` labels mark the addresses the tests look up.
# .cfi_escape spells the instructions gas has no directive for:
#   0x12 = DW_CFA_def_cfa_sf (operand factored by the data alignment factor, -8),
#   0x13 = DW_CFA_def_cfa_offset_sf, 0x11 = DW_CFA_offset_extended_sf, 0x06 = DW_CFA_restore_extended,
#   0x2e = DW_CFA_GNU_args_size, 0x0f = DW_CFA_def_cfa_expression.
CRAFTED_S = r"""
    .text
    .globl p_fp_entry, p_fp_pushed, p_fp_framed, p_fp_remembered, p_fp_restored, p_fp_popped
    .globl p_plt_0, p_plt_11, p_sf, p_sf_offset, p_ext, p_args, p_restore_ext
    .globl p_undef_rbp, p_reg_rbp, p_same_rbp, p_pos_rbp, p_r12, p_big, p_deref, p_ra_val, p_gap
    .globl p_outermost, p_signal, p_plain

    .type fp, @function
fp:
    .cfi_startproc
p_fp_entry:
    push %rbp
    .cfi_def_cfa_offset 16
    .cfi_offset %rbp, -16
p_fp_pushed:
    mov %rsp, %rbp
    .cfi_def_cfa_register %rbp
p_fp_framed:
    nop
    .cfi_remember_state
    .cfi_def_cfa %rsp, 8
    .cfi_restore %rbp
p_fp_remembered:
    ret
    .cfi_restore_state
p_fp_restored:
    pop %rbp
    .cfi_def_cfa %rsp, 8
p_fp_popped:
    ret
    .cfi_endproc
    .size fp, .-fp

    .p2align 4
    .type plt_like, @function
plt_like:
    .cfi_startproc
    .cfi_escape 0x0f, 11, 0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22
p_plt_0:
    .fill 11, 1, 0x90
p_plt_11:
    .fill 5, 1, 0x90
    .cfi_endproc
    .size plt_like, .-plt_like

    .type sf, @function
sf:
    .cfi_startproc
    sub $24, %rsp
    .cfi_escape 0x12, 0x07, 0x7c
p_sf:
    nop
    .cfi_escape 0x13, 0x7e
p_sf_offset:
    nop
    .cfi_escape 0x11, 0x06, 0x03
p_ext:
    nop
    .cfi_escape 0x2e, 0x10
p_args:
    nop
    .cfi_escape 0x06, 0x06
p_restore_ext:
    add $24, %rsp
    ret
    .cfi_endproc
    .size sf, .-sf

    .type rbp_rules, @function
rbp_rules:
    .cfi_startproc
    .cfi_undefined %rbp
p_undef_rbp:
    nop
    .cfi_register %rbp, %r10
p_reg_rbp:
    nop
    .cfi_same_value %rbp
p_same_rbp:
    nop
    .cfi_offset %rbp, 16
p_pos_rbp:
    ret
    .cfi_endproc
    .size rbp_rules, .-rbp_rules

    .type odd_cfa, @function
odd_cfa:
    .cfi_startproc
    .cfi_def_cfa %r12, 16
p_r12:
    nop
    .cfi_def_cfa %rsp, 40000
p_big:
    nop
    .cfi_escape 0x0f, 4, 0x77, 0xa0, 0x01, 0x06
p_deref:
    nop
    .cfi_def_cfa %rsp, 8
    .cfi_val_offset %rip, -8
p_ra_val:
    ret
    .cfi_endproc
    .size odd_cfa, .-odd_cfa

p_gap:
    .fill 16, 1, 0xcc

    .type outermost, @function
outermost:
    .cfi_startproc
    .cfi_undefined %rip
p_outermost:
    hlt
    .cfi_endproc
    .size outermost, .-outermost

    .type signal_tramp, @function
signal_tramp:
    .cfi_startproc
    .cfi_signal_frame
p_signal:
    ret
    .cfi_endproc
    .size signal_tramp, .-signal_tramp

    .type plain, @function
plain:
    .cfi_startproc
p_plain:
    ret
    .cfi_endproc
    .size plain, .-plain
    .section .note.GNU-stack,"",@progbits
"""

# (label, expected Rule fields: cfa_type, flags, cfa_offset, rbp_offset), from the DWARF semantics of CRAFTED_S.
CRAFTED_EXPECTED = {
    "p_fp_entry": (CFA_RSP, 0, 8, 0),
    "p_fp_pushed": (CFA_RSP, FLAG_RBP_SAVED, 16, -16),
    "p_fp_framed": (CFA_RBP, FLAG_RBP_SAVED, 16, -16),
    "p_fp_remembered": (CFA_RSP, 0, 8, 0),  # restore: back to the CIE's rule for rbp (none)
    "p_fp_restored": (CFA_RBP, FLAG_RBP_SAVED, 16, -16),  # restore_state brings back CFA and rbp
    "p_fp_popped": (CFA_RSP, FLAG_RBP_SAVED, 8, -16),
    "p_plt_0": (CFA_PLT, 0, 8, 0),
    "p_plt_11": (CFA_PLT, 0, 8, 0),
    "p_sf": (CFA_RSP, 0, 32, 0),  # def_cfa_sf rsp, -4 * -8
    "p_sf_offset": (CFA_RSP, 0, 16, 0),  # def_cfa_offset_sf -2 * -8
    "p_ext": (CFA_RSP, FLAG_RBP_SAVED, 16, -24),  # offset_extended_sf rbp, 3 * -8
    "p_args": (CFA_RSP, FLAG_RBP_SAVED, 16, -24),  # GNU_args_size changes nothing here
    "p_restore_ext": (CFA_RSP, 0, 16, 0),
    "p_undef_rbp": (CFA_RSP, FLAG_RBP_UNKNOWN, 8, 0),
    "p_reg_rbp": (CFA_RSP, FLAG_RBP_UNKNOWN, 8, 0),
    "p_same_rbp": (CFA_RSP, 0, 8, 0),
    "p_pos_rbp": (CFA_RSP, FLAG_RBP_UNKNOWN, 8, 0),  # saved above the CFA: not a layout the walker reads
    "p_r12": (CFA_NONE, 0, 0, 0),
    "p_big": (CFA_NONE, 0, 0, 0),
    "p_deref": (CFA_NONE, 0, 0, 0),
    "p_ra_val": (CFA_NONE, 0, 0, 0),
    "p_gap": (CFA_NONE, 0, 0, 0),
    "p_outermost": (CFA_END, 0, 0, 0),
    "p_signal": (CFA_NONE, 0, 0, 0),
    "p_plain": (CFA_RSP, 0, 8, 0),
}
CRAFTED_REASONS = {
    "CFA is based on a register other than rsp/rbp": 1,
    "CFA offset does not fit in 16 bits": 1,
    "CFA is a DWARF expression other than the .plt one": 1,
    "return address not at CFA-8": 1,
    "signal trampoline (CIE augmentation 'S')": 1,
}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The crafted CFI as .eh_frame, as .debug_frame with CIE version 1, and with CIE version 4."""
    require("gcc")
    root = tmp_path_factory.mktemp("crafted")
    out: dict[str, Path] = {}
    variants = {
        "eh_frame": ("", []),
        "debug_frame_v1": ("    .cfi_sections .debug_frame\n", []),
        "debug_frame_v4": ("    .cfi_sections .debug_frame\n", ["-Wa,--gdwarf-cie-version=4"]),
    }
    for name, (prefix, flags) in variants.items():
        src = root / f"{name}.s"
        src.write_text(prefix + CRAFTED_S)
        lib = root / f"{name}.so"
        run("gcc", "-shared", "-nostdlib", "-Wl,--build-id", *flags, "-o", lib, src)
        out[name] = lib
    # Code above 4 GiB: rows hold a u32 pc, so none of it can be described.
    out["high"] = root / "high.so"
    run("gcc", "-shared", "-nostdlib", "-Wl,-Ttext-segment=0x100000000", "-o", out["high"], root / "eh_frame.s")
    return out


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require("gcc", "g++")
    root = tmp_path_factory.mktemp("programs")
    (root / "chain.c").write_text(CHAIN_C)
    (root / "containers.cpp").write_text(CONTAINERS_CPP)
    common = ["-O2", "-fomit-frame-pointer", "-g", "-pthread"]
    builds = {
        "chain": ("gcc", "chain.c", ["-fasynchronous-unwind-tables"]),
        # No .eh_frame for our code: gcc puts the CFI in .debug_frame (the C runtime keeps .eh_frame for _start).
        "chain_debug_frame": ("gcc", "chain.c", ["-fno-asynchronous-unwind-tables"]),
        "chain_nopie": ("gcc", "chain.c", ["-fasynchronous-unwind-tables", "-fno-pie", "-no-pie"]),
        "chain_no_build_id": ("gcc", "chain.c", ["-Wl,--build-id=none"]),
        "containers": ("g++", "containers.cpp", []),
    }
    out: dict[str, Path] = {}
    for name, (cc, src, flags) in builds.items():
        exe = root / name
        run(cc, *common, *flags, "-o", exe, root / src)
        out[name] = exe
    return out


# ----------------------------------------------------------------------------------------------------------
# Crafted CFI: each rule kind


@pytest.mark.needs("gcc")
@pytest.mark.parametrize("variant", ["eh_frame", "debug_frame_v1", "debug_frame_v4"])
def test_crafted_rules(crafted: dict[str, Path], variant: str) -> None:
    lib = crafted[variant]
    table = build_table(str(lib))
    assert table.source == variant.rsplit("_v", 1)[0]
    obj = open_elf(str(lib))
    for label, (cfa_type, flags, cfa_offset, rbp_offset) in CRAFTED_EXPECTED.items():
        found = obj.find_symbol(label)
        assert found is not None, label
        rule = lookup(table, found[0])
        assert (rule.cfa_type, rule.flags, rule.cfa_offset, rule.rbp_offset) == (
            cfa_type,
            flags,
            cfa_offset,
            rbp_offset,
        ), label
    assert dict(table.reasons) == CRAFTED_REASONS
    assert table.unsupported == sum(CRAFTED_REASONS.values())


@pytest.mark.needs("gcc")
@pytest.mark.needs("readelf")
@pytest.mark.parametrize("variant", ["eh_frame", "debug_frame_v1", "debug_frame_v4"])
def test_crafted_rules_agree_with_readelf(crafted: dict[str, Path], variant: str) -> None:
    compare_with_readelf(crafted[variant])


@pytest.mark.needs("gcc")
def test_rows_are_sorted_merged_and_end_each_fde(crafted: dict[str, Path]) -> None:
    table = build_table(str(crafted["eh_frame"]))
    assert len(table.rows) == table.n_rows * ROW.size
    rows = list(table.iter_rules())
    assert all(a.pc < b.pc for a, b in itertools.pairwise(rows))
    keys = [(r.cfa_type, r.flags, r.cfa_offset, r.rbp_offset) for r in rows]
    assert all(a != b for a, b in itertools.pairwise(keys)), "identical neighbours were not merged"
    assert all(pad == 0 for *_, pad in ROW.iter_unpack(table.rows))
    assert rows[-1].cfa_type == CFA_NONE  # the last FDE is closed
    assert lookup(table, rows[0].pc - 1).cfa_type == CFA_NONE  # before any FDE
    assert lookup(table, 0).cfa_type == CFA_NONE


# ----------------------------------------------------------------------------------------------------------
# Every row, against readelf


@pytest.mark.needs("readelf")
@pytest.mark.parametrize("lib", sorted(SYSTEM_LIBS))
def test_system_library_rows_agree_with_readelf(lib: str) -> None:
    path = SYSTEM_LIBS[lib]
    if not os.path.exists(path):
        pytest.skip(f"{path} is not installed")
    table, checked = compare_with_readelf(path)
    assert table.source == "eh_frame"
    assert checked > 1000
    assert table.build_id == open_elf(path).build_id


@pytest.mark.needs("readelf")
@pytest.mark.parametrize("name", ["chain", "chain_debug_frame", "chain_nopie", "containers"])
def test_program_rows_agree_with_readelf(programs: dict[str, Path], name: str) -> None:
    table, _checked = compare_with_readelf(programs[name])
    expected_source = "eh_frame+debug_frame" if name == "chain_debug_frame" else "eh_frame"
    assert table.source == expected_source
    obj = open_elf(str(programs[name]))
    main = obj.find_symbol("main")
    assert main is not None
    assert lookup(table, main[0]) == Rule(lookup(table, main[0]).pc, CFA_RSP, 0, 8, 0)  # entry: CFA = rsp + 8


@pytest.mark.needs("gcc")
def test_code_above_4gib_is_skipped_and_counted(crafted: dict[str, Path]) -> None:
    exe = crafted["high"]
    assert all(s.vaddr >= 1 << 32 for s in open_elf(str(exe)).segments if s.executable)
    table = build_table(str(exe))
    assert (table.n_rows, table.source) == (0, "none")
    assert table.skipped_fdes > 0
    plain = open_elf(str(exe)).find_symbol("p_plain")
    assert plain is not None and lookup(table, plain[0]).cfa_type == CFA_NONE


@pytest.mark.needs("readelf")
def test_gnu_args_size_is_present_and_followed(programs: dict[str, Path]) -> None:
    """pyelftools' own get_decoded() rejects DW_CFA_GNU_args_size; C++ code with exceptions has it."""
    path = SYSTEM_LIBS["libstdc++"]
    if not os.path.exists(path):
        pytest.skip(f"{path} is not installed")
    assert "DW_CFA_GNU_args_size" in readelf("--debug-dump=frames", path)
    table = build_table(path)
    assert table.n_rows > 1000 and not any("opcode" in why for why, _ in table.reasons)


# ----------------------------------------------------------------------------------------------------------
# The cache


@pytest.mark.needs("gcc")
def test_cache_round_trip_and_reuse(programs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = str(programs["chain"])
    first = load_table(exe, str(tmp_path))
    files = [p for p in tmp_path.iterdir()]
    assert [p.name for p in files] == [cache_key(exe, first.build_id)]
    assert first.build_id and first.build_id in files[0].name
    fresh = build_table(exe)
    assert (fresh.rows, fresh.source, fresh.unsupported, fresh.reasons) == (
        first.rows,
        first.source,
        first.unsupported,
        first.reasons,
    )

    import agent.symbols.unwind as unwind

    def must_not_build(path: str) -> UnwindTable:
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(unwind, "build_table", must_not_build)
    again = load_table(exe, str(tmp_path))
    assert again == first

    # A daemon's further targets map the same objects: a table read lately is not read and checked again while
    # its cache file stays the same.
    def must_not_read(data: bytes) -> UnwindTable:
        raise AssertionError("the cache file was read again")

    monkeypatch.setattr(unwind, "deserialize", must_not_read)
    assert load_table(exe, str(tmp_path)) is again


@pytest.mark.needs("gcc")
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_cache_is_rebuilt(programs: dict[str, Path], tmp_path: Path, damage: str) -> None:
    exe = str(programs["chain"])
    good = load_table(exe, str(tmp_path))
    (cached,) = tmp_path.iterdir()
    data = cached.read_bytes()
    if damage == "truncate":
        cached.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        i = len(data) // 2
        cached.write_bytes(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :])
    elif damage == "empty":
        cached.write_bytes(b"")
    else:
        cached.write_bytes(b"\0" * 4096)
    rebuilt = load_table(exe, str(tmp_path))
    assert rebuilt.rows == good.rows and rebuilt.n_rows == good.n_rows
    assert cached.read_bytes() == serialize(rebuilt)  # and the file was rewritten whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.needs("gcc")
def test_objects_without_build_id_key_on_path_size_mtime(programs: dict[str, Path], tmp_path: Path) -> None:
    exe = tmp_path / "nobid"
    shutil.copy2(programs["chain_no_build_id"], exe)
    assert open_elf(str(exe)).build_id is None
    cache = tmp_path / "cache"
    table = load_table(str(exe), str(cache))
    assert table.build_id is None and table.n_rows > 0
    key = cache_key(str(exe), None)
    assert (cache / key).exists()
    # A different mtime is a different file.
    st = exe.stat()
    os.utime(exe, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache_key(str(exe), None) != key


def test_cache_dir_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HEAPSCOPE_CACHE_DIR", raising=False)
    assert default_cache_dir() == "/var/cache/heapscope/unwind"
    monkeypatch.setenv("HEAPSCOPE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / "unwind")


@pytest.mark.needs("gcc")
def test_cache_dir_from_environment_is_used(
    programs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEAPSCOPE_CACHE_DIR", str(tmp_path))
    table = load_table(str(programs["chain"]))
    assert (tmp_path / "unwind" / cache_key(str(programs["chain"]), table.build_id)).exists()


@pytest.mark.needs("gcc")
@pytest.mark.skipif(os.geteuid() == 0, reason="root can write a read-only directory")
def test_unwritable_cache_still_gives_the_table(programs: dict[str, Path], tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        table = load_table(str(programs["chain"]), str(ro))
    finally:
        ro.chmod(stat.S_IRWXU)
    assert table.n_rows > 0 and not list(ro.iterdir())


# ----------------------------------------------------------------------------------------------------------
# Real stacks: gdb stops the program, we unwind its dump, gdb's backtrace judges


@dataclass
class Mapping:
    start: int
    end: int
    offset: int
    path: str


@dataclass
class GdbStop:
    regs: dict[str, int]
    memory: dict[int, int]
    mappings: list[Mapping]
    frames: list[tuple[int, str]]  # (pc, function) of each frame on the stack, innermost first
    synthetic: list[str]  # frames gdb adds from debug info (inlined calls, tail calls): no return address


# Inlined frames share their caller's stack frame, and gdb rebuilds tail-called frames (libc's qsort jumps to
# qsort_r) from DW_TAG_call_site: neither has a return address on the stack, so neither is ours to find.
_GDB_FRAMES = r"""
python
f = gdb.newest_frame()
while f is not None:
    if f.type() in (gdb.INLINE_FRAME, gdb.TAILCALL_FRAME):
        print("SYNTHETIC 0x%x %s" % (f.pc(), f.name()))
    else:
        print("FRAME 0x%x %s" % (f.pc(), f.name()))
    f = f.older()
end
"""


def gdb_stop(exe: Path, breaks: list[str], tmp_path: Path) -> GdbStop:
    """Run exe under gdb until the last of `breaks` is hit; dump registers, mappings, stack and frames."""
    script = tmp_path / "cmds.gdb"
    lines = ["set pagination off", "set backtrace past-main on", "set backtrace past-entry on"]
    lines.append(f"break {breaks[0]}")
    lines.append("run")
    for spec in breaks[1:]:
        lines += [f"break {spec}", "continue"]
    lines += ["echo @@REGS\\n", "info registers rip rsp rbp", "echo @@MAPS\\n", "info proc mappings"]
    lines += ["echo @@BT\\n", "bt", _GDB_FRAMES.strip(), "echo @@STACK\\n", "x/4096gx $rsp", "kill"]
    script.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        ["gdb", "-nx", "-batch", "-x", str(script), str(exe)], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout
    regs = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"^(rip|rsp|rbp)\s+0x([0-9a-f]+)", out, re.M)}
    assert set(regs) == {"rip", "rsp", "rbp"}, out + proc.stderr
    memory: dict[int, int] = {}
    for m in re.finditer(r"^0x([0-9a-f]+)(?: <[^>]*>)?:\s+((?:0x[0-9a-f]+\s*)+)$", out, re.M):
        addr = int(m.group(1), 16)
        for i, word in enumerate(m.group(2).split()):
            memory[addr + 8 * i] = int(word, 16)
    mappings = [
        Mapping(int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16), m.group(4))
        for m in re.finditer(
            r"^\s+0x([0-9a-f]+)\s+0x([0-9a-f]+)\s+0x[0-9a-f]+\s+0x([0-9a-f]+)\s+\S+\s+(/\S+)$", out, re.M
        )
    ]
    frames = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"^FRAME 0x([0-9a-f]+) (\S+)", out, re.M)]
    synthetic = re.findall(r"^SYNTHETIC 0x[0-9a-f]+ (\S+)", out, re.M)
    assert frames and memory and mappings, out + proc.stderr
    return GdbStop(regs, memory, mappings, frames, synthetic)


def walk(stop: GdbStop, cache_dir: Path) -> list[int]:
    tables: dict[str, UnwindTable] = {}

    def table_for(pc: int) -> tuple[UnwindTable, int] | None:
        for m in stop.mappings:
            if m.start <= pc < m.end:
                obj = open_elf(m.path)
                vaddr = obj.file_offset_to_vaddr(m.offset)
                assert vaddr is not None
                if m.path not in tables:
                    tables[m.path] = load_table(m.path, str(cache_dir))
                return tables[m.path], m.start - vaddr
        return None

    return unwind_python(table_for, stop.regs, stop.memory.get)


CALL_CHAIN = ["leaf", "with_vla", "level2", "level1", "recurse", "cmp"]


def frames_text(stop: GdbStop, ours: list[int]) -> str:
    return "gdb:  " + " ".join(f"{pc:x}:{fn}" for pc, fn in stop.frames) + "\nours: " + " ".join(map(hex, ours))


@pytest.mark.needs("gdb")
@pytest.mark.parametrize("build", ["chain", "chain_debug_frame", "chain_nopie"])
@pytest.mark.parametrize(
    "breaks",
    [["leaf"], ["*leaf"], ["leaf", "malloc"], ["leaf if phase == 1"], ["leaf if phase == 1", "malloc"]],
    ids=["after-prologue", "entry", "malloc-in-strdup", "thread", "thread-malloc"],
)
def test_unwind_matches_gdb(programs: dict[str, Path], tmp_path: Path, build: str, breaks: list[str]) -> None:
    stop = gdb_stop(programs[build], breaks, tmp_path)
    ours = walk(stop, tmp_path / "cache")
    names = [fn for _pc, fn in stop.frames]
    # The stop is where the test meant it to be: inside our -fomit-frame-pointer chain, called back by qsort.
    chain_at = names.index("leaf")
    assert names[chain_at : chain_at + len(CALL_CHAIN)] == CALL_CHAIN
    assert any("qsort" in fn for fn in names + stop.synthetic)
    if "malloc" in breaks:
        assert names[0].endswith("malloc") and names[1].endswith("strdup"), names
    if "phase == 1" in breaks[0]:
        assert names[-1].startswith("clone")  # the thread's outermost frame: CFA_END in clone3
    else:
        assert names[-1] == "_start"
    # Ours ends in the start-up code that calls main (marked outermost: Massif shows nothing outside it).
    expected = [pc for pc, _fn in stop.frames]
    for i, fn in enumerate(names):
        if fn in BELOW_MAIN_NAMES or fn.startswith("__libc_start_main"):
            expected = expected[: i + 1]
            break
    assert ours == expected, frames_text(stop, ours)


@pytest.mark.needs("gdb")
def test_frame_pointer_walk_would_be_wrong_here(programs: dict[str, Path], tmp_path: Path) -> None:
    """The premise of this module: following rbp from the same stop does not give gdb's frames."""
    stop = gdb_stop(programs["chain"], ["leaf", "malloc"], tmp_path)
    fp_frames = [stop.regs["rip"], stop.memory.get(stop.regs["rsp"], 0)]
    bp = stop.regs["rbp"]
    while len(fp_frames) < 64 and bp in stop.memory and bp + 8 in stop.memory:
        fp_frames.append(stop.memory[bp + 8])
        bp = stop.memory[bp]
    assert fp_frames != [pc for pc, _fn in stop.frames]
    names = [fn for _pc, fn in stop.frames]
    outermost = names.index("__libc_start_call_main")  # the table ends the walk in the code that calls main
    assert walk(stop, tmp_path / "cache") == [pc for pc, _fn in stop.frames][: outermost + 1]
