"""ELF objects on disk: load segments, build-id, symbol tables, bytes at a virtual address.

Reads files only (never a live process), so it works after the target has exited. pyelftools parses the
headers; symbol tables are decoded with `struct` because libc's debug file has ~10k symbols and pyelftools
builds one Python object per symbol.
"""

from __future__ import annotations

import copy
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Generic, TypeVar, cast

from elftools.elf.elffile import ELFFile

T = TypeVar("T")
R = TypeVar("R")

ET_DYN = "ET_DYN"

# st_info type/binding values (ELF gABI), kept numeric because symbols are decoded by hand.
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_LOCAL, STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE = 0, 1, 2, 10
SHT_NOBITS = "SHT_NOBITS"


class ElfError(Exception):
    """The file is missing, unreadable or not ELF."""


class NotElfError(ElfError):
    """The file was read and is not ELF (a mapped data file): it stays so while it is the same file."""


@dataclass(frozen=True)
class LoadSegment:
    """One PT_LOAD program header."""

    vaddr: int
    memsz: int
    offset: int
    filesz: int
    flags: int  # PF_X=1, PF_W=2, PF_R=4

    @property
    def executable(self) -> bool:
        return bool(self.flags & 1)


@dataclass(frozen=True)
class ElfSymbol:
    """One entry of .dynsym or .symtab (name exactly as stored, so versioned names keep their `@VER`)."""

    name: str
    value: int
    size: int
    type: int  # STT_*
    bind: int  # STB_*
    section_index: int  # st_shndx; 0 means undefined

    @property
    def is_function(self) -> bool:
        return self.type in (STT_FUNC, STT_GNU_IFUNC)

    @property
    def is_defined(self) -> bool:
        return self.section_index != 0


