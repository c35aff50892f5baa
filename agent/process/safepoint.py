"""Whether a seized thread may run an injected call: its real call chain, unwound with the objects' CFI.

A thread must not be inside the allocator, the loader or fork when it runs dlopen (it could hold their locks or
be in the middle of their state), nor in a signal handler that interrupted them: a handler's frame is followed
into the registers the signal saved, and the interrupted chain is judged too. The thread's call chain says where
it is: its program counter and every return address, found by unwinding its stack with the same `.eh_frame` rows
the kernel's stack walker uses (agent.symbols.unwind). A frame that cannot be unwound (no table: the vDSO, JIT
code; a row with no rule; a stack that does not grow) ends the walk, and the rest of the stack from that frame up
is scanned conservatively instead: any word that points into unsafe code then makes the thread look unsafe, and
the verdict says so. The walk reads only the seized thread's memory and registers; it decides, it changes
nothing.

Before, the whole stack was scanned word by word: a stale word in a dead slot of a live frame (the nginx
worker's `__fork+0x1f3`, left by the fork that made it, under a frame that never overwrote it) made an idle
thread look unsafe for good, since an idle stack does not change.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.symbols.unwind import CFA_END, CFA_NONE, CFA_PLT, CFA_RBP, CFA_RSP, Rule

MAX_FRAMES = 512  # deeper than any real chain; a walk that goes on longer is taken for a broken one
# The signal trampoline a handler returns to (glibc's and musl's __restore_rt: rt_sigreturn), by its code: its
# symbol has no size to find it by, and its CFI is the 'S' kind the tables cannot express.
SIGRETURN_CODES = (bytes.fromhex("48c7c00f0000000f05"), bytes.fromhex("b80f0000000f05"))
# Where the interrupted registers are in the frame it pops (struct ucontext: uc_mcontext.gregs at 40; REG_RBP 10,
# REG_RSP 15, REG_RIP 16), from the stack pointer at its first instruction.
UC_RBP, UC_RSP, UC_RIP = 40 + 10 * 8, 40 + 15 * 8, 40 + 16 * 8
STACK_SCAN = 32 * 1024  # bytes scanned above the frame where the walk stopped
_WORD = struct.Struct("<Q")


class UnsafeRanges:
    """Address ranges of unsafe code, each with the name of what is there (a function, or a whole object)."""

    def __init__(self, ranges: Sequence[tuple[int, int, str]]) -> None:
        merged: list[tuple[int, int, str]] = []
        for lo, hi, name in sorted(ranges):
            if merged and lo <= merged[-1][1]:  # aliases of one function overlap: one range, the first name
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi), merged[-1][2])
            else:
                merged.append((lo, hi, name))
        self.ranges = merged
        self._starts = [lo for lo, _, _ in merged]

    def name_at(self, address: int) -> str | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and self.ranges[i][0] <= address < self.ranges[i][1]:
            return self.ranges[i][2]
        return None

    def __len__(self) -> int:
        return len(self.ranges)


# rule_at(address) -> the unwind row covering it, or None where no object's table covers it
RuleLookup = Callable[[int], Rule | None]
# read(address, n) -> bytes of the thread's memory (raises OSError where unmapped)
MemoryReader = Callable[[int, int], bytes]


@dataclass(frozen=True)
class Verdict:
    """What the walk found for one thread."""

    safe: bool
    where: str  # "in __libc_malloc", "outside the allocator and the loader"
    frames: int  # frames unwound with a table rule
    scanned: bool  # a frame could not be unwound: the stack above it was scanned word by word

    def describe(self, tid: int) -> str:
        how = f"{self.frames} frames unwound" + (", the rest of its stack scanned" if self.scanned else "")
        return f"thread {tid} {self.where} ({how})"


def examine(rip: int, rsp: int, rbp: int, read: MemoryReader, unsafe: UnsafeRanges, rule_at: RuleLookup,
            stack_end: int | None = None) -> Verdict:
    """The verdict for a thread stopped with these registers. `stack_end`: the end of the mapping that holds
    its stack (where a conservative scan stops)."""
    pc, sp, bp = rip, rsp, rbp
    interrupted = True  # pc is where the thread stands (not a return address): at the start, after a signal frame
    for depth in range(MAX_FRAMES):
        # A caller's return address is looked up one byte back, in its call instruction (a call to a noreturn
        # function can end its function); the address itself too, for __restore_rt, which a signal handler
        # returns to at its very first byte.
        for address in (pc,) if interrupted else (pc - 1, pc):
            name = unsafe.name_at(address)
            if name is not None:
                return Verdict(False, f"in {name}", depth, False)
        if not interrupted and _is_sigreturn(read, pc):
            # A signal handler returns here: the chain goes on in the code the signal interrupted (a prefork
            # server's worker forked in its parent's handler lives in one for good). What it interrupted is
            # judged like any frame: inside malloc is unsafe, blocked in select() is not.
            try:
                pc, sp, bp = (_word(read, sp + UC_RIP), _word(read, sp + UC_RSP), _word(read, sp + UC_RBP))
            except OSError:
                return _scan(sp, read, unsafe, depth, stack_end)
            interrupted = True
            continue
        rule = rule_at(pc if interrupted else pc - 1)
        interrupted = False
        if rule is None or rule.cfa_type == CFA_NONE:
            return _scan(sp, read, unsafe, depth, stack_end)
        if rule.cfa_type == CFA_END:
            return Verdict(True, "outside the allocator and the loader", depth + 1, False)
        if rule.cfa_type == CFA_RSP:
            cfa = sp + rule.cfa_offset
        elif rule.cfa_type == CFA_RBP:
            cfa = bp + rule.cfa_offset
        elif rule.cfa_type == CFA_PLT:
            cfa = sp + 8 + (8 if (pc & 15) >= 11 else 0)
        else:
            return _scan(sp, read, unsafe, depth, stack_end)
        try:
            ra = _word(read, cfa - 8)
            if rule.rbp_saved:
                bp = _word(read, cfa + rule.rbp_offset)
        except OSError:
            return _scan(sp, read, unsafe, depth, stack_end)
        if cfa <= sp:  # a stack that does not grow towards its callers: not a walk to trust
            return _scan(sp, read, unsafe, depth, stack_end)
        if ra == 0:  # the outermost frame (a thread's start, whose caller is 0)
            return Verdict(True, "outside the allocator and the loader", depth + 1, False)
        pc, sp = ra, cfa
    return _scan(sp, read, unsafe, MAX_FRAMES, stack_end)


def _scan(sp: int, read: MemoryReader, unsafe: UnsafeRanges, frames: int, stack_end: int | None) -> Verdict:
    """The conservative rest: every word from `sp` up (to the stack's end, at most STACK_SCAN bytes) that
    points into unsafe code makes the thread unsafe."""
    end = sp + STACK_SCAN if stack_end is None else min(stack_end, sp + STACK_SCAN)
    try:
        data = read(sp, max(0, end - sp))
    except OSError:
        return Verdict(False, "on a stack that cannot be read", frames, True)
    for offset, (word,) in enumerate(struct.iter_unpack("<Q", data[: len(data) // 8 * 8])):
        name = unsafe.name_at(word)
        if name is not None:
            return Verdict(False, f"in {name}? (a word at sp+{offset * 8:#x} points there)", frames, True)
    return Verdict(True, "outside the allocator and the loader", frames, True)


def _is_sigreturn(read: MemoryReader, pc: int) -> bool:
    try:
        code = read(pc, len(SIGRETURN_CODES[0]))
    except OSError:
        return False
    return any(code.startswith(c) for c in SIGRETURN_CODES)


def _word(read: MemoryReader, address: int) -> int:
    data = read(address, 8)
    if len(data) != 8:
        raise OSError(f"short read at {address:#x}")
    return int(_WORD.unpack(data)[0])
