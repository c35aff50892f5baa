"""Massif's options, with Massif's names, defaults and meanings (seed manual, "Massif Command-line Options")."""

from __future__ import annotations

from dataclasses import dataclass, field

# Massif's default alloc-fns: trimmed from the top of every stack.
DEFAULT_ALLOC_FNS: tuple[str, ...] = (
    "malloc",
    "__builtin_new",
    "operator new(unsigned long)",
    "operator new(unsigned long, std::nothrow_t const&)",
    "__builtin_vec_new",
    "operator new[](unsigned long)",
    "operator new[](unsigned long, std::nothrow_t const&)",
    "operator new(unsigned long, std::align_val_t)",
    "operator new(unsigned long, std::align_val_t, std::nothrow_t const&)",
    "operator new[](unsigned long, std::align_val_t)",
    "operator new[](unsigned long, std::align_val_t, std::nothrow_t const&)",
    "calloc",
    "realloc",
    "memalign",
    "posix_memalign",
    "valloc",
    "aligned_alloc",
    "reallocarray",
    "pvalloc",
)


# Frames the kernel walks at most: the BPF verifier rejects deeper walks (measured: 64 loads with MALT's
# statistics too, 96 does not).
MAX_WALKED_FRAMES = 64

# Massif 3.19 (ms_main.c make_ec) captures --depth + MAX_OVERESTIMATE (50) instruction pointers, the first
# being its own replacement of the allocation function, which it drops. Its tree then trims alloc-fns, cuts
# below main and keeps --depth of what is left; its xtree keeps all of them up to main. Our stacks start at
# the allocation function's caller, so Valgrind's capture is --depth + 49 of our frames.
MASSIF_CAPTURE_MARGIN = 49


@dataclass
class MassifOptions:
    heap: bool = True
    heap_admin: int = 8
    alignment: int = 16
    stacks: bool = False
    pages_as_heap: bool = False
    depth: int = 30
    alloc_fns: list[str] = field(default_factory=list)  # --alloc-fn, added to the defaults
    ignore_fns: list[str] = field(default_factory=list)  # --ignore-fn
    threshold: float = 1.0  # percent
    peak_inaccuracy: float = 1.0  # percent; heapscope's peak is exact, this only gates extra peak snapshots
    time_unit: str = "ms"  # i | ms | B; Massif's default i needs hardware instruction counters
    detailed_freq: int = 10
    max_snapshots: int = 100
    massif_out_file: str = "massif.out.%p"
    xtree_memory: str = "none"  # none | allocs | full
    xtree_memory_file: str = "xtmemory.kcg.%p"

    @property
    def all_alloc_fns(self) -> frozenset[str]:
        return frozenset(DEFAULT_ALLOC_FNS) | frozenset(self.alloc_fns)

    @property
    def xtree_frames(self) -> int:
        """Instruction pointers Valgrind's xtree keeps at most: Massif's whole capture."""
        return self.depth + MASSIF_CAPTURE_MARGIN

    @property
    def walked_frames(self) -> int:
        """Frames the kernel walks: Massif's capture (the tree keeps --depth of it after trimming alloc-fns,
        the xtree all of it), within the verifier's limit."""
        return min(self.xtree_frames, MAX_WALKED_FRAMES)

    def extra_bytes(self, request: int) -> int:
        """Massif's extra-heap model for one block: round-up slop plus the admin header."""
        a = self.alignment
        return (request + a - 1) // a * a - request + self.heap_admin
