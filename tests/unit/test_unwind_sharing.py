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


@pytest.mark.needs("gcc")
def test_a_file_reached_by_another_path_in_a_later_session_is_not_loaded_again(tmp_path: Path) -> None:
    """A prefork server's next worker maps the same objects through /proc/ITS_PID/root/...: its session finds
    the table an earlier worker's loaded, by the file's identity; a file changed since is loaded again."""
    source = tmp_path / "prog.c"
    source.write_text("int main(void) { return 0; }\n")
    prog = tmp_path / "prog"
    subprocess.run(["gcc", "-O1", "-o", str(prog), str(source)], check=True)
    other = tmp_path / "root" / "prog"
    other.parent.mkdir()
    other.symlink_to(prog)  # one worker's path to the file, another's
    loaded: list[str] = []

    def load(path: str) -> UnwindTable:
        loaded.append(path)
        return build_table(path)

    first = UnwindTables(load).entries([Mapping(0x400000, 0x401000, 0, str(prog))])
    second = UnwindTables(load).entries([Mapping(0x500000, 0x501000, 0, str(other))])
    assert loaded == [str(prog)]
    assert [(e.key, e.n_rows) for e in first] == [(e.key, e.n_rows) for e in second] and first[0].n_rows > 0
    assert second[0].bias == first[0].bias + 0x100000  # placed by the mapping of its own process

    subprocess.run(["gcc", "-O1", "-Wl,--build-id=none", "-o", str(prog), str(source)], check=True)
    [changed] = UnwindTables(load).entries([Mapping(0x400000, 0x401000, 0, str(other))])
    assert loaded == [str(prog), str(other)] and changed.key.startswith("rows:")
