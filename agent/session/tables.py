"""Unwind tables for the stack walk: each executable mapping's table, built or loaded once per object and handed
to the kernel as the target maps new objects (--unwind=cfi)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from agent.kernel.interface import UnwindMapping
from agent.model.maps import Mapping
from agent.model.summary import UnwindSummary
from agent.symbols.elf import ElfError, ElfObject, open_elf
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

    looked: float  # time.monotonic() of the load
    table: UnwindTable | None
    obj: ElfObject  # its segments, to place a mapping's file offset
    key: str  # rows_key(table), "" without a table


# Daemon-wide, by the file's identity (device, inode, size, mtime) and the loader: each process of a fleet (a prefork
# server's next worker, a pod of one image) reaches the same objects by a path of its own (/proc/PID/root/...), and
# a server that replaces its workers would otherwise load each object's table again for every worker's life. Loaded
# again after LOOK_AGAIN_SECONDS, as load_table looks again for a debug file installed since.
_LOOK_AGAIN_SECONDS = 30.0
_KNOWN_LIMIT = 256  # objects kept, the least recently used going first (agent.symbols.unwind keeps as many tables)
_known: OrderedDict[tuple[object, tuple[int, int, int, int]], _Known] = OrderedDict()
_known_lock = threading.Lock()


def _known_object(load: Callable[[str], UnwindTable | None], path: str) -> _Known:
    st = os.stat(path)
    ident = (load, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    now = time.monotonic()
    with _known_lock:
        known = _known.get(ident)
        if known is not None and now - known.looked < _LOOK_AGAIN_SECONDS:
            _known.move_to_end(ident)
            return known
    table = load(path)
    known = _Known(now, table, open_elf(path), rows_key(table) if table is not None else "")
    with _known_lock:
        _known[ident] = known
        while len(_known) > _KNOWN_LIMIT:
            _known.popitem(last=False)
    return known


class UnwindTables:
    def __init__(self, load: Callable[[str], UnwindTable | None]) -> None:
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
