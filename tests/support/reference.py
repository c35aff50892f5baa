"""Reference implementations the tests judge the product by: simple, obviously right versions of what the product
does faster or in the kernel. They live here, not in the product, because only the tests use them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from agent.model.malt import MaltLeak, StackKey
from agent.model.maps import VSYSCALL, parse_maps_full
from agent.symbols.unwind import CFA_PLT, CFA_RBP, CFA_RSP, FLAG_RBP_SAVED, UnwindTable, lookup


def unwind_python(
    table_for: Callable[[int], tuple[UnwindTable, int] | None],
    regs: Mapping[str, int],
    read_u64: Callable[[int], int | None],
    max_frames: int = 128,
) -> list[int]:
    """Walk a recorded stack with the tables: [rip, return address, return address, ...].

    table_for(pc) gives the table of the object mapped at pc and its load bias (runtime - ELF address), or None
    when nothing is mapped there. regs holds "rip", "rsp" and "rbp". read_u64(addr) is None for unreadable
    memory. Stops at an outermost frame, a pc without a rule, an unreadable slot or a zero return address.
    """
    pc, sp, bp = regs["rip"], regs["rsp"], regs["rbp"]
    frames = [pc]
    lookup_pc = pc
    while len(frames) < max_frames:
        found = table_for(pc)
        if found is None:
            break
        table, bias = found
        rule = lookup(table, lookup_pc - bias)
        if rule.cfa_type == CFA_RSP:
            cfa = sp + rule.cfa_offset
        elif rule.cfa_type == CFA_RBP:
            cfa = bp + rule.cfa_offset
        elif rule.cfa_type == CFA_PLT:
            cfa = sp + 8 + (8 if (pc & 15) >= 11 else 0)
        else:
            break
        ra = read_u64(cfa - 8)
        if ra is None or ra == 0:
            break
        if rule.flags & FLAG_RBP_SAVED:
            saved = read_u64(cfa + rule.rbp_offset)
            if saved is None:
                break
            bp = saved
        sp = cfa
        pc = ra
        lookup_pc = ra - 1
        frames.append(ra)
    return frames


def group_leaks(blocks: Iterable[tuple[StackKey, int]]) -> list[MaltLeak]:
    """Leaks from the blocks still alive at exit, given as (allocating stack, requested size): grouped by
    stack, largest memory first (ties: more blocks first, then the stack's addresses)."""
    counts: dict[StackKey, list[int]] = {}
    for key, size in blocks:
        acc = counts.setdefault(key, [0, 0])
        acc[0] += 1
        acc[1] += size
    leaks = [MaltLeak(key, n, mem) for key, (n, mem) in counts.items()]
    leaks.sort(key=lambda lk: (-lk.memory, -lk.count, lk.key.addresses, lk.key.function))
    return leaks


def mapped_total(maps_text: str) -> int:
    """The target's mapped bytes: the sum of (end - start) over every maps line but [vsyscall].

    [vsyscall] is the kernel's fixed legacy gate page above the user address space: it is not a VMA of the
    process, no syscall can map or unmap it, and the kernel leaves it out of VmSize. [vvar], [vvar_vclock]
    and [vdso] are real VMAs set up by execve and count. With that rule this equals VmSize in
    /proc/PID/status, and it is the figure `PageMap.from_maps` starts from.
    """
    return sum(e.size for e in parse_maps_full(maps_text) if e.path != VSYSCALL)
