"""The API's JSON schemas (pydantic), separate from the profile model so that the API schema never leaks into
the core. `?format=json` gives the same data as the text bodies: the converters below apply the same Massif
thresholding and the same xtree rules as the writers in agent.export.massif and agent.export.xtree."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.errors import UsageError
from agent.export.xtree import ALLOCS_EVENTS, FULL_EVENTS
from agent.model.massif_tree import MassifNode, massif_tree
from agent.model.sampling import DEFAULT_SAMPLE_RATE, MAX_SAMPLE_RATE, ProfileMode
from agent.model.selector import MAX_PATTERN
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import SiteCounts, Stack
from agent.model.target import PID_MAX, MonitorResult, ProfileHeader, TargetStatus
from api.fleetmodels import OriginOut, origin_out

# ---- requests -------------------------------------------------------------------------------------------


class MonitorRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"command": "detailed_snapshot ds.out"}]})

    command: str = Field(
        max_length=4096,
        description="A Massif monitor command: snapshot, detailed_snapshot, all_snapshots or xtmemory, each with "
        "an optional file name (relative to the daemon's output directory), or help.",
    )


class AttachRequest(BaseModel):
    """A PID, or a selector: the processes it matches are profiled as they appear (api/fleetmodels.py)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"pid": 1234}, {"pid": 4242, "mode": "exact"}, {"comm": "^nginx$"}, {"cgroup": "/system.slice/db.service"},
        ]},
    )

    pid: int | None = Field(None, ge=1, le=PID_MAX, description="The process to profile from now on.")
    comm: str | None = Field(
        None, min_length=1, max_length=MAX_PATTERN, description="Selector: regular expression searched in the "
        "process name (/proc/PID/comm), as pgrep does."
    )
    cmdline: str | None = Field(
        None, min_length=1, max_length=MAX_PATTERN, description="Selector: regular expression searched in the "
        "command line, its arguments joined by spaces."
    )
    cgroup: str | None = Field(
        None, min_length=1, max_length=MAX_PATTERN, description="Selector: processes in this cgroup v2 path or "
        "below it (shell wildcards allowed, * crosses /), or pod:UID, or container:ID."
    )
    follow_children: bool = Field(True, description="Selector: also profile the children chosen processes fork.")
    mode: Literal["exact", "sampled"] | None = Field(
        None, description="exact: every allocation call; sampled: an in-process sampler, estimates (default: the "
        "daemon's --mode, sampled unless it was started otherwise).",
    )
    sample_rate: int | None = Field(
        None, ge=1, le=MAX_SAMPLE_RATE, description="Sampled mode: mean bytes between samples (default 524288).",
    )

    @model_validator(mode="after")
    def _pid_or_selector(self) -> AttachRequest:
        selector = self.comm is not None or self.cmdline is not None or self.cgroup is not None
        if (self.pid is None) == (not selector):
            raise ValueError("give either pid, or a selector (comm, cmdline, cgroup: all given must match)")
        if selector and (self.mode is not None or self.sample_rate is not None):
            raise ValueError("mode and sample_rate apply to a pid; a selector's processes take the daemon's --mode")
        return self


class ModeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"mode": "exact"}]})

    mode: Literal["exact", "sampled"] = Field(description="The mode to profile the target in from now on.")
    sample_rate: int | None = Field(
        None, ge=1, le=MAX_SAMPLE_RATE, description="Sampled mode: mean bytes between samples (default 524288).",
    )


def profile_mode(mode: str | None, sample_rate: int | None, default: ProfileMode | None = None) -> ProfileMode | None:
    """The mode a request asks for; None: the daemon's own. A rate alone asks for sampled mode."""
    if mode is None and sample_rate is None:
        return default
    if mode == "exact" and sample_rate is not None:
        raise UsageError("sample_rate applies to mode sampled")
    return ProfileMode("exact" if mode == "exact" else "sampled",
                       DEFAULT_SAMPLE_RATE if sample_rate is None else sample_rate)


# ---- errors ---------------------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    detail: str = Field(description="What went wrong, in one line.")
    error: str | None = Field(None, description="The kind of error.")


# ---- massif.out as JSON ---------------------------------------------------------------------------------


class TreeNode(BaseModel):
    """One node of a detailed snapshot's tree, as ms_print shows it: `n<children>: <bytes> <label>`."""

    bytes: int
    label: str
    children: list[TreeNode] = Field(default_factory=list)


class SnapshotOut(BaseModel):
    snapshot: int = Field(description="The snapshot's number in its file.")
    time: int = Field(description="In the profile's time_unit.")
    mem_heap_B: int
    mem_heap_extra_B: int
    mem_stacks_B: int
    heap_tree: Literal["empty", "detailed", "peak"]
    tree: TreeNode | None = Field(None, description="The heap tree, thresholded as in the text (detailed/peak only).")


