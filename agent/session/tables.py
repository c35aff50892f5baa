"""Unwind tables for the stack walk: each executable mapping's table, built or loaded once per object and handed
to the kernel as the target maps new objects (--unwind=cfi)."""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

from agent.kernel.interface import UnwindMapping
from agent.model.maps import Mapping
from agent.model.summary import UnwindSummary
from agent.symbols.elf import ElfError, ElfObject, FileCache, open_elf
from agent.symbols.unwind import UnwindTable


def rows_key(table: UnwindTable) -> str:
    """The identity an object's rows are shared under (agent.kernel.arrays SharedRows): its build id, else a digest
    of the rows themselves. Not its path: each container reaches one image's file by a path of its own
    (/proc/PID/root/...), and an object without a build id would be written once a container."""
    if table.build_id:
        return table.build_id
    return "rows:" + hashlib.blake2b(table.rows, digest_size=16).hexdigest()


class _Known(NamedTuple):
    """What a session needs of one object file to hand its table to the kernel."""

    table: UnwindTable | None
    obj: ElfObject  # its segments, to place a mapping's file offset
    key: str  # rows_key(table), "" without a table


# Daemon-wide, by the file (agent.symbols.elf.FileCache: its device, inode, size and mtime), one cache per loader:
# each process of a fleet (a prefork server's next worker, a pod of one image) reaches the same objects by a path of
# its own (/proc/PID/root/...), and a server that replaces its workers would otherwise load each object's table
# again for every worker's life. Read again after 30 s, as load_table looks again for a debug file installed since;
# 256 objects, as agent.symbols.unwind keeps as many tables.
_LOOK_AGAIN_SECONDS = 30.0
_KNOWN_LIMIT = 256
Loader = Callable[[str], UnwindTable | None]  # object path -> its table (agent.symbols.unwind.load_table)
_caches: weakref.WeakKeyDictionary[Loader, FileCache[_Known]] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def _known_object(load: Loader, path: str) -> _Known:
    with _caches_lock:
        cache = _caches.get(load)
        if cache is None:
            cache = _caches[load] = _object_cache(weakref.ref(load))
    return cache.get(path)


def _object_cache(loader: weakref.ref[Loader]) -> FileCache[_Known]:
    """The cache of one loader's objects, holding it weakly: its entry in _caches goes with it (a test's loader)."""

    def read(path: str) -> _Known:
        load = loader()
        assert load is not None, "read only while _known_object's caller holds the loader"
        table = load(path)
        return _Known(table, open_elf(path), rows_key(table) if table is not None else "")

    # A value serves every path to its file: only the place of a mapping's offset is read of its object.
    return FileCache(read, lambda known, _path: known, _KNOWN_LIMIT, max_age=_LOOK_AGAIN_SECONDS)


class UnwindTables:
    def __init__(self, load: Loader) -> None:
        self._load = load  # object path -> its table (agent.symbols.unwind.load_table: cached on disk)
        self._objects: dict[str, _Known] = {}  # object path -> what this session uses of it
        self._seconds: dict[str, float] = {}  # object path -> time to build or load its table
        self.problems: dict[str, str] = {}  # objects whose table could not be built, and why

    def entries(self, mappings: Sequence[Mapping]) -> list[UnwindMapping]:
        """The tables of the executable mappings among `mappings`, as the kernel takes them."""
        return [e for m in mappings if "x" in m.perms and (e := self._entry(m)) is not None]

    def _entry(self, m: Mapping) -> UnwindMapping | None:
        known = self._objects.get(m.path)  # each object is looked up once per session
        if known is None:
            started = time.monotonic()
            try:
                known = self._objects[m.path] = _known_object(self._load, m.path)
            except (OSError, ElfError, ValueError) as exc:
                self.problems[m.path] = str(exc)
                return None
            self._seconds[m.path] = time.monotonic() - started
        table = known.table
        vaddr = known.obj.file_offset_to_vaddr(m.offset)
        if table is None or vaddr is None:
            return None
        return UnwindMapping(m.start, m.end, m.start - vaddr, known.key, table.rows, table.n_rows)

    def summary(self, rows_used: int, rows_dropped: int, rows_shared: int = 0) -> UnwindSummary:
        return UnwindSummary(
            rows_used=rows_used,
            rows_dropped=rows_dropped,
            rows_shared=rows_shared,
            objects=len(self._seconds),
            seconds=sum(self._seconds.values()),
            problems=dict(self.problems),
        )
