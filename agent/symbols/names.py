"""Function names as Valgrind 3.19 prints them.

- The outermost function at an address is named from the ELF symbol tables (.symtab and .dynsym of the object
  and of its separate debug file), demangled. Aliases of one range are resolved by Valgrind's preference:
  shortest name ignoring `@VERSION`, then versioned, then alphabetical.
- `__libc_start_main` and friends are renamed `(below main)`.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from agent.symbols.elf import ElfSymbol

# ----------------------------------------------------------------------------------------------------------
# C++ demangling through libstdc++ (the same demangler family Valgrind bundles from libiberty)


class _Demangler:
    def __init__(self) -> None:
        self._fn: Any = None
        self._free: Any = None
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return
        fn = getattr(lib, "__cxa_demangle")  # getattr: a literal __name would be class-mangled
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._fn = fn
        self._free = libc.free
        self._free.argtypes = [ctypes.c_void_p]
        self._free.restype = None

    def __call__(self, name: str) -> str:
        if self._fn is None:
            return name
        status = ctypes.c_int(0)
        ptr = self._fn(name.encode("utf-8", "replace"), None, None, ctypes.byref(status))
        if not ptr:
            return name
        try:
            if status.value != 0:
                return name
            return ctypes.string_at(ptr).decode("utf-8", "replace")
        finally:
            self._free(ptr)


_demangler = _Demangler()


@lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """Itanium C++ demangling of a symbol name; other names (C, versioned `foo@@V`) come back unchanged."""
    if not name.startswith("_Z"):
        return name
    return _demangler(name)


# Valgrind's "below main" function names on Linux (3.19 m_debuginfo get_fnname_kind), matched as they stand.
_BELOW_MAIN_EXACT = frozenset({"__libc_start_main", "__libc_start_call_main", "generic_start_main", "_start"})
_BELOW_MAIN_PREFIX = ("__libc_start_main.", "generic_start_main.")
BELOW_MAIN = "(below main)"


def is_below_main(name: str) -> bool:
    """A (demangled) function of the C start-up code that calls main."""
    return name in _BELOW_MAIN_EXACT or name.startswith(_BELOW_MAIN_PREFIX)


def display_function_name(raw: str) -> str:
    """A symbol-table name as Valgrind prints it: demangled, with the C start-up code as `(below main)`."""
    name = demangle(raw)
    return BELOW_MAIN if is_below_main(name) else name


# ----------------------------------------------------------------------------------------------------------
# Function symbols, canonicalised like Valgrind's symbol table


def _prefer(a: str, b: str) -> bool:
    """True when Valgrind would show name a rather than name b for one address range."""
    va, vb = a.find("@"), b.find("@")
    la = va if va >= 0 else len(a)
    lb = vb if vb >= 0 else len(b)
    if la and not lb:
        return True
    if lb and not la:
        return False
    blank_a, blank_b = not a.strip(), not b.strip()
    if blank_a != blank_b:
        return blank_b
    if la != lb:
        return la < lb
    if (va >= 0) != (vb >= 0):
        return va >= 0
    return a <= b


def _best_name(names: Sequence[str]) -> str:
    best = names[0]
    for cand in names[1:]:
        if not _prefer(best, cand):
            best = cand
    return best


@dataclass
class _Sym:
    start: int
    end: int  # exclusive
    names: list[str]


class SymbolTable:
    """Non-overlapping function ranges, each with one display name (Valgrind's canonicalised symtab)."""

    def __init__(self, symbols: Iterator[ElfSymbol] | Sequence[ElfSymbol]) -> None:
        syms: list[_Sym] = []
        for s in symbols:
            # Valgrind ignores nameless, zero-sized and zero-valued symbols.
            if not s.is_function or not s.name or s.size == 0 or s.value == 0:
                continue
            syms.append(_Sym(s.value, s.value + s.size, [s.name]))
        canon = self._canonicalise(syms)
        self._starts = [s.start for s in canon]
        self._ends = [s.end for s in canon]
        self._names = [_best_name(s.names) for s in canon]

    @staticmethod
    def _canonicalise(syms: list[_Sym]) -> list[_Sym]:
        while True:
            syms.sort(key=lambda s: (s.start, s.end))
            merged: list[_Sym] = []
            for s in syms:  # identical ranges become one entry with all the names
                if merged and merged[-1].start == s.start and merged[-1].end == s.end:
                    merged[-1].names.extend(n for n in s.names if n not in merged[-1].names)
                else:
                    merged.append(s)
            syms = merged
            changed = False
            for i in range(len(syms) - 1):
                a, b = syms[i], syms[i + 1]
                if a.end <= b.start:
                    continue
                changed = True
                if a.start < b.start:
                    a.end = b.start  # an enclosing symbol is cut where the next one starts
                elif a.end < b.end:
                    b.start = a.end  # same start: the longer one keeps only its tail
                # equal ranges cannot be neighbours here: they were merged above
            if not changed:
                return [s for s in syms if s.end > s.start]
            syms = [s for s in syms if s.end > s.start]

    def lookup(self, vaddr: int) -> str | None:
        """The raw (not demangled) display name of the function holding vaddr, or None."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i >= 0 and vaddr < self._ends[i]:
            return self._names[i]
        return None

    def __len__(self) -> int:
        return len(self._starts)