class MassifOut(BaseModel):
    """The same data as a massif.out file."""

    desc: str
    cmd: str
    time_unit: Literal["i", "ms", "B"]
    threshold: float = Field(description="--threshold: tree nodes below this percentage are merged.")
    snapshots: list[SnapshotOut]


def _node(node: MassifNode, cap: int) -> TreeNode:
    nbytes = min(max(node.bytes, 0), cap)  # as the writer: a child never exceeds its parent
    return TreeNode(bytes=nbytes, label=node.label, children=[_node(c, nbytes) for c in node.children])


def snapshot_out(snap: Snapshot, number: int, threshold: float, kind: SnapshotKind | None = None) -> SnapshotOut:
    kind = kind or snap.kind
    extra = max(snap.heap_extra_B, 0)
    stacks = max(snap.stacks_B, 0)
    if snap.tree is None:
        return SnapshotOut(
            snapshot=number,
            time=int(snap.time),
            mem_heap_B=max(snap.heap_B, 0),
            mem_heap_extra_B=extra,
            mem_stacks_B=stacks,
            heap_tree="empty",
            tree=None,
        )
    root = massif_tree(snap.tree, threshold=threshold, extra_B=extra, stacks_B=stacks)
    return SnapshotOut(
        snapshot=number,
        time=int(snap.time),
        mem_heap_B=root.bytes,
        mem_heap_extra_B=extra,
        mem_stacks_B=stacks,
        heap_tree="peak" if kind is SnapshotKind.PEAK else "detailed",
        tree=_node(root, root.bytes),
    )


def _desc(desc: tuple[str, ...]) -> str:
    args = [" ".join(a.splitlines()) for a in desc if a.strip()]
    return " ".join(args) if args else "(none)"


def massif_out(header: ProfileHeader, snapshots: list[Snapshot], single: bool = False) -> MassifOut:
    """`single`: the file of the snapshot/detailed_snapshot monitor commands (one fresh snapshot, never a peak)."""
    kind = SnapshotKind.DETAILED if single else None
    return MassifOut(
        desc=_desc(header.desc),
        cmd=header.cmd,
        time_unit=header.time_unit,  # type: ignore[arg-type]
        threshold=header.threshold,
        snapshots=[snapshot_out(s, i, header.threshold, kind) for i, s in enumerate(snapshots)],
    )


# ---- xtree as JSON --------------------------------------------------------------------------------------


class FrameOut(BaseModel):
    address: int
    function: str | None
    file: str | None
    line: int | None
    obj: str | None
    label: str = Field(description="Massif's label: `0xADDR: fn (file:line)`.")


class XtreeStackOut(BaseModel):
    frames: list[FrameOut] = Field(description="Innermost frame (the allocation's call site) first.")
    values: dict[str, int] = Field(description="Event name -> value (curB, curBk, and with full: totB ...).")


class XtreeOut(BaseModel):
    """The same data as the xtree report (callgrind format)."""

    pid: int
    cmd: str
    kind: Literal["allocs", "full"]
    events: list[str]
    stacks: list[XtreeStackOut]
    totals: dict[str, int]


_EVENT_FIELDS = {
    "curB": "cur_bytes",
    "curBk": "cur_blocks",
    "totB": "tot_bytes",
    "totBk": "tot_blocks",
    "totFdB": "freed_bytes",
    "totFdBk": "freed_blocks",
}


def xtree_out(header: ProfileHeader, sites: Mapping[Stack, SiteCounts]) -> XtreeOut:
    events = [name for name, _ in (ALLOCS_EVENTS if header.xtree_kind == "allocs" else FULL_EVENTS)]
    totals = dict.fromkeys(events, 0)
    stacks = []
    for stack, counts in sites.items():
        values = {e: max(getattr(counts, _EVENT_FIELDS[e]), 0) for e in events}
        if not stack or not any(values.values()):  # left out of the report, as the writer does
            continue
        for e in events:
            totals[e] += values[e]
        frames = [FrameOut(address=f.address, function=f.function, file=f.file, line=f.line, obj=f.obj,
                           label=f.label) for f in stack]
        stacks.append(XtreeStackOut(frames=frames, values=values))
    return XtreeOut(pid=header.pid, cmd=header.cmd, kind=header.xtree_kind, events=events, stacks=stacks,
                    totals=totals)


# ---- targets and monitor --------------------------------------------------------------------------------


class HeapCounters(BaseModel):
    useful_bytes: int
    extra_bytes: int
    live_blocks: int
    peak_useful_bytes: int
    peak_extra_bytes: int
    allocated_bytes: int
    freed_bytes: int
    allocation_calls: int
    free_calls: int
    untracked_frees: int
    dropped: int = Field(description="Events not counted because a kernel table was full.")