@dataclass(frozen=True)
class _FileId:
    """What makes a file on disk the same file: a replaced library gets a new inode or mtime."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class ElfObject:
    """An ELF file on disk. Headers are read by open_elf(); symbol tables on first use.

    Equality is (path, build_id): two ElfObjects for the same build are interchangeable.
    """

    path: str
    build_id: str | None
    elf_type: str  # ET_EXEC, ET_DYN, ...
    segments: tuple[LoadSegment, ...] = field(compare=False)
    section_names: frozenset[str] = field(compare=False, repr=False)
    debuglink: tuple[str, int] | None = field(compare=False, repr=False)  # (.gnu_debuglink name, CRC32)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)
    # Symbol tables read on first use, shared with the same file's twins at other paths (_same_file_at).
    _memo: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_pie_or_shared(self) -> bool:
        """ET_DYN: a PIE executable or a shared library, loaded at a bias chosen at run time."""
        return self.elf_type == ET_DYN

    @property
    def has_dwarf(self) -> bool:
        return ".debug_info" in self.section_names or ".zdebug_info" in self.section_names

    @property
    def has_symtab(self) -> bool:
        return ".symtab" in self.section_names

    # ---- addresses ----

    def vaddr_to_file_offset(self, vaddr: int) -> int:
        """File offset of a virtual address that is backed by file bytes (not .bss)."""
        for seg in self.segments:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                return seg.offset + (vaddr - seg.vaddr)
        raise ValueError(f"0x{vaddr:x} is not in a file-backed PT_LOAD segment of {self.path}")

    def file_offset_to_vaddr(self, offset: int) -> int | None:
        """Virtual address of a file offset, or None when no PT_LOAD segment maps it."""
        for seg in self.segments:
            if seg.offset <= offset < seg.offset + seg.filesz:
                return seg.vaddr + (offset - seg.offset)
        return None

    def code_bytes(self, vaddr: int, n: int) -> bytes:
        """Up to n bytes of the file at a virtual address (stops at the end of its segment)."""
        for seg in self.segments:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                n = min(n, seg.vaddr + seg.filesz - vaddr)
                with open(self.path, "rb") as fh:
                    fh.seek(seg.offset + (vaddr - seg.vaddr))
                    return fh.read(n)
        raise ValueError(f"0x{vaddr:x} is not in a file-backed PT_LOAD segment of {self.path}")

    # ---- symbols ----

    def memoized(self, name: str, compute: Callable[[], R]) -> R:
        """compute(), once for this file (its twins at other paths share it): for what is read of its symbols."""
        found = self._memo.get(name)
        if found is None:
            found = self._memo.setdefault(name, compute())
        return cast(R, found)

    @property
    def dynsym(self) -> tuple[ElfSymbol, ...]:
        return self.memoized("dynsym", lambda: tuple(self._read_symbols(".dynsym")))

    @property
    def symtab(self) -> tuple[ElfSymbol, ...]:
        return self.memoized("symtab", lambda: tuple(self._read_symbols(".symtab")))

    @property
    def _defined_by_name(self) -> dict[str, tuple[int, int]]:
        return self.memoized("defined", self._defined_table)

    def _defined_table(self) -> dict[str, tuple[int, int]]:
        # .symtab first so that .dynsym entries overwrite them: the exported definition wins.
        table: dict[str, tuple[int, int]] = {}
        for sym in (*self.symtab, *self.dynsym):
            if sym.is_defined and sym.name:
                table[sym.name] = (sym.value, sym.size)
        return table

    def find_symbol(self, name: str) -> tuple[int, int] | None:
        """(st_value, st_size) of a defined symbol, from .dynsym, else .symtab. Versioned .symtab names
        (`malloc@@GLIBC_2.2.5`) also answer their bare name."""
        found = self._defined_by_name.get(name)
        if found is not None:
            return found
        for key, value in self._defined_by_name.items():
            if key.split("@", 1)[0] == name:
                return value
        return None

    def symbols_named(self, names: Iterable[str]) -> dict[str, tuple[int, int]]:
        """find_symbol for several names; names that are not defined are left out."""
        out: dict[str, tuple[int, int]] = {}
        for name in names:
            found = self.find_symbol(name)
            if found is not None:
                out[name] = found
        return out

    def function_symbols(self) -> Iterator[ElfSymbol]:
        """Defined FUNC/IFUNC symbols of both tables (duplicates included; the symbolizer merges them)."""
        for sym in (*self.symtab, *self.dynsym):
            if sym.is_function and sym.is_defined:
                yield sym

    def open_elffile(self) -> tuple[BinaryIO, ELFFile]:
        """A fresh pyelftools handle (the caller owns and closes the stream)."""
        fh = open(self.path, "rb")  # noqa: SIM115 - returned to the caller, which closes it
        try:
            return fh, ELFFile(fh)
        except Exception:
            fh.close()
            raise

    def _read_symbols(self, section_name: str) -> list[ElfSymbol]:
        with self._lock:
            fh, elf = self.open_elffile()
            with fh:
                sec = elf.get_section_by_name(section_name)
                if sec is None or sec["sh_type"] == SHT_NOBITS:
                    return []
                strtab = elf.get_section(sec["sh_link"])
                if strtab["sh_type"] == SHT_NOBITS:
                    return []
                data = sec.data()
                strings = strtab.data()
                little = elf.little_endian
                is64 = elf.elfclass == 64
        return list(_decode_symbols(data, strings, little, is64))


def _decode_symbols(data: bytes, strings: bytes, little: bool, is64: bool) -> Iterator[ElfSymbol]:
    end = "<" if little else ">"
    # Elf64_Sym: name, info, other, shndx, value, size. Elf32_Sym: name, value, size, info, other, shndx.
    fmt = struct.Struct(end + ("IBBHQQ" if is64 else "IIIBBH"))
    usable = len(data) - len(data) % fmt.size
    for fields in fmt.iter_unpack(data[:usable]):
        if is64:
            name_off, info, _other, shndx, value, size = fields
        else:
            name_off, value, size, info, _other, shndx = fields
        stop = strings.find(b"\0", name_off)
        name = strings[name_off : stop if stop >= 0 else len(strings)].decode("utf-8", "replace")
        yield ElfSymbol(name, value, size, info & 0xF, info >> 4, shndx)


def _read_header(path: str) -> ElfObject:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ElfError(f"cannot open {path}: {exc.strerror}") from exc
    with fh:
        try:
            elf = ELFFile(fh)
        except Exception as exc:  # pyelftools raises ELFError and struct errors alike
            raise NotElfError(f"{path} is not an ELF file: {exc}") from exc
        segments = tuple(
            LoadSegment(ph["p_vaddr"], ph["p_memsz"], ph["p_offset"], ph["p_filesz"], ph["p_flags"])
            for ph in elf.iter_segments()
            if ph["p_type"] == "PT_LOAD"
        )
        names = frozenset(sec.name for sec in elf.iter_sections())
        build_id = _build_id(elf)
        debuglink = _debuglink(elf)
        return ElfObject(
            path=path,
            build_id=build_id,
            elf_type=elf.header["e_type"],
            segments=segments,
            section_names=names,
            debuglink=debuglink,
        )


def _build_id(elf: ELFFile) -> str | None:
    # Notes live in PT_NOTE segments; debug files keep them only as sections.
    containers = list(elf.iter_segments()) + list(elf.iter_sections())
    for container in containers:
        if not hasattr(container, "iter_notes"):
            continue
        if container.header.get("sh_type") == SHT_NOBITS:
            continue
        try:
            for note in container.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return str(note["n_desc"])
        except Exception:  # a malformed note must not hide the rest of the file
            continue
    return None


def _debuglink(elf: ELFFile) -> tuple[str, int] | None:
    sec = elf.get_section_by_name(".gnu_debuglink")
    if sec is None or sec["sh_type"] == SHT_NOBITS:
        return None
    data = sec.data()
    stop = data.find(b"\0")
    if stop <= 0:
        return None
    name = data[:stop].decode("utf-8", "replace")
    crc_at = (stop + 4) & ~3  # the CRC follows the name, 4-byte aligned
    if crc_at + 4 > len(data):
        return None
    (crc,) = struct.unpack_from("<I" if elf.little_endian else ">I", data, crc_at)
    return name, crc


def file_identity(path: str) -> tuple[int, int] | str:
    """(device, inode) of the file at path, else the path itself: two paths to one file (symlinks, a process's
    /proc/PID/root, hard links) compare equal with one stat, where os.path.realpath lstat's every component."""
    try:
        st = os.stat(path)
    except OSError:
        return path
    return (st.st_dev, st.st_ino)


