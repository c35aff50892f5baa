"""/proc/PID/maps: the one parser of its lines, for every reader (the page map, the symbolizer's recorded
mappings, the sampler's lookups of its library).

Pure: it parses text; the callers read the file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

VSYSCALL = "[vsyscall]"
ANON = "[anon]"
_DELETED = " (deleted)"


class MapsEntry(NamedTuple):
    """One line of /proc/PID/maps. `path` is the file, a kernel name ([heap], [stack], [vdso]...), or [anon].
    A tuple: a database's process maps some 250 lines, read several times an attach, and a frozen dataclass took
    twice as long to make."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str  # "major:minor", in hex
    inode: int
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_file(self) -> bool:
        return self.path.startswith("/")

    @property
    def device(self) -> tuple[int, int]:
        """(major, minor) of the file's device, as os.major and os.minor give them."""
        major, _, minor = self.dev.partition(":")
        return int(major, 16), int(minor or "0", 16)


def parse_maps_full(text: str) -> list[MapsEntry]:
    """Every well-formed line of /proc/PID/maps text, in file order. A blank path becomes `[anon]`."""
    return list(_parsed(text))


# An attach reads a process's maps several times (the allocator, the safe point, the sampler's library), mostly
# unchanged in between: the same text is parsed once. Entries are immutable; each caller gets its own list.
@functools.lru_cache(maxsize=16)
def _parsed(text: str) -> tuple[MapsEntry, ...]:
    out: list[MapsEntry] = []
    for raw in text.splitlines():
        parts = raw.split(None, 5)
        if len(parts) < 5:
            continue
        try:
            lo, hi = parts[0].split("-", 1)
            start, end = int(lo, 16), int(hi, 16)
            offset, inode = int(parts[2], 16), int(parts[4])
        except ValueError:
            continue
        if end <= start:
            continue
        path = parts[5].strip() if len(parts) == 6 else ""
        out.append(MapsEntry(start, end, parts[1], offset, parts[3], inode, path or ANON))
    return tuple(out)


def code_lines(text: str) -> str:
    """The lines of executable mappings in /proc/PID/maps text (perms after the first space: `r-xp`). Every
    address the symbolizer's recorder is asked about is code (a stack's return addresses, the unwind tables'
    ranges): a data file or anonymous memory mapped and unmapped as a process works changes its maps text but is
    neither news to it nor worth keeping. A comprehension: a regex took thrice as long."""
    return "\n".join([line for line in text.splitlines() if (i := line.find(" ")) > 0 and line[i + 3 : i + 4] == "x"])


def is_code_line(line: str) -> bool:
    """One line of code_lines' (where a predicate is asked for: code_lines keeps its test inline, for speed)."""
    return (i := line.find(" ")) > 0 and line[i + 3 : i + 4] == "x"


@dataclass(frozen=True)
class Mapping:
    """A mapping of a file, as the symbolizer looks addresses up in it."""

    start: int
    end: int
    offset: int
    path: str
    perms: str = "r-xp"
    build_id: str | None = None  # when recorded, a file on disk with another build-id is not trusted
    shown: str | None = None  # the path as the process names it, where `path` is where we open it (a container)

    @property
    def name(self) -> str:
        """The object's path as the outputs show it."""
        return self.shown or self.path

    def contains(self, address: int) -> bool:
        return self.start <= address < self.end


def parse_maps(text: str) -> list[Mapping]:
    """File-backed mappings of /proc/PID/maps text, in file order.

    Anonymous memory, [heap], [stack], [vdso] and the like are left out: they have no file to symbolize
    from. A `(deleted)` suffix is dropped from the path (the file may still be found under that name).
    """
    return list(_file_mappings(text))


@functools.lru_cache(maxsize=16)
def _file_mappings(text: str) -> tuple[Mapping, ...]:
    return tuple(
        Mapping(e.start, e.end, e.offset, e.path.removesuffix(_DELETED), e.perms) for e in _parsed(text) if e.is_file
    )
