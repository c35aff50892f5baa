"""`heapscope attach` on a running program: only what happens after the attach is profiled, exactly, and the
target keeps running unharmed after heapscope detaches.

attach_target.c allocates 3 x 5000 B, says "ready" and waits on stdin. Once released it allocates at three
known sites (4 x 1111 B in site_loop, 2222 B in site_single, 3333 B in site_freed, freed at once) and frees
two of its pre-attach blocks: frees of blocks heapscope never saw, which must not make any count negative.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.massif_reader import parse_massif, paths
from tests.support.sources import source_line

pytestmark = pytest.mark.integration

TIMEOUT = 60
# The known allocations after the release, by allocating function: (bytes per call, calls, freed at once).
LOOP_BYTES = 4 * 1111
SINGLE_BYTES = 2222
FREED_BYTES = 3333
UNTRACKED_FREES = 2  # free(before[0]), free(before[1])


def label(fn: str, text: str) -> str:
    return f"{fn} (attach_target.c:{source_line('attach_target.c', text)})"


def expected_paths(with_freed: bool) -> dict[tuple[str, ...], int]:
    """The tree heapscope must hold, as bytes per root-to-node path (zero-byte paths left out)."""
    loop = label("site_loop", "after[i] = malloc(1111)")
    single = label("site_single", "after[4] = malloc(2222)")
    freed = label("site_freed", "after[5] = malloc(3333)")
    out = {
        (loop,): LOOP_BYTES,
        (loop, label("main", "site_loop();")): LOOP_BYTES,
        (single,): SINGLE_BYTES,
        (single, label("main", "site_single();")): SINGLE_BYTES,
    }
    if with_freed:
        out[(freed,)] = FREED_BYTES
        out[(freed, label("main", "site_freed();"))] = FREED_BYTES
    return out


def read_line(stream, timeout: float = TIMEOUT) -> str:  # type: ignore[no-untyped-def]
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "timed out waiting for output"
    return stream.readline().decode()


def _mapped_code(pid: int | str, ident: tuple[int, int], file_offset: int) -> int:
    """The address in process `pid` of the byte at `file_offset` of the file `ident` (st_dev, st_ino)."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or "x" not in parts[1] or not parts[5].startswith("/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            off = int(parts[2], 16)
            st = os.stat(parts[5])
            if (st.st_dev, st.st_ino) == ident and off <= file_offset < off + hi - lo:
                return lo + file_offset - off
    raise AssertionError(f"file offset {file_offset:#x} is not mapped in process {pid}")


def libc_entry(name: str) -> tuple[tuple[int, int], int]:
    """(file identity, file offset) of libc's `name`, found through this process's own libc."""
    addr = ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value
    assert addr is not None
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) >= 6:
                st = os.stat(parts[5])
                return (st.st_dev, st.st_ino), addr - lo + int(parts[2], 16)
    raise AssertionError(f"{name} is not in a mapped file")


class CodeWatch:
    """The first bytes of libc's malloc and free in the target, as the target's memory holds them. A uprobe
    is an int3 written into the process's copy of the page, so they change when heapscope's probes are in
    place and must be back to the original when it has detached."""

    SPAN = 32

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.addrs = []
        for name in ("malloc", "free"):
            ident, off = libc_entry(name)
            self.addrs.append(_mapped_code(pid, ident, off))
        self.original = self.read()

    def read(self) -> list[bytes]:
        with open(f"/proc/{self.pid}/mem", "rb") as mem:
            out = []
            for a in self.addrs:
                mem.seek(a)
                out.append(mem.read(self.SPAN))
            return out

    def probed(self) -> bool:
        return all(now != before for now, before in zip(self.read(), self.original, strict=True))

    def wait_probed(self, profiler: subprocess.Popen[bytes]) -> str:
        """Wait until the probes are in the target's code and heapscope says they are live ("probes attached":
        it arms them only after the last one is in place). Returns what heapscope printed so far."""
        deadline = time.monotonic() + TIMEOUT
        said = ""
        assert profiler.stderr is not None
        while time.monotonic() < deadline:
            if "probes attached" in said and self.probed():
                return said
            if profiler.poll() is not None:
                rest = profiler.stderr.read().decode()
                raise AssertionError(f"heapscope exited ({profiler.returncode}) before attaching:\n{said}{rest}")
            ready, _, _ = select.select([profiler.stderr], [], [], 0.02)
            if ready:
                said += profiler.stderr.readline().decode()
        raise AssertionError(f"heapscope's probes did not go live within the timeout:\n{said}")


