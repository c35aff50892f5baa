"""callgrind_annotate as a judge: its inclusive table of an xtree file, read row by row."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# One row of callgrind_annotate's table: six event counts, each with an optional percentage that may be padded
# ("( 8.71%)"), then file:function.
_COUNT = r"([\d,]+)(?: \(\s*[\d.]+%\))?\s+"
_ANNOTATE_ROW = re.compile(r"^\s*" + _COUNT * 6 + r"(\S.*)$")


def annotate_inclusive(xtree: Path) -> dict[tuple[str, str], tuple[int, ...]]:
    """callgrind_annotate --inclusive=yes: (source base name, function) ->
    (curB, curBk, totB, totBk, totFdB, totFdBk)."""
    done = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", "--auto=no", str(xtree)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows: dict[tuple[str, str], tuple[int, ...]] = {}
    for line in done.stdout.splitlines():
        m = _ANNOTATE_ROW.match(line)
        if not m or m.group(7) == "PROGRAM TOTALS" or ":" not in m.group(7):
            continue
        where, _, fn = m.group(7).rpartition(":")
        rows[(Path(where).name, fn)] = tuple(int(m.group(i).replace(",", "")) for i in range(1, 7))
    assert rows, done.stdout
    return rows
