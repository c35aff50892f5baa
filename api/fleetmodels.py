"""The API's schemas for the fleet: where a target came from (its identity, cgroup, selector) and the selectors
themselves. Converted from agent.model.fleet's plain values."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, Field

from agent.model.fleet import SelectorStatus, TargetOrigin


class PlacementOut(BaseModel):
    """What the target's cgroup path tells, with no call to Kubernetes or the container runtime ("" if nothing)."""

    cgroup: str = Field(description="The cgroup v2 path (relative to the daemon's cgroup namespace, /.. dropped).")
    unit: str = Field(description="The innermost systemd unit (.service or .scope).")
    pod: str = Field(description="The Kubernetes pod's UID.")
    container: str = Field(description="The container's ID (64 hex digits).")
    runtime: str = Field(description="containerd, cri-o, docker or podman, when the path names it.")


class OriginOut(BaseModel):
    start_time: int = Field(
        description="Clock ticks after boot at which the process started (/proc/PID/stat): with the PID, the "
        "process's identity, the same after a restart of the daemon."
    )
    placement: PlacementOut
    selector: int | None = Field(description="The selector that chose the process; none when its PID was given.")
    parent: int | None = Field(description="The profiled parent it was followed from (a fork), if any.")
    end_reason: Literal["", "exited", "exec", "detached"] = Field(
        description="Why the profile ended: the process exited, exec'ed another program, or was detached."
    )
    expires_at: datetime | None = Field(description="When an ended target leaves /targets (--keep-exited).")


def origin_out(o: TargetOrigin) -> OriginOut:
    p = o.placement
    return OriginOut(
        start_time=o.start_time,
        placement=PlacementOut(cgroup=p.path, unit=p.unit, pod=p.pod, container=p.container, runtime=p.runtime),
        selector=o.selector,
        parent=o.parent,
        end_reason=o.end_reason,
        expires_at=None if o.expires_at is None else datetime.fromtimestamp(o.expires_at, UTC),
    )


class SelectorOut(BaseModel):
    id: int
    comm: str | None = Field(description="Regular expression searched in the process name.")
    cmdline: str | None = Field(description="Regular expression searched in the command line.")
    cgroup: str | None = Field(description="cgroup path (a subtree), pattern, pod:UID or container:ID.")
    follow_children: bool = Field(description="Children a chosen process forks are profiled too.")
    origin: Literal["command line", "api"]
    matched: int = Field(description="Processes it chose since it was added.")
    targets: list[int] = Field(description="PIDs profiled now because of it.")


def selector_out(s: SelectorStatus) -> SelectorOut:
    return SelectorOut(
        id=s.id,
        comm=s.comm,
        cmdline=s.cmdline,
        cgroup=s.cgroup,
        follow_children=s.follow_children,
        origin="api" if s.origin == "api" else "command line",
        matched=s.matched,
        targets=list(s.targets),
    )