def start_target(program: Path, *args: str) -> subprocess.Popen[bytes]:
    target = subprocess.Popen([str(program), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert target.stdout is not None
    assert read_line(target.stdout) == "ready\n"
    return target


def release(target: subprocess.Popen[bytes]) -> None:
    assert target.stdin is not None
    target.stdin.write(b"x")
    target.stdin.flush()


def start_attach(heapscope_cmd: list[str], pid: int, out: Path) -> subprocess.Popen[bytes]:
    cmd = [
        *heapscope_cmd,
        "attach",
        str(pid),
        "--mode=exact",  # exact figures, as Massif counts them (attach samples by default: test_modes.py)
        "--time-unit=B",
        "--threshold=0.0",
        "--detailed-freq=1",
        f"--massif-out-file={out}",
        f"--summary-file={summary_of(out)}",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def summary_of(out: Path) -> Path:
    return out.with_suffix(".summary.json")


def check_profile(out: Path, stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert out.exists(), f"no massif.out; stderr:\n{stderr}"
    parsed = parse_massif(out.read_text())
    peak = parsed.peak
    last = parsed.snapshots[-1]
    assert peak is not None and peak.tree is not None, "no peak snapshot"
    assert last.tree is not None, "the last snapshot has no tree"

    def nonzero(tree) -> dict[tuple[str, ...], int]:  # type: ignore[no-untyped-def]
        return {p: b for p, b in paths(tree).items() if b}

    # The pre-attach blocks are not in the profile, and freeing two of them takes nothing off the total.
    assert nonzero(peak.tree) == expected_paths(with_freed=True)
    assert peak.heap_B == LOOP_BYTES + SINGLE_BYTES + FREED_BYTES
    assert nonzero(last.tree) == expected_paths(with_freed=False)
    assert last.heap_B == LOOP_BYTES + SINGLE_BYTES


def test_attach_until_target_exits(heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path) -> None:
    program = build("attach_target.c")
    out = tmp_path / "attach.out"
    target = start_target(program)
    code = CodeWatch(target.pid)
    profiler = start_attach(heapscope_cmd, target.pid, out)
    try:
        said = code.wait_probed(profiler)
        release(target)
        target_out, _ = target.communicate(timeout=TIMEOUT)
        _, err = profiler.communicate(timeout=TIMEOUT)
    finally:
        for p in (target, profiler):
            if p.poll() is None:
                p.kill()
                p.wait()
    stderr = said + err.decode()
    assert target.returncode == 7
    assert target_out.decode() == "allocated\ndone\n"
    assert profiler.returncode == 0, stderr
    check_profile(out, stderr)
    check_untracked_report(out, stderr)


def test_detach_on_sigint_leaves_target_unharmed(
    heapscope_cmd: list[str], build: Callable[..., Path], tmp_path: Path
) -> None:
    program = build("attach_target.c")
    out = tmp_path / "attach.out"
    target = start_target(program, "hold")
    code = CodeWatch(target.pid)
    profiler = start_attach(heapscope_cmd, target.pid, out)
    try:
        said = code.wait_probed(profiler)
        release(target)
        assert target.stdout is not None
        assert read_line(target.stdout) == "allocated\n"
        profiler.send_signal(signal.SIGINT)
        _, err = profiler.communicate(timeout=TIMEOUT)
        stderr = said + err.decode()
        assert profiler.returncode == 0, stderr
        assert target.poll() is None, "the target died when heapscope detached"
        assert code.read() == code.original, "heapscope left probes in the target's malloc or free"
        # Released again, it allocates and frees 10,000 blocks with no probe left, then exits normally.
        release(target)
        target_out, _ = target.communicate(timeout=TIMEOUT)
    finally:
        for p in (target, profiler):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert target.returncode == 7
    assert target_out.decode() == "done\n"
    check_profile(out, stderr)
    check_untracked_report(out, stderr)


def check_untracked_report(out: Path, stderr: str) -> None:
    """heapscope reports frees of blocks it never saw allocated (its summary, printed by the CLI)."""
    counters = json.loads(summary_of(out).read_text())["counters"]
    assert counters["untracked_frees"] == UNTRACKED_FREES, stderr
    assert f"{UNTRACKED_FREES} frees of blocks allocated before the probes were attached" in stderr, stderr
