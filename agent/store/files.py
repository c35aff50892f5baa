"""The store's files: a target's directory holds its segments, named seg-NNNNNNNN.hss in the order they were
opened (docs/store-format.md). Known to the writer, which names them, and to the reader, which lists them."""

from __future__ import annotations

import os
import re
from pathlib import Path

SEGMENT_RE = re.compile(r"^seg-(\d{8})\.hss$")


def segment_paths(directory: Path) -> list[Path]:
    """The segment files of a target's directory, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [directory / n for n in sorted(n for n in names if SEGMENT_RE.match(n))]


def segment_entries(directory: Path) -> list[os.DirEntry[str]]:
    """segment_paths() as directory entries, each stat'ed at most once (DirEntry keeps its stat): the retention
    looks at every segment of a directory each time a writer opens one, and a process attached again and again
    has thousands (a Path and a stat call each cost 75 ms at 2,000 segments)."""
    try:
        with os.scandir(directory) as entries:
            found = [e for e in entries if SEGMENT_RE.match(e.name)]
    except OSError:
        return []
    found.sort(key=lambda e: e.name)  # fixed-width numbers: the names sort as the sequence does
    return found


def next_segment_seq(directory: Path) -> int:
    """The sequence number of the next segment a writer opens in directory: one past the last one there."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 1
    return max((int(m.group(1)) for n in names if (m := SEGMENT_RE.match(n))), default=0) + 1
