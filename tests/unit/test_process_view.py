"""A process's files through its own root (agent.process.view), on a made-up /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.model.maps import Mapping
from agent.process.view import ProcessView


def fake_proc(tmp_path: Path, root: str, their_ns: str, our_ns: str = "mnt:[4026531841]") -> str:
    proc = tmp_path / "proc"
    (proc / "7" / "ns").mkdir(parents=True)
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink(root, proc / "7" / "root")
    os.symlink(their_ns, proc / "7" / "ns" / "mnt")
    os.symlink(our_ns, proc / "self" / "ns" / "mnt")
    return str(proc)


def test_a_process_of_ours_keeps_plain_paths(tmp_path: Path) -> None:
    v = ProcessView.of(7, fake_proc(tmp_path, "/", "mnt:[4026531841]"))
    assert not v.foreign and v.file("/usr/lib/libc.so.6") == "/usr/lib/libc.so.6" and v.root_prefix() == ""
    m = Mapping(0x1000, 0x2000, 0, "/usr/lib/libc.so.6")
    assert v.mapping(m) is m


def test_a_containers_paths_are_opened_through_its_root_and_shown_as_it_names_them(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "/", "mnt:[4026532999]")  # pivot_root'ed: its root reads as "/"
    v = ProcessView.of(7, proc)
    assert v.foreign and v.file("/usr/bin/env") == f"{proc}/7/root/usr/bin/env"
    m = v.mapping(Mapping(0x1000, 0x2000, 0, "/usr/bin/env"))  # a file there (its root: ours, made up)
    assert m.path == f"{proc}/7/root/usr/bin/env" and m.name == "/usr/bin/env"


def test_a_chroots_doubled_prefix_is_taken_off(tmp_path: Path) -> None:
    """Its maps show the host's path, its root is the chroot directory: joined, the prefix would be doubled."""
    proc = fake_proc(tmp_path, "/srv/jail", "mnt:[4026532999]")
    v = ProcessView.of(7, proc)
    assert v.inside("/srv/jail/usr/bin/x") == "/usr/bin/x"
    assert v.file("/srv/jail/usr/bin/x") == f"{proc}/7/root/usr/bin/x"
    assert v.inside("/srv/jailbreak/x") == "/srv/jailbreak/x"  # a prefix of the name, not of the path
    m = v.mapping(Mapping(0x1000, 0x2000, 0, "/srv/jail/lib/libc.so.6"))
    assert m.name == "/lib/libc.so.6"


def test_a_gone_process_is_plain(tmp_path: Path) -> None:
    assert not ProcessView.of(8, fake_proc(tmp_path, "/", "mnt:[1]")).foreign


def test_a_memfd_is_opened_through_map_files(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "/", "mnt:[4026531841]")
    m = ProcessView.of(7, proc).mapping(Mapping(0x7F00, 0x8F00, 0x2000, "/memfd:libhs_sampler-1.so"))
    assert m.path == f"{proc}/7/map_files/7f00-8f00" and m.name == "/memfd:libhs_sampler-1.so"


def test_a_file_from_outside_its_root_and_namespace_is_opened_through_map_files(tmp_path: Path) -> None:
    """The sampler loaded from its folder handed over to a bare chroot in a mount namespace of its own: the maps
    name it by a path that is nothing through the process's root."""
    jail = tmp_path / "jail"
    jail.mkdir()
    proc = fake_proc(tmp_path, str(jail), "mnt:[4026532999]")
    name = "/var/cache/heapscope/libhs_sampler-bare-1.so"
    m = ProcessView.of(7, proc).mapping(Mapping(0x7F00, 0x8F00, 0, name))
    assert m.path == f"{proc}/7/map_files/7f00-8f00" and m.name == name


def test_a_containers_debug_files_are_looked_for_inside_it_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A debug file by build id under the container's /usr/lib/debug wins over the host's roots; the host's is
    the fallback (tests/unit/test_symbols.py builds real objects with separate debug files)."""
    from agent.symbols import debugfiles

    seen: list[str] = []

    class Obj:
        path = "/proc/42/root/usr/lib/x86_64-linux-gnu/libfoo.so.1"
        build_id = "abcdef0123"
        debuglink = ("libfoo.so.1.debug", 0)

    def try_open(path: str) -> None:
        seen.append(path)

    monkeypatch.setattr(debugfiles, "_try_open", try_open)
    assert debugfiles.find_debug_file(Obj(), ("/usr/lib/debug",)) is None  # type: ignore[arg-type]
    assert seen[:2] == ["/proc/42/root/usr/lib/debug/.build-id/ab/cdef0123.debug",
                        "/usr/lib/debug/.build-id/ab/cdef0123.debug"]
    assert seen[2:4] == ["/proc/42/root/usr/lib/x86_64-linux-gnu/libfoo.so.1.debug",
                         "/proc/42/root/usr/lib/x86_64-linux-gnu/.debug/libfoo.so.1.debug"]
    assert "/proc/42/root/usr/lib/debug/usr/lib/x86_64-linux-gnu/libfoo.so.1.debug" in seen


def test_a_file_mapped_before_a_chroot_of_our_namespace_is_opened_by_our_path(tmp_path: Path) -> None:
    """haproxy's workers chroot into an empty directory after mapping their program: its maps name it by our path,
    which is not under the process's root; through the root there is nothing."""
    proc = fake_proc(tmp_path, "/var/lib/haproxy", "mnt:[4026531841]")  # our namespace, chroot'ed
    v = ProcessView.of(7, proc)
    assert v.same_ns and v.through("/usr/sbin/haproxy") == "/usr/sbin/haproxy"
    assert v.through("/var/lib/haproxy/dev/log") == f"{proc}/7/root/dev/log"
