"""What the daemon keeps of the files it reads: one entry a file (device, inode, size, mtime) while the file stays
the same, whatever path it is reached by (a fleet daemon sees thousands of processes, each read through its own
/proc/PID/root), and a bounded number of files."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agent.errors import TargetError
from agent.process import discovery
from agent.symbols import globalvars
from agent.symbols.elf import FileCache, NotElfError, open_elf


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def counting_reader(limit: int = 512) -> tuple[list[str], FileCache[str]]:
    """A cache whose values are "<text> at <path>", counting its reads."""
    reads: list[str] = []

    def read(path: str) -> str:
        reads.append(path)
        text = Path(path).read_text()
        if text.startswith("bad"):
            raise NotElfError(f"{path} is not an ELF file: bad magic")
        return f"{text} at {path}"

    return reads, FileCache(read, lambda value, path: f"{value.split(' at ')[0]} at {path}", limit,
                            remembered=(NotElfError,))  # fmt: skip


def test_a_file_is_read_once_while_it_stays_the_same_and_again_once_replaced(tmp_path: Path) -> None:
    f = tmp_path / "a"
    f.write_text("one")
    reads, cache = counting_reader()
    assert cache.get(str(f)) == f"one at {f}"
    assert cache.get(str(f)) == f"one at {f}"
    assert reads == [str(f)]
    new = tmp_path / "a.new"
    new.write_text("two!")
    new.replace(f)  # a replaced library: a new inode at the same path
    assert cache.get(str(f)) == f"two! at {f}"
    assert len(reads) == 2


def test_a_value_older_than_max_age_is_read_again(tmp_path: Path) -> None:
    """What a value depends on besides its file (the unwind table's debug file, agent.session.tables) is looked at
    again after max_age; before it, the file's value stands."""
    f = tmp_path / "a"
    f.write_text("one")
    reads: list[str] = []

    def read(path: str) -> str:
        reads.append(path)
        return Path(path).read_text()

    cache: FileCache[str] = FileCache(read, lambda value, path: value, max_age=0.2)
    assert cache.get(str(f)) == cache.get(str(f)) == "one"
    assert reads == [str(f)]
    time.sleep(0.25)
    assert cache.get(str(f)) == "one" and reads == [str(f)] * 2
    assert cache.get(str(f)) == "one" and reads == [str(f)] * 2


def test_a_limit_drops_the_file_asked_for_least_recently(tmp_path: Path) -> None:
    paths = [str(tmp_path / str(i)) for i in range(3)]
    for p in paths:
        Path(p).write_text(p)
    reads, cache = counting_reader(limit=2)
    cache.get(paths[0])
    cache.get(paths[1])
    cache.get(paths[0])  # asked again: now the newest
    cache.get(paths[2])
    assert len(cache) == 2
    cache.get(paths[0])
    assert reads == [paths[0], paths[1], paths[2]]  # 0 was kept
    cache.get(paths[1])
    assert reads == [paths[0], paths[1], paths[2], paths[1]]  # 1 had gone


def test_threads_asking_for_one_file_at_once_wait_for_one_read_and_a_failed_read_is_tried_again(
    tmp_path: Path,
) -> None:
    """A prefork server's workers end together, and each one's profile asks for the same libraries at once."""
    f = tmp_path / "libshared.so"
    f.write_text("shared")
    started, release = threading.Event(), threading.Event()
    reads: list[str] = []

    def slow_read(path: str) -> str:
        reads.append(path)
        started.set()
        release.wait(10)
        if Path(path).read_text() == "gone":
            raise OSError(f"cannot read {path}")
        return f"read {path}"

    cache: FileCache[str] = FileCache(slow_read, lambda value, path: f"read {path}")
    got: list[str] = []
    paths = [str(f), *(f"/proc/self/root{f}" for _ in range(3))]
    threads = [threading.Thread(target=lambda p=p: got.append(cache.get(p))) for p in paths]
    threads[0].start()
    assert started.wait(10)
    for t in threads[1:]:
        t.start()
    time.sleep(0.2)  # the three others are waiting, not reading
    assert reads == [str(f)]
    release.set()
    for t in threads:
        t.join(10)
    assert sorted(got) == sorted(f"read {p}" for p in paths)
    assert reads == [str(f)]

    # A read that fails with an error it does not remember leaves nothing behind: the next asker reads again.
    g = tmp_path / "libgone.so"
    g.write_text("gone")
    with pytest.raises(OSError, match="cannot read"):
        cache.get(str(g))
    g.write_text("back")
    assert cache.get(str(g)) == f"read {g}"
    assert reads == [str(f), str(g), str(g)]


def test_one_file_through_two_processes_roots_is_read_once_and_each_value_has_its_own_path(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    """Every process's files are opened through its own /proc/PID/root: a fleet of one program reads it once."""
    mine = tmp_path / "f"
    mine.write_text("x")
    reads, cache = counting_reader()
    through = f"/proc/{child.pid}/root{mine}"
    assert cache.get(through) == f"x at {through}"
    assert cache.get(str(mine)) == f"x at {mine}"
    assert reads == [through]
    assert len(cache) == 1
    other = tmp_path / "g"
    other.write_text("x")  # the same text in another file: read anew
    assert cache.get(str(other)) == f"x at {other}"
    assert reads == [through, str(other)]


def test_a_file_read_through_a_gone_process_serves_the_next_process_without_a_read(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    """A prefork server's short-lived workers: the worker whose path the file was read through ends, the next one
    finds the file all the same (before, it read the file again)."""
    mine = tmp_path / "f"
    mine.write_text("x")
    reads, cache = counting_reader()
    cache.get(f"/proc/{child.pid}/root{mine}")
    child.kill()
    child.wait()
    again = subprocess.Popen(["sleep", "60"])
    try:
        assert cache.get(f"/proc/{again.pid}/root{mine}") == f"x at /proc/{again.pid}/root{mine}"
        assert len(reads) == 1
    finally:
        again.kill()
        again.wait()


def test_a_file_that_is_not_elf_is_read_once_and_its_error_names_each_path(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    data = tmp_path / "locale-archive"
    data.write_text("bad data")
    reads, cache = counting_reader()
    with pytest.raises(NotElfError, match=f"^{data} is not an ELF file"):
        cache.get(str(data))
    through = f"/proc/{child.pid}/root{data}"
    with pytest.raises(NotElfError, match=f"^{through} is not an ELF file"):
        cache.get(through)
    assert reads == [str(data)]
    with pytest.raises(TargetError, match="is not an ELF file"):  # discovery says it as before
        discovery.elf_facts(str(data))


def test_discovery_and_malt_remember_a_data_file_as_not_elf(tmp_path: Path, child: subprocess.Popen[bytes]) -> None:
    """A process maps a dozen data files (locales, a database's shared memory): each attach and each MALT profile
    of a fleet's processes asked again for every one of them. Now each is read once, whatever path it is asked by."""
    data = tmp_path / "LC_CTYPE"
    data.write_bytes(b"not an object" * 100)
    paths = [str(data), f"/proc/{child.pid}/root{data}"]
    facts_reads, variables_reads = len(discovery._facts), len(globalvars._variables)
    for path in paths * 2:
        with pytest.raises(TargetError, match=f"^cannot read {path}: {path} is not an ELF file"):
            discovery.elf_facts(path)
    assert len(discovery._facts) == facts_reads + 1  # one entry, the error, kept with the file
    assert globalvars.global_variables({p: "LC_CTYPE" for p in paths}) == {}  # left out, as before
    assert len(globalvars._variables) == variables_reads + 1
    data.write_bytes(b"changed")  # another file now: read again
    with pytest.raises(TargetError):
        discovery.elf_facts(str(data))
    assert len(discovery._facts) == facts_reads + 2


def test_discovery_reads_a_program_once_for_every_process_of_it(child: subprocess.Popen[bytes]) -> None:
    exe = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    second = subprocess.Popen(["sleep", "60"])
    try:
        first = discovery.elf_facts(f"/proc/{child.pid}/root{exe}")
        assert discovery.elf_facts(f"/proc/{child.pid}/root{exe}") == first
        again = discovery.elf_facts(f"/proc/{second.pid}/root{exe}")
        assert again.path == f"/proc/{second.pid}/root{exe}" and first.path == f"/proc/{child.pid}/root{exe}"
        assert again.defined == first.defined and again.needed == first.needed and again.needed
        assert again.obj.dynsym is first.obj.dynsym  # the symbol table was read once
        # $ORIGIN is where each process's path to the file is
        origin = ["$ORIGIN/../lib"]
        assert replace(again, rpath=origin).search_dirs == [f"/proc/{second.pid}/root{os.path.dirname(exe)}/../lib"]
        assert replace(first, rpath=origin).search_dirs == [f"/proc/{child.pid}/root{os.path.dirname(exe)}/../lib"]
    finally:
        second.kill()
        second.wait()


def test_a_symbol_table_read_through_one_path_is_shared_with_the_paths_made_before(
    child: subprocess.Popen[bytes],
) -> None:
    """Twins made before either read its symbols share what the first of them reads."""
    exe = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    fresh = f"/proc/{child.pid}/root/.{exe}"  # a path of its own, so the file may already be cached by another
    a = open_elf(fresh)
    b = open_elf(f"/proc/{child.pid}/root{exe}")
    assert b.path != a.path
    assert b.symtab is a.symtab and b.dynsym is a.dynsym
