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
