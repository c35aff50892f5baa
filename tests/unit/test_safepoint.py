"""The safe-point decision (agent.process.safepoint) on made-up stacks: the call chain decides, a stale word in a
dead slot does not; where a frame cannot be unwound, the rest of the stack is scanned word by word."""

from __future__ import annotations

import struct

from agent.process.safepoint import SIGRETURN_CODES, UC_RBP, UC_RIP, UC_RSP, UnsafeRanges, examine
from agent.symbols.unwind import CFA_END, CFA_RBP, CFA_RSP, FLAG_RBP_SAVED, Rule

# Code: main and two functions of the program, malloc and __restore_rt in "libc", and an unmapped hole.
MAIN, LOOP, WAIT = 0x1000, 0x2000, 0x2800  # each 0x100 long
MALLOC, RESTORE_RT = 0x5000, 0x6000
JIT = 0x9000  # code no table covers
UNSAFE = UnsafeRanges([(MALLOC, MALLOC + 0x100, "malloc")])
STACK = 0x7F0000  # the stack's lowest address here; it ends 4 KiB above
STACK_END = STACK + 0x1000


def rules(address: int) -> Rule | None:
    """A frame of 16 bytes everywhere (return address at sp+8), main the outermost, WAIT with a frame pointer."""
    if MAIN <= address < MAIN + 0x100:
        return Rule(MAIN, CFA_END, 0, 0, 0)
    if WAIT <= address < WAIT + 0x100:
        return Rule(WAIT, CFA_RBP, FLAG_RBP_SAVED, 16, -16)  # push rbp; mov rbp, rsp
    if LOOP <= address < LOOP + 0x100 or MALLOC <= address < MALLOC + 0x100:
        return Rule(address, CFA_RSP, 0, 16, 0)
    return None


class Stack:
    def __init__(self) -> None:
        self.mem = bytearray(STACK_END - STACK)

    def put(self, address: int, word: int) -> None:
        struct.pack_into("<Q", self.mem, address - STACK, word)

    def read(self, address: int, n: int) -> bytes:
        if address == RESTORE_RT:  # the trampoline's code: mov $15, %rax; syscall (rt_sigreturn)
            return SIGRETURN_CODES[0][:n]
        if not (address >= STACK and address + n <= STACK_END):
            raise OSError(14, "Bad address")
        return bytes(self.mem[address - STACK : address - STACK + n])


def test_a_stale_pointer_into_malloc_in_a_dead_slot_is_safe() -> None:
    """The nginx worker's case: blocked in a function whose frame holds a word left by an earlier call (here a
    pointer into malloc), below its caller, main. The chain is LOOP <- main: safe."""
    s = Stack()
    sp = STACK + 0x800
    s.put(sp, MALLOC + 0x42)  # the dead slot, inside LOOP's frame
    s.put(sp + 8, MAIN + 0x20)  # LOOP's return address
    s.put(sp + 24, MALLOC + 0x10)  # and another in main's frame
    v = examine(LOOP + 0x30, sp, 0, s.read, UNSAFE, rules, STACK_END)
    assert v.safe and not v.scanned and v.frames == 2, v
    # The old conservative scan of every word would have refused it for good: the same stack, no table.
    scanned = examine(LOOP + 0x30, sp, 0, s.read, UNSAFE, lambda a: None, STACK_END)
    assert not scanned.safe and scanned.scanned and "malloc" in scanned.where


def test_a_thread_inside_malloc_is_unsafe_named_and_so_is_one_called_from_it() -> None:
    s = Stack()
    sp = STACK + 0x800
    v = examine(MALLOC + 0x10, sp, 0, s.read, UNSAFE, rules, STACK_END)
    assert not v.safe and v.where == "in malloc" and v.frames == 0
    # Blocked in a lock wait (LOOP stands for it) that malloc called: malloc is its caller.
    s.put(sp + 8, MALLOC + 0x24)
    s.put(sp + 24, MAIN + 0x20)
    v = examine(LOOP + 0x8, sp, 0, s.read, UNSAFE, rules, STACK_END)
    assert not v.safe and v.where == "in malloc" and v.frames == 1
    assert v.describe(77) == "thread 77 in malloc (1 frames unwound)"


def test_a_signal_frame_is_unwound_into_what_the_signal_interrupted() -> None:
    """A handler returns to __restore_rt, whose frame holds the interrupted registers (struct ucontext). The chain
    goes on there: a signal that interrupted malloc is unsafe; one that interrupted a blocking call is not (a
    postgres child forked in its postmaster's handler lives inside one for good)."""
    for interrupted, safe in ((MALLOC + 0x30, False), (LOOP + 0x40, True)):
        s = Stack()
        sp = STACK + 0x400
        s.put(sp + 8, RESTORE_RT)  # the handler (LOOP) returns to the trampoline
        uc = sp + 16  # the trampoline's frame: the ucontext
        inner_sp = STACK + 0x900
        s.put(uc + UC_RIP, interrupted)
        s.put(uc + UC_RSP, inner_sp)
        s.put(uc + UC_RBP, 0)
        s.put(inner_sp + 8, MAIN + 0x10)  # what was interrupted was called from main
        v = examine(LOOP + 0x8, sp, 0, s.read, UNSAFE, rules, STACK_END)
        assert v.safe is safe and not v.scanned, (hex(interrupted), v)
        assert v.where == ("outside the allocator and the loader" if safe else "in malloc")


def test_frame_pointer_rules_are_followed() -> None:
    """WAIT's CFA is rbp+16 and it saved the caller's rbp at CFA-16: the walk reaches main through it."""
    s = Stack()
    sp = STACK + 0x700
    rbp = STACK + 0x780  # far above sp: only rbp finds the CFA
    s.put(rbp, 0x1234)  # the saved rbp
    s.put(rbp + 8, MAIN + 0x40)
    s.put(sp, MALLOC + 1)  # stale, in WAIT's frame
    v = examine(WAIT + 0x50, sp, rbp, s.read, UNSAFE, rules, STACK_END)
    assert v.safe and v.frames == 2 and not v.scanned


def test_a_frame_without_a_table_falls_back_to_scanning_from_there() -> None:
    s = Stack()
    sp = STACK + 0x800
    s.put(sp + 8, JIT + 0x10)  # LOOP was called from code no table covers
    v = examine(LOOP, sp, 0, s.read, UNSAFE, rules, STACK_END)
    assert v.safe and v.scanned and v.frames == 1  # nothing unsafe above it
    s.put(sp + 0x200, MALLOC + 0x80)
    v = examine(LOOP, sp, 0, s.read, UNSAFE, rules, STACK_END)
    assert not v.safe and v.scanned and v.where == "in malloc? (a word at sp+0x1f0 points there)"


def test_a_walk_that_does_not_climb_or_cannot_read_is_not_trusted() -> None:
    s = Stack()
    sp = STACK + 0x800
    looping = lambda a: Rule(a, CFA_RSP, 0, 0, 0)  # noqa: E731  CFA = sp: no progress
    v = examine(LOOP, sp, 0, s.read, UNSAFE, looping, STACK_END)
    assert v.scanned
    v = examine(LOOP, STACK_END + 0x100, 0, s.read, UNSAFE, rules, STACK_END)  # sp off the readable stack
    assert not v.safe and v.scanned