class PagesOut(BaseModel):
    mapped_bytes: int = Field(description="Bytes mapped now (mmap, mremap, brk, and what existed at the start).")
    peak_mapped_bytes: int
    page_syscalls: int = Field(description="mmap, munmap, mremap and brk calls applied.")
    dropped: int = Field(description="Page syscalls the kernel could not report.")
    stacks_bytes: int = Field(description="All threads' stacks at the last sample (--stacks=yes; else 0).")
    brk_folded: int = Field(
        0,
        description="Sampled mode: brk calls the kernel folded into the mapped total's last and highest values "
        "between two samples, instead of sending each (not in page_syscalls).",
    )
    unsampled: int = Field(
        0,
        description="Sampled mode: mmap, munmap and mremap calls not sampled, folded as brk is (not in page_syscalls).",
    )
    page_calls_traced: bool = Field(
        True,
        description="Whether the page calls are traced: exact mode, and sampled mode with --page-calls=yes. Without "
        "them the mapped total is read from /proc/PID/statm at each look and its peak is the highest a look saw.",
    )


class TargetOut(BaseModel):
    pid: int
    command: str = Field(description="The process name.")
    cmdline: str
    allocator: str
    mode: Literal["exact", "sampled"] = Field(description="exact: every call counted; sampled: estimates.")
    sample_rate: int = Field(description="Mean bytes between samples; 1 in exact mode (every call counted).")
    estimate: bool = Field(description="True when the heap figures are estimates (sampled mode); the call "
                           "counts are exact in both modes.")
    state: Literal["attaching", "profiling", "exited", "detached", "waiting", "refused"] = Field(
        description="attaching: being attached now (a DELETE waits for the attach, then detaches it). waiting: "
        "sampled mode found no thread at a safe point yet (error says where each was); it is tried again. "
        "refused: a selector chose it and it cannot be profiled (error says why: a static program in sampled "
        "mode, no allocator found, ...); not tried again while it runs."
    )
    exited: bool
    started_at: datetime
    ended_at: datetime | None
    files: list[str] = Field(description="Files written when profiling ended.")
    heap: HeapCounters
    pages: PagesOut | None = Field(description="Memory as the page syscalls left it: what malloc does not explain.")
    origin: OriginOut = Field(description="The process's identity, cgroup, and why it is profiled.")
    error: str | None = Field(None, description="Why profiling failed once attached (its files may then be "
                              "missing); null when it did not.")
    sampler: str | None = Field(None, description="Sampled mode: the sampler's build (for the target's libc: glibc "
                                "or musl) and how it got in (dlopen by path; memfd, where the target cannot see "
                                "the library, as in a container; inherited from its parent); null in exact mode.")


def _time(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, UTC)


def target_out(s: TargetStatus) -> TargetOut:
    c = s.counters
    return TargetOut(
        pid=s.pid,
        command=s.command,
        cmdline=s.cmdline,
        allocator=s.allocator,
        mode="sampled" if s.mode == "sampled" else "exact",
        sample_rate=s.sample_rate,
        estimate=s.mode == "sampled",
        state=s.state,
        exited=s.state == "exited",
        error=s.error,
        sampler=s.sampler,
        started_at=_time(s.started_at),  # type: ignore[arg-type]
        ended_at=_time(s.ended_at),
        files=list(s.files),
        heap=HeapCounters(
            useful_bytes=c.heap,
            extra_bytes=c.extra,
            live_blocks=c.blocks,
            peak_useful_bytes=c.peak_heap,
            peak_extra_bytes=c.peak_extra,
            allocated_bytes=c.alloc_bytes,
            freed_bytes=c.freed_bytes,
            allocation_calls=c.n_allocs,
            free_calls=c.n_frees,
            untracked_frees=c.untracked_frees,
            dropped=c.dropped,
        ),
        pages=None
        if s.pages is None
        else PagesOut(
            mapped_bytes=s.pages.mapped,
            peak_mapped_bytes=s.pages.peak_mapped,
            page_syscalls=s.pages.syscalls,
            dropped=s.pages.dropped,
            stacks_bytes=s.pages.stacks,
            brk_folded=s.pages.brk_folded,
            unsampled=s.pages.unsampled,
            page_calls_traced=s.pages.traced,
        ),
        origin=origin_out(s.origin),
    )


class MonitorOut(BaseModel):
    command: str
    pid: int | None = Field(description="The target the command ran on (none for help).")
    file: str | None = Field(description="The file written, under the daemon's output directory.")
    bytes: int = Field(description="Bytes written to the file.")
    output: str = Field(description="What the monitor command prints.")


def monitor_out(r: MonitorResult) -> MonitorOut:
    return MonitorOut(command=r.command, pid=r.pid, file=r.file, bytes=r.bytes, output=r.output)


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    targets: int
