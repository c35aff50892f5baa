"""A profiled target as the outputs and the API see it: its header, its status, its top sites. Plain values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agent.model.counters import Counters
from agent.model.fleet import TargetOrigin
from agent.model.pages import PageTotals
from agent.model.stack import SiteCounts, Stack

# waiting: for a safe point, tried again; refused: chosen by a selector and refused (the fleet's, with why)
TargetState = Literal["attaching", "profiling", "exited", "detached", "waiting", "refused"]
XtreeKind = Literal["allocs", "full"]

# Linux's PID_MAX_LIMIT: no PID is larger.
PID_MAX = 4_194_304


@dataclass(frozen=True)
class ProfileHeader:
    """What the files say about their profile, besides the data."""

    desc: tuple[str, ...]
    cmd: str
    pid: int
    time_unit: str
    threshold: float
    xtree_kind: XtreeKind
    mode: str = "exact"  # sampled: the figures are estimates (agent.model.sampling.ProfileMode)
    sample_rate: int = 1


@dataclass(frozen=True)
class TargetStatus:
    pid: int
    command: str  # the process name (comm): short, for metric labels
    cmdline: str
    allocator: str
    state: TargetState
    started_at: float  # Unix time the probes were attached
    ended_at: float | None  # when profiling ended (exit or detach)
    files: tuple[str, ...]  # the files written when profiling ended
    counters: Counters
    pages: PageTotals | None = None  # mapped memory (None until the page map is seeded)
    origin: TargetOrigin = field(default_factory=TargetOrigin)  # identity, cgroup, selector (agent.model.fleet)
    mode: str = "exact"  # exact, or sampled: the heap figures are estimates (agent.model.sampling)
    sample_rate: int = 1  # sampled: mean bytes between samples; 1 when every call counts
    error: str | None = None  # why profiling failed once attached (its files may be missing), else None
    sampler: str | None = None  # sampled mode: the sampler's build and how it got in ("musl build, memfd")


@dataclass(frozen=True)
class SiteTotal:
    """Live bytes and blocks of one allocation site (the innermost frame Massif keeps)."""

    site: str
    bytes: int
    blocks: int


def site_name(stack: Stack) -> str:
    """A site as a short, address-free text: `fn (file:line)`, `fn (in /obj)` or `???`."""
    if not stack:
        return "(no frame)"
    f = stack[0]
    fn = f.function or "???"
    if f.file and f.line:
        return f"{fn} ({f.file}:{f.line})"
    if f.obj:
        return f"{fn} (in {f.obj})"
    return fn


def top_sites(merged: dict[Stack, SiteCounts], n: int) -> tuple[list[SiteTotal], SiteTotal]:
    """The `n` sites with the most live bytes (stacks merged by site name), and the rest summed up."""
    by_site: dict[str, list[int]] = {}
    for stack, s in merged.items():
        if s.cur_blocks <= 0 and s.cur_bytes <= 0:
            continue
        acc = by_site.setdefault(site_name(stack), [0, 0])
        acc[0] += max(s.cur_bytes, 0)
        acc[1] += max(s.cur_blocks, 0)
    ranked = sorted(by_site.items(), key=lambda kv: (-kv[1][0], kv[0]))
    top = [SiteTotal(name, b, k) for name, (b, k) in ranked[:n]]
    rest = ranked[n:]
    other = SiteTotal("(other sites)", sum(v[0] for _, v in rest), sum(v[1] for _, v in rest))
    return top, other


@dataclass(frozen=True)
class MonitorResult:
    command: str
    pid: int | None
    file: str | None  # the file written, when the command writes one
    bytes: int
    output: str  # what the monitor command says on the terminal
