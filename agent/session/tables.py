"""Unwind tables for the stack walk: each executable mapping's table, built or loaded once per object and handed
to the kernel as the target maps new objects (--unwind=cfi)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from agent.kernel.interface import UnwindMapping
from agent.model.maps import Mapping
from agent.model.summary import UnwindSummary
from agent.symbols.elf import ElfError, open_elf
from agent.symbols.unwind import UnwindTable


def rows_key(table: UnwindTable) -> str:
    """The identity an object's rows are shared under (agent.kernel.arrays SharedRows): its build id, else a digest
    of the rows themselves. Not its path: each container reaches one image's file by a path of its own
    (/proc/PID/root/...), and an object without a build id would be written once a container."""
    if table.build_id:
        return table.build_id
    return "rows:" + hashlib.blake2b(table.rows, digest_size=16).hexdigest()


class UnwindTables:
    def __init__(self, load: Callable[[str], UnwindTable | None]) -> None:
        self._load = load  # object path -> its table (agent.symbols.unwind.load_table: cached on disk)
        self._tables: dict[str, UnwindTable | None] = {}
        self._seconds: dict[str, float] = {}  # object path -> time to build or load its table
        self._keys: dict[str, str] = {}  # object path -> the identity its rows are shared under in the kernel
        self.problems: dict[str, str] = {}  # objects whose table could not be built, and why

    def entries(self, mappings: Sequence[Mapping]) -> list[UnwindMapping]:
        """The tables of the executable mappings among `mappings`, as the kernel takes them."""
        return [e for m in mappings if "x" in m.perms and (e := self._entry(m)) is not None]

    def _entry(self, m: Mapping) -> UnwindMapping | None:
        try:
            if m.path not in self._tables:  # each object's table is read once per session
                started = time.monotonic()
                self._tables[m.path] = self._load(m.path)
                self._seconds[m.path] = time.monotonic() - started
            table = self._tables[m.path]
            obj = open_elf(m.path)
        except (OSError, ElfError, ValueError) as exc:
            self.problems[m.path] = str(exc)
            return None
        vaddr = obj.file_offset_to_vaddr(m.offset)
        if table is None or vaddr is None:
            return None
        key = self._keys.get(m.path)
        if key is None:
            key = self._keys[m.path] = rows_key(table)
        return UnwindMapping(m.start, m.end, m.start - vaddr, key, table.rows, table.n_rows)

    def summary(self, rows_used: int, rows_dropped: int, rows_shared: int = 0) -> UnwindSummary:
        return UnwindSummary(
            rows_used=rows_used,
            rows_dropped=rows_dropped,
            rows_shared=rows_shared,
            objects=len(self._seconds),
            seconds=sum(self._seconds.values()),
            problems=dict(self.problems),
        )
