"""What an attach finds from a process's mapped files, reused for the next process that maps the same ones (a prefork
server's worker, a database's backend): its allocator (agent.process.discovery.allocator_of_process), with the paths
through the new process's own root, and the unsafe ranges of its safe point (agent.process.inject.unsafe_ranges).
Real processes, children of the test's own."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import agent.process.discovery as discovery
import agent.process.inject as inject
from agent.process.discovery import allocator_of_process
from agent.process.inject import unsafe_ranges
from tests.support.wait import wait_for


def _spawn(*argv: str) -> subprocess.Popen[bytes]:
    exe = shutil.which(argv[0])
    assert exe is not None, f"{argv[0]} is not installed"
    return subprocess.Popen([exe, *argv[1:]], stdin=subprocess.PIPE)


@pytest.fixture
def two_sleeps() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """Two processes of one program: the same files mapped, at addresses of their own."""
    procs = (_spawn("sleep", "600"), _spawn("sleep", "600"))
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture
def forked() -> Iterator[tuple[int, int]]:
    """A process and the child it forked (a prefork server and its worker): the same mappings at the same addresses."""
    code = "import os, time\nchild = os.fork()\nif child:\n    print(child, flush=True)\ntime.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())  # the parent prints its child's PID
    assert child > 0
    try:
        yield parent.pid, child
    finally:
        os.kill(child, 9)
        parent.kill()
        parent.wait()


@pytest.fixture(autouse=True)
def nothing_known() -> None:
    discovery._recent_allocators.clear()
    inject._recent_ranges.clear()


def _loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libc" in f.read()


def _ready(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        wait_for(functools.partial(_loaded, p.pid), 10, "the program to map its libc")


def test_a_forked_child_gets_its_parents_allocator_through_its_own_root(
    forked: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, child = forked
    found = allocator_of_process(parent)

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("the allocator was searched for again")

    monkeypatch.setattr(discovery, "load_order", no_search)
    reused = allocator_of_process(child)
    monkeypatch.undo()
    root = f"/proc/{child}/root/"
    assert reused.family == found.family == "glibc"
    assert reused.path == found.path.replace(f"/proc/{parent}/", f"/proc/{child}/")
    points = (*reused.probes, reused.loader_probe)
    assert all(p is not None and p.path.startswith(root) for p in points), points
    # The parent gone, the child's paths still open: they are its own.
    os.kill(parent, 9)
    os.waitpid(parent, 0)
    assert all(p is not None and os.path.exists(p.path) for p in points)
    discovery._recent_allocators.clear()
    assert allocator_of_process(child) == reused  # what a search of its own finds


def test_another_program_is_searched_for(
    two_sleeps: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program maps other files: no answer is taken from the first's."""
    first, _ = two_sleeps
    other = _spawn("cat")
    try:
        _ready(first, other)
        allocator_of_process(first.pid)
        searched: list[object] = []
        real = discovery.load_order

        def counted(*args: Any, **kwargs: Any) -> Any:
            searched.append(args)
            return real(*args, **kwargs)

        monkeypatch.setattr(discovery, "load_order", counted)
        found = allocator_of_process(other.pid)
        assert searched, "the other program's allocator was taken from the first's"
        assert found.path.startswith(f"/proc/{other.pid}/root/")
    finally:
        other.kill()
        other.wait()


def test_a_forked_child_gets_its_parents_unsafe_ranges(
    forked: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, child = forked
    ranges = unsafe_ranges(parent)
    assert any("malloc" in name for _, _, name in ranges.ranges), ranges.ranges[:5]

    def no_look(*args: object) -> None:
        raise AssertionError("the objects were looked at again")

    monkeypatch.setattr(inject, "_unsafe_ranges", no_look)
    assert unsafe_ranges(child).ranges == ranges.ranges


def test_the_same_program_elsewhere_in_memory_gets_ranges_of_its_own(
    two_sleeps: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]],
) -> None:
    """Two processes of one program map their code at addresses of their own (ASLR): not one's ranges for both."""
    first, second = two_sleeps
    _ready(first, second)
    a, b = unsafe_ranges(first.pid), unsafe_ranges(second.pid)
    assert a.ranges != b.ranges
    assert [name for _, _, name in a.ranges] == [name for _, _, name in b.ranges]
