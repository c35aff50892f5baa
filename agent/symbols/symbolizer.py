"""Symbolization the way Valgrind/Massif prints frames: `fn (file:line)`, inlined calls as extra frames.

Input is a recorded list of mappings (from /proc/PID/maps while the target was alive) and runtime addresses;
only files on disk are read afterwards, so a target that has exited can still be symbolized.

This module puts a frame together from the object's names (agent.symbols.names), its DWARF
(agent.symbols.dwarf) and its separate debug file (agent.symbols.debugfiles), as Valgrind 3.19 does:
- The caller frames it shows are return address - 1 (the call instruction), and it prints that address.
- No symbol gives `???`; no line information gives `fn (in /path/to/object)`.

Everything read from an object is cached per build-id.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.model.maps import Mapping
from agent.model.stack import Frame
from agent.symbols.debugfiles import DEFAULT_DEBUG_ROOTS, find_debug_file
from agent.symbols.dwarf import Dwarf, SourceInfo
from agent.symbols.elf import ElfError, ElfObject, ElfSymbol, open_elf
from agent.symbols.names import SymbolTable, display_function_name

# ----------------------------------------------------------------------------------------------------------
# Per-object state


# One resolved level: (function or None, file or None, line or None).
_Level = tuple[str | None, str | None, int | None]


class _ObjectInfo:
    """Everything known about one build of one object; shared by all paths with that build-id."""

    def __init__(self, obj: ElfObject, debug_roots: Sequence[str]) -> None:
        self.obj = obj
        self._debug_roots = tuple(debug_roots)
        self._lock = threading.RLock()
        self._debug: ElfObject | None = None
        self._debug_looked = False
        self._symbols: SymbolTable | None = None
        self._dwarf: Dwarf | None = None
        self._dwarf_failed = False
        self._levels: dict[int, tuple[_Level, ...]] = {}

    @property
    def debug_object(self) -> ElfObject | None:
        """The file that holds this object's DWARF: itself, a separate debug file, or None."""
        if not self._debug_looked:
            self._debug_looked = True
            self._debug = self.obj if self.obj.has_dwarf else find_debug_file(self.obj, self._debug_roots)
        return self._debug

    @property
    def symbols(self) -> SymbolTable:
        if self._symbols is None:
            syms: list[ElfSymbol] = list(self.obj.function_symbols())
            dbg = self.debug_object
            if dbg is not None and dbg is not self.obj:
                syms.extend(dbg.function_symbols())
            self._symbols = SymbolTable(syms)
        return self._symbols

    def _dwarf_for(self) -> Dwarf | None:
        if self._dwarf is None and not self._dwarf_failed:
            dbg = self.debug_object
            if dbg is None:
                self._dwarf_failed = True
            else:
                try:
                    self._dwarf = Dwarf(dbg)
                except Exception:  # unreadable DWARF: fall back to symbols only
                    self._dwarf_failed = True
        return self._dwarf

    def levels(self, vaddr: int) -> tuple[_Level, ...]:
        """Frames at vaddr as (function, file, line), innermost inlined function first."""
        with self._lock:
            cached = self._levels.get(vaddr)
            if cached is not None:
                return cached
            result = self._resolve(vaddr)
            self._levels[vaddr] = result
            return result

    def _resolve(self, vaddr: int) -> tuple[_Level, ...]:
        raw = self.symbols.lookup(vaddr)
        outer_name = display_function_name(raw) if raw is not None else None
        dwarf = self._dwarf_for()
        src: SourceInfo | None = None
        if dwarf is not None:
            try:
                src = dwarf.source_info(vaddr)
            except Exception:  # malformed DWARF in one unit must not break the whole stack
                src = None
        if src is None:
            return ((outer_name, None, None),)
        if not src.inlined:
            return ((outer_name, src.file, src.line),)
        chain = src.inlined  # outermost first
        levels: list[_Level] = [(chain[-1].function, src.file, src.line)]
        for k in range(len(chain) - 1, 0, -1):
            levels.append((chain[k - 1].function, chain[k].call_file, chain[k].call_line))
        levels.append((outer_name, chain[0].call_file, chain[0].call_line))
        return tuple(levels)


# One state per build, shared by every symbolizer that holds it: a daemon's targets all map the same libc, whose
# DWARF alone is some 16 MiB once read, and a state per target made each busy or ended target pay for it again.
_shared: weakref.WeakValueDictionary[tuple[str, tuple[str, ...]], _ObjectInfo] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()
# The builds used last are also held here, whoever else does: a daemon that profiles one short-lived process of a
# program after another (recycled workers, repeated attaches) reads its DWARF once, not once a process.
_RECENT_BUILDS = 16
_recent: OrderedDict[tuple[str, tuple[str, ...]], _ObjectInfo] = OrderedDict()


