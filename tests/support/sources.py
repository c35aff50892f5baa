"""The test programs' sources, read so that the labels a test expects follow the source as it is edited."""

from __future__ import annotations

from pathlib import Path

PROGRAMS = Path(__file__).resolve().parents[1] / "integration" / "programs"


def source_line(source: str, text: str) -> int:
    """The number of the first line of programs/`source` that holds `text`."""
    for n, line in enumerate((PROGRAMS / source).read_text().splitlines(), 1):
        if text in line:
            return n
    raise AssertionError(f"{text!r} not in {source}")
