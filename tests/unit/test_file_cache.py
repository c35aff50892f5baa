"""What the daemon keeps of the files it reads: one entry a file while the file stays the same, and nothing of a
process that is gone (a fleet daemon sees thousands of processes, each read through its own /proc/PID/root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agent.process import discovery
from agent.symbols.elf import FileCache


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def counting_reader(limit: int | None = None) -> tuple[list[str], FileCache[str]]:
    reads: list[str] = []

    def read(path: str) -> str:
        reads.append(path)
        return Path(path).read_text()

    return reads, FileCache(read, limit)


def test_a_file_is_read_once_while_it_stays_the_same_and_again_once_replaced(tmp_path: Path) -> None:
    f = tmp_path / "a"
    f.write_text("one")
    reads, cache = counting_reader()
    assert cache.get(str(f)) == "one"
    assert cache.get(str(f)) == "one"
    assert reads == [str(f)]
    new = tmp_path / "a.new"
    new.write_text("two!")
    new.replace(f)  # a replaced library: a new inode at the same path
    assert cache.get(str(f)) == "two!"
    assert len(reads) == 2


def test_a_limit_drops_the_oldest_entry(tmp_path: Path) -> None:
    paths = [str(tmp_path / str(i)) for i in range(3)]
    for p in paths:
        Path(p).write_text(p)
    reads, cache = counting_reader(limit=2)
    for p in paths:
        cache.get(p)
    assert len(cache) == 2
    cache.get(paths[2])
    assert reads == paths  # the newest was kept
    cache.get(paths[0])
    assert reads == [*paths, paths[0]]  # the oldest had gone


def test_what_was_read_through_a_gone_process_is_forgotten(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    mine = tmp_path / "f"
    mine.write_text("x")
    through = f"/proc/{child.pid}/root{mine}"
    reads, cache = counting_reader()
    cache.get(through)
    cache.get(str(mine))
    assert len(cache) == 2
    cache.forget_gone_processes()
    assert len(cache) == 2  # the process lives: its entry stays
    child.kill()
    child.wait()
    cache.forget_gone_processes()
    assert len(cache) == 1
    assert cache.get(str(mine)) == "x"
    assert len(reads) == 2  # the live file's entry was kept


def test_discovery_keeps_no_facts_of_a_gone_process(child: subprocess.Popen[bytes]) -> None:
    exe = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    through = f"/proc/{child.pid}/root{exe}"
    first = discovery.elf_facts(through)
    assert discovery.elf_facts(through) is first
    assert first.path == through
    child.kill()
    child.wait()
    discovery.forget_gone_processes()
    again = subprocess.Popen(["sleep", "60"])
    try:
        # A new process is read anew, by its own path; the gone one's entry is not among the cache's.
        facts = discovery.elf_facts(f"/proc/{again.pid}/root{exe}")
        assert facts is not first
        assert all(not key[0].startswith(f"/proc/{child.pid}/") for key in discovery._facts._entries)
    finally:
        again.kill()
        again.wait()


def test_what_was_read_through_a_zombie_is_forgotten(tmp_path: Path, child: subprocess.Popen[bytes]) -> None:
    """A process ended but not waited for keeps its /proc/PID: its entries must go all the same."""
    mine = tmp_path / "f"
    mine.write_text("x")
    _, cache = counting_reader()
    cache.get(f"/proc/{child.pid}/root{mine}")
    os.kill(child.pid, 9)
    deadline = time.monotonic() + 10
    while _state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(child.pid) == "Z" and os.path.exists(f"/proc/{child.pid}")
    cache.forget_gone_processes()
    assert len(cache) == 0


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_one_file_through_two_processes_roots_is_read_once_and_each_entry_has_its_own_path(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    """Every process's files are opened through its own /proc/PID/root: a fleet of one program reads it once."""
    mine = tmp_path / "f"
    mine.write_text("x")
    reads: list[str] = []

    def read(path: str) -> str:
        reads.append(path)
        return f"{Path(path).read_text()} at {path}"

    cache = FileCache(read, rebind=lambda value, path: f"{value.split(' at ')[0]} at {path}")
    through = f"/proc/{child.pid}/root{mine}"
    assert cache.get(str(mine)) == f"x at {mine}"
    assert cache.get(through) == f"x at {through}"
    assert reads == [str(mine)]
    other = tmp_path / "g"
    other.write_text("x")  # the same text in another file: read anew
    assert cache.get(str(other)) == f"x at {other}"
    assert reads == [str(mine), str(other)]


def test_discovery_reads_a_program_once_for_every_process_of_it(child: subprocess.Popen[bytes]) -> None:
    exe = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    second = subprocess.Popen(["sleep", "60"])
    try:
        first = discovery.elf_facts(f"/proc/{child.pid}/root{exe}")
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