def _file_id(path: str) -> _FileId:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ElfError(f"cannot open {path}: {exc.strerror}") from exc
    return _FileId(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileCache(Generic[T]):
    """What was read from each file, known by the file (device, inode, size, mtime), not by the path it was read
    through: each process's files are opened through its own /proc/PID/root, so one library of a fleet (of a
    prefork server's workers, of fifty pods of one image) is read once, whatever path each process gives it.

    `at_path` makes what was read through one path into the value for another path to the same file (cheap: the
    value's own path changes, what was read is shared). A read that fails with one of `remembered` (a mapped file
    that is not ELF) is remembered too, while the file stays the same. `limit` bounds the files kept, the least
    recently asked for going first; holders of a value keep it as long as they need it. `max_age`: a value read that
    many seconds ago is read again (what it depends on besides the file may have changed: a debug file installed).

    A file is read by one thread at a time: a thread that asks for a file another is reading waits for that read
    (a prefork server's workers end together, and each one's profile asks for the same libraries at once)."""

    def __init__(
        self,
        read: Callable[[str], T],
        at_path: Callable[[T, str], T],
        limit: int = 512,
        remembered: tuple[type[Exception], ...] = (),
        max_age: float = math.inf,
    ) -> None:
        self._read = read
        self._at_path = at_path
        self._limit = limit
        self._remembered = remembered
        self._max_age = max_age
        # -> (read through, value, time.monotonic() of the read)
        self._files: OrderedDict[_FileId, tuple[str, T | Exception, float]] = OrderedDict()
        self._reading: dict[_FileId, threading.Event] = {}  # the files being read now: set when each read ends
        self._lock = threading.Lock()

    def get(self, path: str) -> T:
        """Raises ElfError when the file is missing, and what `read` raises."""
        fid = _file_id(path)
        while True:
            with self._lock:
                entry = self._files.get(fid)
                if entry is not None and time.monotonic() - entry[2] < self._max_age:
                    self._files.move_to_end(fid)
                    break
                entry = None
                busy = self._reading.get(fid)
                if busy is None:
                    mine = self._reading[fid] = threading.Event()
                    break
            busy.wait()  # another thread reads it: its value (or its error, if not remembered: read again)
        if entry is None:
            try:
                started = time.monotonic()
                try:
                    entry = (path, self._read(path), started)
                except self._remembered as exc:
                    entry = (path, exc, started)
                with self._lock:
                    self._files[fid] = entry
                    while len(self._files) > self._limit:
                        self._files.popitem(last=False)
            finally:  # kept (a waiter finds it) or failed (a waiter reads it again)
                with self._lock:
                    del self._reading[fid]
                mine.set()
        read_through, value, _ = entry
        if isinstance(value, Exception):
            raise type(value)(str(value).replace(read_through, path))
        return value if read_through == path else self._at_path(value, path)

    def __len__(self) -> int:
        return len(self._files)


def _same_file_at(obj: ElfObject, path: str) -> ElfObject:
    """obj for the same file at another path, sharing what was read of it (its symbol tables included)."""
    twin = copy.copy(obj)
    object.__setattr__(twin, "path", path)  # a frozen dataclass: its copy is given its own path
    return twin


_objects: FileCache[ElfObject] = FileCache(_read_header, _same_file_at, remembered=(NotElfError,))


def open_elf(path: str) -> ElfObject:
    """The ElfObject of a file, cached while the file on disk stays the same.

    Raises ElfError when the file is missing or not ELF.
    """
    return _objects.get(path)
