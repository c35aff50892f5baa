"""What a session's pprof profile needs besides its sites (agent.export.pprof.PprofContext): the recorded
mappings, the build ids of the objects they map (read from the files on disk), and the profile's times."""

from __future__ import annotations

import time
from collections.abc import Iterable

from agent.export.pprof import PprofContext
from agent.model.maps import Mapping
from agent.model.sampling import ProfileMode
from agent.session.session import Session
from agent.symbols.elf import ElfError, open_elf


def build_ids(mappings: Iterable[Mapping]) -> dict[str, str]:
    """GNU build id per object path, for the executable mappings whose file is still readable (open_elf caches
    them per file). A file that is gone or not ELF has none: its mapping is written without one."""
    ids: dict[str, str] = {}
    for m in mappings:
        if "x" not in m.perms or m.path in ids:
            continue
        try:
            build_id = open_elf(m.path).build_id
        except ElfError:
            continue
        if build_id:
            ids[m.path] = build_id
    return ids


def pprof_context(
    session: Session, started_at: float, ended_at: float | None, mode: ProfileMode | None = None
) -> PprofContext:
    """The context of the state now (its end, once ended): `time_ns` is that moment, `duration_ns` the time
    since profiling started (Unix times in seconds). Exact mode counts every allocation: period 1. Sampled
    mode's counters already hold each sample's weight: period the rate, nothing scaled again."""
    mappings = session.maps.mappings
    at_ns = int(ended_at * 1e9) if ended_at is not None else time.time_ns()
    mode = mode or ProfileMode()
    comments = [f"heapscope heap profile of pid {session.info.pid}: {session.info.cmd}"]
    if mode.sampled:
        comments.append(f"sampled mode, one sample per {mode.rate} bytes on average: the values are estimates")
    return PprofContext(
        sample_rate=mode.period,
        prescaled=mode.sampled,
        mappings=mappings,
        build_ids=build_ids(mappings),
        time_ns=at_ns,
        duration_ns=max(0, at_ns - int(started_at * 1e9)),
        comments=tuple(comments),
    )
