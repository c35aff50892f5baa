"""MALT's function addresses (agent.session.maltrec._function_addresses): where each probed allocation function sits
in the target, found by matching the probe's object with the target's mappings, their paths resolved. No root: the
exited target is a child of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.model.maps import Mapping
from agent.process.discovery import ProbePoint
from agent.session.maltrec import _function_addresses
from agent.symbols.placement import Placement
from tests.support.wait import wait_for

START, OFFSET, MALLOC_AT = 0x7F00_0000_0000, 0x1000, 0x2345  # the text mapping, and malloc's offset in the file
PROLOGUE = Placement(offset=0, emulated=True, instruction="push rbp", reason="")


def malloc_at(path: str) -> ProbePoint:
    return ProbePoint("malloc", "malloc", path, vaddr=MALLOC_AT, file_offset=MALLOC_AT, placement=PROLOGUE)


def text_of(path: str) -> Mapping:
    return Mapping(START, START + 0x10_0000, OFFSET, path)


@pytest.fixture
def exited() -> Iterator[int]:
    """A child that has exited and is not reaped yet: /proc/PID is there, its root link no longer readable (as a
    container's process is between its end and its runtime's wait)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])

    def zombie() -> bool:
        return Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

    wait_for(zombie, 30, "the child to exit")
    try:
        yield child.pid
    finally:
        child.wait()


def test_a_target_that_has_exited_keeps_its_addresses(exited: int) -> None:
    """Paths under the exited target's /proc/PID/root: realpath raises, and the paths are compared as given."""
    path = f"/proc/{exited}/root{os.path.realpath(sys.executable)}"
    with pytest.raises(FileNotFoundError):
        os.path.realpath(path)  # what made the whole profile fail
    got = _function_addresses([malloc_at(path)], [text_of(path)])
    assert got == {"malloc": START + MALLOC_AT - OFFSET}


def test_an_ended_attached_target_is_found_by_its_maps_names(exited: int) -> None:
    """An attached target's probe points are under its /proc/PID/root, its maps name the file as the kernel does
    (from the root): once it has ended, when its profile is built, the path inside the root is the maps' name. The
    addresses were empty there: MALT's leaf frames (malloc and free from one line, two stacks) went missing."""
    inside = os.path.realpath(sys.executable)
    with pytest.raises(FileNotFoundError):
        os.path.realpath(f"/proc/{exited}/root{inside}")
    other = text_of("/usr/lib/other.so")
    got = _function_addresses([malloc_at(f"/proc/{exited}/root{inside}")], [other, text_of(inside)])
    assert got == {"malloc": START + MALLOC_AT - OFFSET}


def test_a_container_file_is_found_by_the_end_of_its_name(exited: int) -> None:
    """A container's file, named in its maps by its path from the daemon's root (its root a directory here): the
    path inside the container's root ends that name. A file that only shares its base name is not it."""
    point = malloc_at(f"/proc/{exited}/root/usr/lib/x86_64-linux-gnu/libc.so.6")
    seen = text_of("/srv/containers/c1/rootfs/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert _function_addresses([point], [seen]) == {"malloc": START + MALLOC_AT - OFFSET}
    assert _function_addresses([point], [text_of("/srv/other/libc.so.6")]) == {}


def test_links_are_still_resolved(tmp_path: Path) -> None:
    """The probe's object named through a link, the mapping by the file's own path: the same object."""
    lib = tmp_path / "libc.so.6"
    lib.write_bytes(b"\x7fELF")
    link = tmp_path / "libc.so"
    link.symlink_to(lib.name)
    elsewhere = tmp_path / "other.so"
    elsewhere.write_bytes(b"\x7fELF")
    got = _function_addresses([malloc_at(str(link))], [text_of(str(elsewhere)), text_of(str(lib))])
    assert got == {"malloc": START + MALLOC_AT - OFFSET}
    assert _function_addresses([malloc_at(str(link))], [text_of(str(elsewhere))]) == {}
