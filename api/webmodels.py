"""The web page's JSON (pydantic), mirroring agent.export.webdata's dataclasses field for field: the API and
`heapscope view` serve the same data (tests/unit/test_webdata.py checks that the two agree)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.export.webdata import Diff, SnapshotTree, Timeline


class _FromData(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class TimelinePointOut(_FromData):
    id: str = Field(description="The snapshot's id, for /tree and /diff (TIME.N).")
    index: int = Field(description="The snapshot's number in the profile (massif.out's snapshot=N).")
    time: int = Field(description="In the profile's time unit.")
    kind: Literal["normal", "detailed", "peak"]
    heap: int = Field(description="Useful heap bytes.")
    extra: int = Field(description="Massif's extra bytes (allocator admin and slop).")
    stacks: int
    mapped: int | None = Field(description="Bytes mapped at that time (page syscalls), when sampled.")
    rss: int | None = Field(description="Resident set size at that time, when sampled.")
    sites: list[int] | None = Field(
        description="Bytes of each of the timeline's sites (the last: the other sites); snapshots with a tree only."
    )


class TimelineOut(_FromData):
    pid: int
    command: str
    state: str
    time_unit: Literal["i", "ms", "B"]
    mode: Literal["exact", "sampled"]
    estimate: bool = Field(description="True for sampled profiles: the bytes are estimates.")
    sites: list[str] = Field(description="The top sites by their largest bytes, then `(other sites)`.")
    points: list[TimelinePointOut] = Field(description="One per snapshot kept, in time order.")
    peak_index: int | None
    n_sites: int = Field(description="Distinct allocation sites in the snapshots' trees.")


class FlameNodeOut(_FromData):
    name: str = Field(description="The function, or the root's or an aggregate's label.")
    file: str | None
    line: int | None
    obj: str | None
    address: int | None
    bytes: int
    kind: Literal["root", "frame", "other", "below_threshold"] = Field(
        description="other: smaller siblings summed here by the server; below_threshold: Massif's own aggregate."
    )
    children: list[FlameNodeOut]


class SnapshotTreeOut(_FromData):
    id: str
    index: int
    time: int
    kind: Literal["normal", "detailed", "peak"]
    heap: int
    extra: int
    stacks: int
    estimate: bool
    root: FlameNodeOut = Field(description="Allocation sites at the first level, then their callers outwards.")
    n_nodes: int = Field(description="Nodes in this answer.")
    n_merged: int = Field(
        description="Tree nodes left out: summed into `(N smaller call sites)` nodes, or into their parent."
    )


class ChangeOut(_FromData):
    name: str
    path: list[str] = Field(description="The site, then its callers outwards.")
    before: int
    after: int
    delta: int


class SnapshotRefOut(_FromData):
    id: str
    index: int
    time: int
    kind: Literal["normal", "detailed", "peak"]
    heap: int


class DiffOut(_FromData):
    a: SnapshotRefOut
    b: SnapshotRefOut
    estimate: bool
    grew: int = Field(description="Bytes added by the sites that grew.")
    shrank: int = Field(description="Bytes released by the sites that shrank.")
    sites_grew: list[ChangeOut]
    sites_shrank: list[ChangeOut]
    stacks_grew: list[ChangeOut]
    stacks_shrank: list[ChangeOut]
    n_sites_changed: int
    n_stacks_changed: int


def timeline_out(t: Timeline, *, pid: int, command: str, state: str) -> TimelineOut:
    return TimelineOut.model_validate(
        {**{f: getattr(t, f) for f in t.__dataclass_fields__}, "pid": pid, "command": command, "state": state}
    )


def tree_out(t: SnapshotTree) -> SnapshotTreeOut:
    return SnapshotTreeOut.model_validate(t)


def diff_out(d: Diff) -> DiffOut:
    return DiffOut.model_validate(d)
