"""Global variables of the target's ELF objects, for MALT's `memStats.globalVariables`.

MALT lists, per binary file, the data objects that live for the whole run: object symbols of the symbol table
(`.symtab`, else `.dynsym` for a stripped object) with a size, placed in `.data`, `.bss` (initialised and
zeroed globals) or `.tdata`, `.tbss` (thread-local: one copy per thread, flagged `tls`). Names are shown
without their symbol version and demangled, as MALT does; the raw name is kept as `symbol`.

Reads files only, through agent.symbols.elf (symbols decoded in bulk) and pyelftools (section headers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from agent.model.malt import GlobalVariable
from agent.symbols.elf import ElfError, ElfSymbol, FileCache, NotElfError, open_elf
from agent.symbols.names import demangle

# st_info types (ELF gABI).
STT_OBJECT = 1
STT_TLS = 6

# The sections whose objects MALT counts as global variables (its memStats.globalVariables).
GLOBAL_SECTIONS: frozenset[str] = frozenset({".data", ".bss", ".tdata", ".tbss"})
TLS_SECTIONS: frozenset[str] = frozenset({".tdata", ".tbss"})


def _section_table(path: str) -> list[tuple[str, int]]:
    """(name, sh_offset) of every section, by index."""
    obj = open_elf(path)
    fh, elf = obj.open_elffile()
    with fh:
        return [(sec.name, sec["sh_offset"]) for sec in elf.iter_sections()]


def _display_name(symbol: str) -> str:
    return demangle(symbol.split("@", 1)[0])


def _object_symbols(symbols: Sequence[ElfSymbol]) -> list[ElfSymbol]:
    return [s for s in symbols if s.type in (STT_OBJECT, STT_TLS) and s.name and s.size > 0 and s.is_defined]


def variables_of(path: str) -> list[GlobalVariable]:
    """The global variables of one ELF file, in symbol-table order, read once while the file stays the same (each
    ended target's MALT profile lists its objects'). Raises ElfError when it is not ELF."""
    return _named(_variables.get(path), path)


def _named(variables: list[GlobalVariable], binary: str) -> list[GlobalVariable]:
    """The variables of one file, each giving `binary` as its file's name."""
    if not variables or variables[0].binary == binary:
        return variables
    return [replace(v, binary=binary) for v in variables]


def _read_variables(path: str) -> list[GlobalVariable]:
    obj = open_elf(path)
    symbols = _object_symbols(obj.symtab) or _object_symbols(obj.dynsym)
    sections = _section_table(path)
    out: list[GlobalVariable] = []
    seen: set[tuple[str, int]] = set()
    for sym in symbols:
        if sym.section_index >= len(sections):  # SHN_ABS, SHN_COMMON and other special indices
            continue
        sec_name, sec_offset = sections[sym.section_index]
        if sec_name not in GLOBAL_SECTIONS:
            continue
        key = (sym.name, sym.value)
        if key in seen:  # a symbol listed twice (local copies in .symtab) is one variable
            continue
        seen.add(key)
        out.append(
            GlobalVariable(
                name=_display_name(sym.name),
                size=sym.size,
                tls=sym.type == STT_TLS or sec_name in TLS_SECTIONS,
                section=sec_name,
                symbol=sym.name,
                offset=sym.value,
                section_offset=sec_offset,
                binary=path,
            )
        )
    return out


# Kept as read; each caller gives them the name it knows the file by (_named), once.
_variables: FileCache[list[GlobalVariable]] = FileCache(
    _read_variables, lambda variables, _path: variables, remembered=(NotElfError,)
)


def global_variables(objects: Mapping[str, str]) -> dict[str, list[GlobalVariable]]:
    """Global variables per object (the executable and its libraries), in the given order: `objects` maps where
    each file is opened to the name it is shown by (the process's own path, for a container), the name the
    result is keyed and its variables' `binary` are given.

    An object that cannot be read (gone, not ELF) is left out rather than failing the whole profile; an object
    without any global variable maps to an empty list, as in MALT's own files.
    """
    out: dict[str, list[GlobalVariable]] = {}
    for path, shown in objects.items():
        if shown in out:
            continue
        try:
            variables = _variables.get(path)
        except (ElfError, OSError):
            continue
        out[shown] = _named(variables, shown)
    return out
