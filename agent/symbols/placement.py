"""Where to put a uprobe inside an allocation function.

x86 uprobes emulate a few instructions (push reg, jmp/jcc/call rel, nop) and single-step every other one out of
line, which costs a second trap: in a VM about ten times the cost of an emulated hit (docs/usage.md, "Where exact
mode's probes go"). So the probe goes on the first emulated instruction that still sees everything the probe
reads: the argument registers, %rsp (its [rsp] is the caller's return address, also used by the return probe)
and %rbp (the frame-pointer walk starts there). Pure logic over bytes: no bcc, no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import capstone
from capstone import x86 as cs_x86

# How many instructions to look at before giving up and probing the entry.
_MAX_INSNS = 12

# Registers by their 64-bit name, so that writing %edi counts as writing %rdi.
_ALIASES = {
    "rdi": {"rdi", "edi", "di", "dil"},
    "rsi": {"rsi", "esi", "si", "sil"},
    "rdx": {"rdx", "edx", "dx", "dl", "dh"},
    "rcx": {"rcx", "ecx", "cx", "cl", "ch"},
    "rsp": {"rsp", "esp", "sp", "spl"},
    "rbp": {"rbp", "ebp", "bp", "bpl"},
}
_ALIAS_OF = {name: full for full, names in _ALIASES.items() for name in names}

ARG_REGS = ("rdi", "rsi", "rdx", "rcx")


@dataclass(frozen=True)
class Placement:
    offset: int  # bytes from the function's start
    emulated: bool  # True: one trap; False: the kernel single-steps it (two traps)
    instruction: str  # the probed instruction, as capstone prints it
    reason: str  # one line for the user


def _disassembler() -> capstone.Cs:
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    return md


def is_emulated(insn: capstone.CsInsn) -> bool:
    """The instructions arch/x86/kernel/uprobes.c emulates instead of single-stepping."""
    op = bytes(insn.opcode).rstrip(b"\x00")
    first = op[0] if op else 0
    prefixes = {p for p in insn.prefix if p}
    rex = insn.rex
    if insn.id == cs_x86.X86_INS_PUSH and len(insn.operands) == 1 and insn.operands[0].type == cs_x86.X86_OP_REG:
        # push_setup_xol_ops: 0x50..0x57, optionally with REX.B (0x41); no other prefix.
        return 0x50 <= first <= 0x57 and not prefixes and rex in (0, 0x41)
    if rex:
        return False
    if first in (0xEB, 0xE9, 0xE8):  # jmp rel8, jmp rel32, call rel32
        return not prefixes
    if 0x70 <= first <= 0x7F:  # jcc rel8
        return True
    if first == 0x0F and len(op) >= 2 and 0x80 <= op[1] <= 0x8F:  # jcc rel32
        return True
    return first == 0x90  # nop, with any prefixes (e.g. 66 90)


def _registers_written(insn: capstone.CsInsn) -> set[str]:
    try:
        _, written = insn.regs_access()
    except capstone.CsError:
        return {"unknown"}
    return {_ALIAS_OF.get(insn.reg_name(r), insn.reg_name(r)) for r in written}


def _ends_straight_line(insn: capstone.CsInsn) -> bool:
    """After a jump, call or return the next instruction is not always reached."""
    groups = set(insn.groups)
    return bool(groups & {cs_x86.X86_GRP_JUMP, cs_x86.X86_GRP_CALL, cs_x86.X86_GRP_RET, cs_x86.X86_GRP_INT})


def choose_offset(code: bytes, needs: Iterable[str]) -> Placement:
    """Pick the probe offset in a function whose first bytes are `code`.

    `needs` names the argument registers the probe reads; %rsp and %rbp are always needed. Remembered by the bytes:
    every attach places the same dozen allocation functions of the same libc (a new disassembler and a walk each).
    """
    return _chosen(code, frozenset(needs))


@functools.lru_cache(maxsize=1024)
def _chosen(code: bytes, needs: frozenset[str]) -> Placement:
    keep = set(needs) | {"rsp", "rbp"}
    md = _disassembler()
    skipped: list[str] = []
    first: capstone.CsInsn | None = None
    for count, insn in enumerate(md.disasm(code, 0)):
        text = f"{insn.mnemonic} {insn.op_str}".strip()
        if first is None:
            first = insn
        if is_emulated(insn):
            if insn.address == 0:
                reason = f"+0 `{text}` is emulated"
            else:
                reason = f"+{insn.address} `{text}` is emulated; skipped single-stepped {', '.join(skipped)}"
            return Placement(insn.address, True, text, reason)
        clobbered = _registers_written(insn) & (keep | {"unknown"})
        if clobbered or _ends_straight_line(insn) or count + 1 >= _MAX_INSNS:
            break
        skipped.append(f"`{text}`")
    if first is None:
        return Placement(0, False, "?", "+0: code could not be decoded; single-stepped")
    text = f"{first.mnemonic} {first.op_str}".strip()
    return Placement(
        0,
        False,
        text,
        f"+0 `{text}` is single-stepped: no emulated instruction before the arguments, %rsp or %rbp change",
    )
