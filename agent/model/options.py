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
    peak_inaccuracy: float = 1.0  # percent; accepted for Massif's sake: heapscope's peak is always exact
    time_unit: str = "ms"  # i | ms | B; Massif's default i needs hardware instruction counters
    detailed_freq: int = 10
    max_snapshots: int = 100
    xtree_memory: str = "none"  # none | allocs | full

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

    def extra_bytes(self, request: int, alignment: int | None = None) -> int:
        """Massif's extra-heap model for one block: its slop plus the admin header. `alignment`: the one the
        allocation function asked for (memalign...); malloc and the like use --alignment."""
        align = self.alignment if alignment is None else valgrind_alignment(alignment)
        return massif_slop(request, align) + self.heap_admin


# Valgrind's smallest alignment of a heap block on amd64 (VG_MIN_MALLOC_SZB).
MIN_MALLOC_ALIGNMENT = 16
# Valgrind's client arena (m_mallocfree.c): superblocks of 4 MiB; a bigger one holds one block, unsplit.
CLIENT_SUPERBLOCK = 4 << 20
# A superblock's header and its block's, on amd64 under Massif: a block's usable size is its superblock's less 64.
SUPERBLOCK_OVERHEAD = 64
PAGE = 4096
# The largest request that fits a 4 MiB superblock: bigger ones get a superblock of their own.
LARGEST_SPLIT_BLOCK = CLIENT_SUPERBLOCK - SUPERBLOCK_OVERHEAD


def valgrind_alignment(requested: int) -> int:
    """The alignment Valgrind's memalign replacement uses (vg_replace_malloc.c MEMALIGN): at least 16, rounded
    up to a power of two. posix_memalign and aligned_alloc go through it; valloc asks for a page."""
    align = max(requested, MIN_MALLOC_ALIGNMENT)
    return 1 << (align - 1).bit_length()


def massif_slop(request: int, alignment: int) -> int:
    """Massif's slop for a block (VG_(cli_malloc_usable_size) - request in Valgrind's arena, m_mallocfree.c),
    as probes/heap.bpf.c computes it.

    At the minimum alignment the payload is the request rounded up to 16. A larger alignment A goes through
    VG_(arena_memalign): it allocates round16(request) + 32 + A bytes and returns the first A-aligned payload
    at least 32 bytes (two block headers) in. The usable size is round16(request) + A - d, where d, a multiple
    of 16 in [0, A - 16], is set by the larger block's address modulo A in Valgrind's own arena: a result
    of every allocation and free the program made under Valgrind, which heapscope does not replay and which
    a run without Valgrind never has. d is taken at the middle of its range, so each block's slop is within
    slop_uncertainty(A) of Massif's. (Any block, aligned or not, also gets 16 bytes more in Massif when the
    arena gives it a free block one 16-byte granule larger than it needs, the rest too small to split off.)

    At the minimum alignment, a request above LARGEST_SPLIT_BLOCK does not fit the client arena's 4 MiB
    superblocks: VG_(arena_malloc) maps a superblock of its own for it, whole pages, which it does not split, so
    the block's usable size is the superblock's less SUPERBLOCK_OVERHEAD and its slop runs to the page end (up
    to 4,095 bytes; exact, whatever the arena's history). A request that fills a fresh 4 MiB superblock but for
    one granule gets that granule too. Aligned blocks never get a superblock of their own.
    """
    slop = -request % MIN_MALLOC_ALIGNMENT
    if alignment > MIN_MALLOC_ALIGNMENT:
        return slop + (alignment + MIN_MALLOC_ALIGNMENT) // 2
    if request + slop > LARGEST_SPLIT_BLOCK:
        return -(request + SUPERBLOCK_OVERHEAD) % PAGE
    if request + slop == LARGEST_SPLIT_BLOCK - MIN_MALLOC_ALIGNMENT:
        slop += MIN_MALLOC_ALIGNMENT
    return slop


def slop_uncertainty(alignment: int) -> int:
    """How far massif_slop can be from Massif's slop for one block of this (Valgrind) alignment."""
    return max(alignment - MIN_MALLOC_ALIGNMENT, 0) // 2
