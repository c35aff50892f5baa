"""callgrind_annotate as a judge: its inclusive table of an xtree file, read row by row."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# One row of callgrind_annotate's table: the event counts (six with --xtree-memory=full, two with allocs), each
# with an optional percentage that may be padded ("( 8.71%)"), then file:function.
_COUNT = r"[\d,]+(?: \(\s*[\d.]+%\))?\s+"
_ANNOTATE_ROW = re.compile(r"^\s*((?:" + _COUNT + r")+)(\S.*)$")
_NUMBER = re.compile(r"([\d,]+)(?: \(\s*[\d.]+%\))?")


def annotate_inclusive(xtree: Path) -> dict[tuple[str, str], tuple[int, ...]]:
    """callgrind_annotate --inclusive=yes: (source base name, function) ->
    (curB, curBk, totB, totBk, totFdB, totFdBk); (curB, curBk) for an --xtree-memory=allocs report."""
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
        if not m or m.group(2) == "PROGRAM TOTALS" or ":" not in m.group(2):
            continue
        where, _, fn = m.group(2).rpartition(":")
        rows[(Path(where).name, fn)] = tuple(int(n.replace(",", "")) for n in _NUMBER.findall(m.group(1)))
    assert rows, done.stdout
    return rows
