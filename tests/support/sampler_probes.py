"""The sampler's probe functions seen from outside: their probe points for heapscope's kernel probes
(sampler_points), and a uprobe through tracefs that records their calls (sample_trace), in a private trace instance
so that other users of the machine's tracing are not disturbed."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.process.discovery import ProbePoint
from agent.process.sampler import PROBE_FUNCTIONS
from agent.symbols.elf import open_elf
from agent.symbols.placement import choose_offset

TRACEFS = Path("/sys/kernel/tracing")
_LINE = re.compile(r"\s(alloc|free): \(0x[0-9a-f]+\) ptr=0x([0-9a-f]+)(?: size=(\d+) weight=(\d+) fn=(\d+))?")


def _append(path: Path, line: str) -> None:
    """One line to a tracefs control file (Python's append mode seeks, which tracefs refuses)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@dataclass
class Samples:
    allocs: list[tuple[int, int, int]]  # (ptr, size, weight)
    frees: list[int]
    alloc_fns: list[int]  # enum hs_fn of each of allocs
    lost: int  # events the trace buffer dropped


@contextmanager
def sample_trace(library: Path) -> Iterator[callable]:  # type: ignore[valid-type]
    """Trace hs_sample_alloc(ptr, size, weight, fn) and hs_sample_free(ptr) in `library`; yields a function that
    returns the Samples recorded so far."""
    elf = open_elf(str(library))
    tag = f"hst{os.getpid()}_{secrets.token_hex(3)}"
    offsets = {}
    for name in ("hs_sample_alloc", "hs_sample_free"):
        found = elf.find_symbol(name)
        assert found is not None, f"{library} lacks {name}"
        offsets[name] = elf.vaddr_to_file_offset(found[0])
    events = [
        f"p:{tag}/alloc {library}:0x{offsets['hs_sample_alloc']:x} ptr=%di:x64 size=%si:u64 weight=%dx:u64 fn=%cx:u64",
        f"p:{tag}/free {library}:0x{offsets['hs_sample_free']:x} ptr=%di:x64",
    ]
    instance = TRACEFS / "instances" / tag
    for e in events:
        _append(TRACEFS / "uprobe_events", e)
    instance.mkdir()
    try:
        (instance / "buffer_size_kb").write_text("16384\n")
        for ev in ("alloc", "free"):
            (instance / "events" / tag / ev / "enable").write_text("1\n")

        def read() -> Samples:
            allocs, frees, fns = [], [], []
            for line in (instance / "trace").read_text().splitlines():
                m = _LINE.search(line)
                if not m:
                    continue
                if m.group(1) == "alloc":
                    allocs.append((int(m.group(2), 16), int(m.group(3)), int(m.group(4))))
                    fns.append(int(m.group(5)))
                else:
                    frees.append(int(m.group(2), 16))
            lost = 0
            for line in (instance / "per_cpu").glob("cpu*/stats"):
                for stat in line.read_text().splitlines():
                    if stat.startswith("overrun:") or stat.startswith("dropped events:"):
                        lost += int(stat.split(":")[1])
            return Samples(allocs, frees, fns, lost)

        yield read
    finally:
        for ev in ("alloc", "free"):
            enable = instance / "events" / tag / ev / "enable"
            if enable.exists():
                enable.write_text("0\n")
        instance.rmdir()
        for ev in ("alloc", "free"):
            _append(TRACEFS / "uprobe_events", f"-:{tag}/{ev}")


def sampler_points(lib: Path) -> list[ProbePoint]:
    obj = open_elf(str(lib))
    points = []
    for name, kind, regs in zip(PROBE_FUNCTIONS, ("sample_alloc", "sample_free"), (("rdi", "rsi", "rdx"), ("rdi",)),
                                strict=True):
        found = obj.find_symbol(name)
        assert found is not None
        placement = choose_offset(obj.code_bytes(found[0], 16), regs)
        assert placement.offset == 0  # the 5-byte nop itself
        points.append(ProbePoint(name, kind, str(lib), found[0], obj.vaddr_to_file_offset(found[0]), placement))
    return points
