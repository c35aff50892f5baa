"""A process caught at its exec (the fleet's exec events come that early) has only its program and the loader
mapped. Its allocator is found all the same, in the libraries the loader is about to map (agent.process.discovery).
The process is a /proc entry written here that shows a real program's files at that moment."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agent.process.discovery import allocator_of_process

PID = 4242


def fake_process_at_exec(proc: Path, exe: str) -> None:
    d = proc / str(PID)
    d.mkdir(parents=True)
    (d / "exe").symlink_to(exe)
    (d / "root").symlink_to("/")
    (d / "cmdline").write_bytes(exe.encode() + b"\0")
    (d / "environ").write_bytes(b"PATH=/usr/bin:/bin\0")
    loader = os.path.realpath("/lib64/ld-linux-x86-64.so.2")
    (d / "maps").write_text(
        f"555555554000-555555556000 r--p 00000000 08:01 1 {exe}\n"
        f"7ffff7fc3000-7ffff7fc5000 r--p 00000000 08:01 2 {loader}\n"
        "7ffff7fc5000-7ffff7fc7000 r-xp 00000000 00:00 0 [vdso]\n"
    )


@pytest.mark.skipif(not os.path.exists("/lib64/ld-linux-x86-64.so.2"), reason="needs an x86-64 glibc system")
def test_the_allocator_of_a_process_caught_at_its_exec_is_glibc(tmp_path: Path) -> None:
    exe = shutil.which("sleep")
    assert exe is not None
    fake_process_at_exec(tmp_path / "proc", os.path.realpath(exe))
    allocator = allocator_of_process(PID, str(tmp_path / "proc"))
    assert allocator.family == "glibc"
    assert os.path.basename(allocator.path) == "libc.so.6"
    assert allocator.path.startswith(f"{tmp_path}/proc/{PID}/root/")  # through the process's own root
    assert {p.symbol for p in allocator.probes} >= {"malloc", "free", "calloc", "realloc"}
