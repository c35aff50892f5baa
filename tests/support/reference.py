"""Reference implementations the tests judge the product by: simple, obviously right versions of what the product
does faster or in the kernel. They live here, not in the product, because only the tests use them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from agent.export.malt import MaltLeak, StackKey
from agent.model.pages import VSYSCALL, parse_maps_full
from agent.model.profile import HEAP_ROOT_LABEL, Frame, Stack
from agent.symbols.unwind import CFA_PLT, CFA_RBP, CFA_RSP, FLAG_RBP_SAVED, UnwindTable, lookup


@dataclass
class HeapNode:
    """One node of the full (unthresholded) tree: a frame and the useful bytes of all stacks through it."""

    frame: Frame
    bytes: int = 0
    children: dict[str, HeapNode] = field(default_factory=dict)  # keyed by Frame.label


@dataclass
class HeapTree:
    """Useful heap bytes per trimmed stack, merged into a prefix tree.

    The first level under the root is the innermost frame (the allocation's call site), as in Massif. Frames
    merge when their labels are equal (address, function, file and line). A stack that ends at a node counts
    in that node but in none of its children, as in Massif.
    """

    root_label: str = HEAP_ROOT_LABEL
    total: int = 0
    children: dict[str, HeapNode] = field(default_factory=dict)
    n_stacks: int = 0

    @classmethod
    def from_stacks(cls, stacks: Mapping[Stack, int], root_label: str = HEAP_ROOT_LABEL) -> HeapTree:
        """Build the tree. Give every stack seen so far, including those at 0 bytes: with --threshold=0
        Massif shows sites whose blocks were all freed. Empty stacks are ignored, as Massif ignores
        allocations with no frame left after trimming. Negative counts (a racy read) count as 0."""
        tree = cls(root_label=root_label)
        for stack, nbytes in stacks.items():
            tree.add(stack, nbytes)
        return tree

    def add(self, stack: Stack, nbytes: int) -> None:
        if not stack:
            return
        nbytes = max(0, int(nbytes))
        self.total += nbytes
        self.n_stacks += 1
        level = self.children
        for frame in stack:
            key = frame.label
            node = level.get(key)
            if node is None:
                node = level[key] = HeapNode(frame)
            node.bytes += nbytes
            level = node.children


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
