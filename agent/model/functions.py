"""The allocation functions heapscope probes: one table, read by discovery, the BPF layer and MALT's profile.

Adding a function of a kind the kernel already knows (another alias of malloc, a C++ operator) is one row here.
A new kind is a row here, a member of `enum hs_fn` in probes/heap.h and its entry program `<kind>_enter` in
probes/heap.bpf.c (with its size rule in `request_size`); tests/unit/test_contract.py checks that the three agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AllocFunction:
    symbol: str  # the ELF symbol that is probed
    kind: str  # its member of probes/heap.h `enum hs_fn`, lower case without HS_: how the kernel reads the call
    registers: tuple[str, ...]  # argument registers the entry probe reads: the probe sits where they are intact
    cxx: bool = False  # a C++ operator: probed only where the allocator itself defines it (libstdc++'s call malloc)
    malt: str = ""  # the function name MALT's profile gives it (default: the symbol)

    @property
    def malt_name(self) -> str:
        return self.malt or self.symbol


ALLOC_FUNCTIONS: tuple[AllocFunction, ...] = (
    AllocFunction("malloc", "malloc", ("rdi",)),
    AllocFunction("calloc", "calloc", ("rdi", "rsi")),
    AllocFunction("realloc", "realloc", ("rdi", "rsi")),
    AllocFunction("reallocarray", "reallocarray", ("rdi", "rsi", "rdx")),
    AllocFunction("memalign", "memalign", ("rdi", "rsi")),
    AllocFunction("aligned_alloc", "memalign", ("rdi", "rsi")),
    AllocFunction("posix_memalign", "posix_memalign", ("rdi", "rsi", "rdx")),
    AllocFunction("valloc", "valloc", ("rdi",)),
    AllocFunction("pvalloc", "pvalloc", ("rdi",)),
    AllocFunction("free", "free", ("rdi",)),
    AllocFunction("cfree", "free", ("rdi",), malt="free"),
    AllocFunction("_Znwm", "malloc", ("rdi",), cxx=True),
    AllocFunction("_Znam", "malloc", ("rdi",), cxx=True),
    AllocFunction("_ZnwmRKSt9nothrow_t", "malloc", ("rdi",), cxx=True),
    AllocFunction("_ZnamRKSt9nothrow_t", "malloc", ("rdi",), cxx=True),
    AllocFunction("_ZdlPv", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdaPv", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdlPvm", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdaPvm", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdlPvRKSt9nothrow_t", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdaPvRKSt9nothrow_t", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdlPvSt11align_val_t", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdaPvSt11align_val_t", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdlPvmSt11align_val_t", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdaPvmSt11align_val_t", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdlPvSt11align_val_tRKSt9nothrow_t", "free", ("rdi",), cxx=True),
    AllocFunction("_ZdaPvSt11align_val_tRKSt9nothrow_t", "free", ("rdi",), cxx=True),
    # jemalloc's own API (redis-server and others call it): probed where the allocator defines it
    AllocFunction("mallocx", "malloc", ("rdi",)),
    AllocFunction("rallocx", "realloc", ("rdi", "rsi")),
    AllocFunction("dallocx", "free", ("rdi",)),
    AllocFunction("sdallocx", "free", ("rdi",)),
)
BY_SYMBOL: dict[str, AllocFunction] = {f.symbol: f for f in ALLOC_FUNCTIONS}

# The sampler's hooks (probes/sampler/hs_sampler.c, define_hooks) are the same functions but for these, each with
# why; tests/unit/test_contract.py reads both tables and checks that this is all that differs.
SAMPLED_ONLY: dict[str, str] = {
    sym: "aligned operator new takes (size, alignment), an argument order no kernel kind reads: exact mode has no "
    "probe for it (its blocks' frees are seen, as untracked frees)"
    for sym in ("_ZnwmSt11align_val_t", "_ZnamSt11align_val_t", "_ZnwmSt11align_val_tRKSt9nothrow_t",
                "_ZnamSt11align_val_tRKSt9nothrow_t")
}  # fmt: skip
EXACT_ONLY: dict[str, str] = {
    "cfree": "free under an old name, gone from glibc 2.26: a program that still calls it goes through exact mode's "
    "probe on the function, which the sampler's GOT hooks do not look for",
}

# Kinds whose call has no return probe: all the kernel needs is the argument at entry.
ENTRY_ONLY_KINDS = frozenset({"free"})

# MALT's name for the calls of a kind, where it is not the kind's own name (its site statistics and per-thread
# counts are kept by kind in the kernel).
_KIND_MALT_NAMES = {"reallocarray": "realloc"}


def malt_name_of_kind(kind: str) -> str:
    return _KIND_MALT_NAMES.get(kind, kind)
