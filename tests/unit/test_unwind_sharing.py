"""The identity under which an object's unwind rows are shared in the kernel (agent.session.tables.rows_key):
its build id, else its rows' content, never its path. Each container reaches one image's files by paths of its own
(/proc/PID/root/...), so an object without a build id keyed by path was written to the kernel once a container."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agent.model.maps import Mapping
from agent.session.tables import UnwindTables, rows_key
from agent.symbols.unwind import UnwindTable, build_table


def table(build_id: str | None, rows: bytes) -> UnwindTable:
    return UnwindTable(build_id=build_id, rows=rows, n_rows=len(rows) // 16, source="eh_frame", build_seconds=0.0,
                       unsupported=0)


def test_a_build_id_names_the_rows_and_without_one_their_content_does() -> None:
    assert rows_key(table("ab12", b"\1" * 32)) == "ab12"
    same = rows_key(table(None, b"\1" * 32))
    assert same == rows_key(table(None, b"\1" * 32)) and same.startswith("rows:")
    assert rows_key(table(None, b"\2" * 32)) != same


@pytest.mark.needs("gcc")
def test_two_copies_of_an_object_without_a_build_id_share_their_rows(tmp_path: Path) -> None:
    source = tmp_path / "prog.c"
    source.write_text("int main(void) { return 0; }\n")
    first = tmp_path / "root-a" / "prog"
    first.parent.mkdir()
    subprocess.run(["gcc", "-O1", "-Wl,--build-id=none", "-o", str(first), str(source)], check=True)
    second = tmp_path / "root-b" / "prog"
    second.parent.mkdir()
    shutil.copy(first, second)  # another container's copy of the image's file, at a path of its own
    tables = UnwindTables(build_table)
    keys = set()
    for path in (first, second):
        [entry] = tables.entries([Mapping(0x400000, 0x401000, 0, str(path))])
        assert entry.n_rows > 0
        keys.add(entry.key)
    assert len(keys) == 1 and keys.pop().startswith("rows:")