def _shared_info(obj: ElfObject, debug_roots: tuple[str, ...]) -> _ObjectInfo:
    """The state of obj's build (it has a build-id), made when no symbolizer holds one."""
    key = (obj.build_id or "", debug_roots)
    with _shared_lock:
        info = _shared.get(key)
        if info is None:
            info = _shared[key] = _ObjectInfo(obj, debug_roots)
        _recent[key] = info
        _recent.move_to_end(key)
        while len(_recent) > _RECENT_BUILDS:
            _recent.popitem(last=False)
        return info


# ----------------------------------------------------------------------------------------------------------
# The symbolizer


@dataclass
class _MappingIndex:
    starts: list[int] = field(default_factory=list)
    mappings: list[Mapping] = field(default_factory=list)


class Symbolizer:
    """Runtime address + recorded mappings -> Massif-style frames. Thread-safe; caches per build-id."""

    def __init__(self, debug_roots: Sequence[str] = DEFAULT_DEBUG_ROOTS) -> None:
        self.debug_roots = tuple(debug_roots)
        self._lock = threading.RLock()
        self._by_key: dict[object, _ObjectInfo] = {}
        self._by_path: dict[str, _ObjectInfo | None] = {}
        self._index_src: tuple[Mapping, ...] | None = None
        self._index = _MappingIndex()

    def close(self) -> None:
        """Let go of the objects' state; a build's DWARF is closed once no symbolizer holds it."""
        with self._lock:
            self._by_key.clear()
            self._by_path.clear()

    def __enter__(self) -> Symbolizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def object_info(self, path: str) -> _ObjectInfo | None:
        """The cached per-build state of the object at path (None when the file is gone or not ELF)."""
        with self._lock:
            if path in self._by_path:
                return self._by_path[path]
            try:
                obj = open_elf(path)
            except ElfError:
                self._by_path[path] = None
                return None
            key: object = obj.build_id if obj.build_id else (path, obj)
            info = self._by_key.get(key)
            if info is None:
                info = _shared_info(obj, self.debug_roots) if obj.build_id else _ObjectInfo(obj, self.debug_roots)
                self._by_key[key] = info
            self._by_path[path] = info
            return info

    def _find_mapping(self, mappings: Sequence[Mapping], address: int) -> Mapping | None:
        if isinstance(mappings, tuple):
            with self._lock:
                if self._index_src is not mappings:
                    ordered = sorted(mappings, key=lambda m: m.start)
                    self._index = _MappingIndex([m.start for m in ordered], ordered)
                    self._index_src = mappings
                index = self._index
            i = bisect.bisect_right(index.starts, address) - 1
            if i >= 0 and index.mappings[i].contains(address):
                return index.mappings[i]
            return None
        for m in mappings:
            if m.contains(address):
                return m
        return None

    def symbolize(self, mappings: Sequence[Mapping], address: int, *, is_return_address: bool = True) -> list[Frame]:
        """Frames for one address, innermost inlined function first, all at the same address.

        For a return address the call instruction (address - 1) is looked up, and that is also the
        address the frames carry, because it is the address Valgrind prints.
        """
        look = address - 1 if is_return_address else address
        m = self._find_mapping(mappings, look)
        if m is None:
            return [Frame(address=look)]
        info = self.object_info(m.path)
        if info is None or (m.build_id is not None and info.obj.build_id != m.build_id):
            return [Frame(address=look, obj=m.name)]
        vaddr = info.obj.file_offset_to_vaddr(look - m.start + m.offset)
        if vaddr is None:
            return [Frame(address=look, obj=m.name)]
        levels = info.levels(vaddr)
        return [
            Frame(address=look, function=fn, file=file, line=line, obj=m.name, inlined=i + 1 < len(levels))
            for i, (fn, file, line) in enumerate(levels)
        ]

    def symbolize_stack(
        self, mappings: Sequence[Mapping], addresses: Sequence[int], *, first_is_return_address: bool = True
    ) -> list[Frame]:
        """A whole stack (innermost first) as one flat list of frames; every address is taken as a return
        address except possibly the first (an instruction pointer sampled in place)."""
        maps = tuple(mappings)
        frames: list[Frame] = []
        for i, addr in enumerate(addresses):
            frames.extend(self.symbolize(maps, addr, is_return_address=first_is_return_address or i > 0))
        return frames

    def resolver(self, mappings: Sequence[Mapping]) -> Callable[[int], list[Frame]]:
        """The frames of one return address in these mappings, as a function (MALT's writer asks one at a time)."""
        maps = tuple(mappings)

        def resolve(address: int) -> list[Frame]:
            return self.symbolize(maps, address, is_return_address=True)

        return resolve
