"""Whether sampled mode's sampler is armed in a process, read from the sampler's own control block in its memory
(agent.process.sampler), not from what heapscope says about it. Used by tests/integration/test_service_panel.py and
bench/service_panel.py."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agent.errors import TargetError
from agent.process.sampler import (
    PROBE_FUNCTIONS,
    SamplerControl,
    cache_dir,
    mapped_base,
    read_map_lines,
    symbol_value,
)
from agent.symbols.elf import open_elf

# The builds in heapscope's cache (agent.process.sampler.build_sampler): one per source and libc.
T = TypeVar("T")

LIBRARY = re.compile(r"libhs_sampler(-musl|-bare)?-[0-9a-f]+\.so")


def loaded_sampler(pid: int) -> Path | None:
    """The sampler library the process has mapped, whichever build it is (the source may have changed since it
    was loaded), also when it was handed over in a memfd; None if none is."""
    for m in read_map_lines(pid):
        path = m.path.removesuffix(" (deleted)")
        name = os.path.basename(path).removeprefix("memfd:")  # a memfd's: /memfd:NAME (deleted)
        if m.offset == 0 and LIBRARY.fullmatch(name):
            return Path(path) if path.startswith("/") and os.path.exists(path) else cache_dir() / name
    return None


def sampler(pid: int) -> tuple[str, str]:
    """The sampler's state in the process and why it was last disarmed: ("armed", ...), ("idle", "controller
    gone"), ("broken", ...); ("not loaded", ""); ("gone", "") for a process that exited."""
    try:
        library = loaded_sampler(pid)
        if library is None:
            return "not loaded", ""
        control = SamplerControl(pid, library)
    except TargetError:
        return "gone", ""
    try:
        st = control.read()
        return st.state, st.disarm_reason
    except (TargetError, OSError):
        return "gone", ""
    finally:
        control.close()


def sampler_state(pid: int) -> str:
    return sampler(pid)[0]


def _read_sampler(pid: int, read: Callable[[SamplerControl], T]) -> T | None:
    """read(control) of the process's sampler; None when none is loaded or the process is gone."""
    try:
        library = loaded_sampler(pid)
        if library is None:
            return None
        control = SamplerControl(pid, library)
    except TargetError:
        return None
    try:
        return read(control)
    except (TargetError, OSError):
        return None
    finally:
        control.close()


def allocated_bytes(pid: int) -> int:
    """The bytes the process's sampler has counted allocated since it was armed (every call, exactly); 0 without one."""
    return _read_sampler(pid, lambda control: control.counts()["alloc_bytes"]) or 0


def threadless_armed(pid: int) -> bool:
    """The process's sampler is armed with no control thread of its own (agent.process.sampler: threadless), so
    that only its next sample sees heapscope's end."""
    st = _read_sampler(pid, SamplerControl.read)
    return st is not None and st.state == "armed" and st.threadless


def sampler_fields(pid: int) -> dict[str, int]:
    """The process's sampler's control block, field by field ({} without one)."""
    st = _read_sampler(pid, SamplerControl.read)
    return st.fields if st is not None else {}


def probe_code(pid: int | None, library: Path) -> dict[str, bytes]:
    """The first 5 bytes of each of the sampler's probe functions, as process `pid` has them in its memory (the
    kernel's uprobes write there), or as the library's file has them (`pid` None)."""
    if pid is None:
        elf = open_elf(str(library))
        return {name: elf.code_bytes(symbol_value(library, name), 5) for name in PROBE_FUNCTIONS}
    base = mapped_base(pid, library)
    assert base is not None, f"the sampler is not loaded in {pid}"
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        return {name: os.pread(mem.fileno(), 5, base + symbol_value(library, name)) for name in PROBE_FUNCTIONS}
