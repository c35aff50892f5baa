"""The array maps user space reads or fills in bulk: an mmapable array mapped as far as it is read (MappedArray), a
small one mapped whole and read in place (MappedWords), and the unwind rows table every target of the process shares
(SharedRows)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Iterable
from importlib import resources
from typing import Any

from agent.errors import HeapscopeError
from agent.kernel.interface import ProbeSettings, SiteArray
from agent.kernel.loader import compile_program
from agent.kernel.rowspace import RowSpace


def mapping_length(nbytes: int) -> int:
    """The length of a mapping that holds `nbytes` of a map: whole pages."""
    return (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


def mapped_prefix(table: Any, count: int) -> bytes | None:
    """Entries 0..count-1 of an mmapable array (BPF_F_MMAPABLE: every per-target array) copied from a mapping of
    it: a memory copy, where the batch lookup copies each value out of the kernel apart (some 300 ns a value here;
    MALT's end reads 13,000 of them). None where the map cannot be mapped, or pads its values."""
    size = ctypes.sizeof(table.Leaf)
    if size % 8 or count > table.max_entries:  # the kernel lays values out rounded up to 8 bytes
        return None
    try:
        with mmap.mmap(table.map_fd, mapping_length(count * size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
            return m[: count * size]
    except (OSError, ValueError):  # EINVAL: not mmapable
        return None


class MappedArray:
    """An mmapable array map (BPF_F_MMAPABLE), mapped read-only as far as it is read: the kernel maps every
    page of a mapping at once, so mapping all of a 65,536-entry array would count its tens of MB in the
    daemon's RSS. The mapping doubles when a read goes past it; earlier ones stay until close(), as a reader
    in another thread may still be using one."""

    FIRST = 1024  # entries mapped at first

    def __init__(self, table: Any, max_entries: int) -> None:
        self._table = table
        self._max = max_entries
        self._lock = threading.Lock()
        self._mappings: list[tuple[mmap.mmap, SiteArray]] = []
        self._view: SiteArray | None = None
        self.view(1)  # fail at load, not at the first read, where mmapable arrays are missing

    def view(self, count: int) -> SiteArray:
        """A view holding at least entries 0..count-1 (all there are, if fewer)."""
        v = self._view
        if v is not None and (count <= v.entries or v.entries >= self._max):
            return v
        with self._lock:
            v = self._view
            if v is None or (count > v.entries and v.entries < self._max):
                entries = min(self._max, max(self.FIRST, 1 << (count - 1).bit_length()))
                # The kernel lays the values out from offset 0 of the mapping, each rounded up to 8 bytes.
                size = entries * ctypes.sizeof(self._table.Leaf)
                mapping = mmap.mmap(
                    self._table.map_fd, mapping_length(size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ
                )
                v = SiteArray.of_leaf(mapping, self._table.Leaf, entries)
                self._mappings.append((mapping, v))
                self._view = v
            return v

    def close(self) -> None:
        self._view = None
        for mapping, v in self._mappings:
            v.release()
            with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with it
                mapping.close()
        self._mappings.clear()


class MappedWords:
    """A small mmapable array map (BPF_F_MMAPABLE) mapped whole, read-only: a counter or control word is one
    aligned 8-byte load, not a lookup syscall (the daemon reads a target's counters several times a tick).
    Writes still go through the map's update call, whose syscall orders them before the loads that follow."""

    def __init__(self, table: Any, entries: int) -> None:
        # The kernel lays the values out from offset 0 of the mapping, each rounded up to 8 bytes.
        self.stride = (ctypes.sizeof(table.Leaf) + 7) & ~7
        length = mapping_length(self.stride * entries)
        self._mapping = mmap.mmap(table.map_fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.bytes = memoryview(self._mapping)
        self.words = self.bytes.cast("Q")

    def close(self) -> None:
        """Unmapped now, or, while a reader still holds a view of it (take `bytes` or `words` into a variable of
        your own before reading: this deletes them here), when that view goes."""
        del self.bytes, self.words
        with contextlib.suppress(BufferError):
            self._mapping.close()


class SharedRows:
    """The unwind rows of every target of this process, in one BPF array (probes/heap.bpf.c unwind_rows). A
    small holder program declares it as a shared table and is kept for the process's life; each target's
    program refers to it as an extern table. An object's rows are written once whichever targets map it (libc's
    28,000 rows once, not once a target); an object no target uses any more keeps its rows, idle, for the next
    target of the same program, until their space is wanted for another (agent.kernel.rowspace). Its
    size is fixed by the first target (max_rows). It is never unloaded: libbcc's shared table entry shares the
    holder's descriptor, which must stay valid."""

    _instance: SharedRows | None = None
    _create_lock = threading.Lock()

    def __init__(self, max_rows: int, probes_dir: str) -> None:
        source = '#include "heap.h"\nBPF_TABLE_SHARED("array", int, struct hs_row, unwind_rows, HS_MAX_ROWS);\n'
        self._holder = compile_program(
            "cannot create the unwind rows table",
            text=source.encode(),
            cflags=[f"-I{probes_dir}", f"-DHS_MAX_ROWS={max_rows}"],
        )
        self.table = self._holder["unwind_rows"]  # looked up at the load, under BCC_LOCK (compile_program)
        self.max_rows = max_rows
        self.space = RowSpace(max_rows)
        self.lock = threading.Lock()

    @classmethod
    def prepare(cls) -> None:
        """Create the table now (a daemon at its start), so that it is there before the first target and not
        counted as something that target left behind; best effort: the first target reports any problem."""
        with contextlib.suppress(HeapscopeError):
            cls.get(ProbeSettings.max_rows, str(resources.files("probes")))

    @classmethod
    def get(cls, max_rows: int, probes_dir: str) -> SharedRows:
        with cls._create_lock:
            if cls._instance is None:
                cls._instance = SharedRows(max_rows, probes_dir)
            return cls._instance

    def acquire(self, key: str, rows: bytes, n_rows: int) -> tuple[int, int, bool] | None:
        """(first row, rows, new) of the object, its rows written if it is new here (new: no other target of
        this process has the object's identity, its build id); None when they do not fit."""
        with self.lock:
            got = self.space.acquire(key, n_rows)
            if got is None:
                return None
            placed, new = got
            if new and n_rows:
                table = self.table
                keys = (table.Key * n_rows)(*range(placed.first, placed.first + n_rows))
                values = (table.Leaf * n_rows).from_buffer_copy(rows)
                table.items_update_batch(keys, values)
            return placed.first, placed.count, new

    def release(self, keys: Iterable[str]) -> None:
        """A target's probes are gone: it uses these objects no more."""
        with self.lock:
            for key in keys:
                self.space.release(key)
