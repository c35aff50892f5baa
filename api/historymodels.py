"""JSON schemas of the stored history's endpoints (api.routers.history): the store's state and the diff between
two stored moments, in the shape `heapscope diff --json` prints."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from agent.model.stored import StoreStatus


def _iso(ns: int | None) -> str | None:
    return None if ns is None else datetime.fromtimestamp(ns / 1e9).astimezone().isoformat(timespec="seconds")


class HistoryOut(BaseModel):
    """A target's history store: what its writer did this run, and what its directory holds (every run)."""

    pid: int
    enabled: bool = Field(description="False when the daemon keeps no store (--no-store).")
    directory: str | None
    snapshots_written: int = Field(description="Samples stored by this profile.")
    quiet_skipped: int = Field(0, description="Looks at the target not stored because nothing had moved since "
                               "the last stored sample: its state holds until the next (--store-quiet-interval).")
    bytes_written: int
    write_errors: int = Field(description="Samples the disk refused (a full disk...): the profile went on.")
    last_error: str | None
    snapshots_held: int = Field(description="Snapshots the directory holds, all runs of the process.")
    first: str | None = Field(description="The oldest snapshot held, ISO 8601.")
    last: str | None = Field(description="The newest snapshot held, ISO 8601.")
    first_wall_ns: int | None
    last_wall_ns: int | None


def history_out(pid: int, s: StoreStatus) -> HistoryOut:
    return HistoryOut(
        pid=pid, enabled=s.enabled, directory=s.directory, snapshots_written=s.snapshots_written,
        quiet_skipped=s.quiet_skipped, bytes_written=s.bytes_written, write_errors=s.write_errors,
        last_error=s.last_error,
        snapshots_held=s.snapshots_held, first=_iso(s.first_wall_ns), last=_iso(s.last_wall_ns),
        first_wall_ns=s.first_wall_ns, last_wall_ns=s.last_wall_ns,
    )


class DeltaNodeOut(BaseModel):
    """A node of a tree of byte deltas: a frame (the allocation site first, then its callers) and the change of
    the live bytes of all the stacks through it. Nodes below the threshold are one `in N places` node."""

    label: str
    bytes: int
    blocks: int = Field(description="Change of live blocks.")
    children: list[DeltaNodeOut] = Field(default_factory=list)


class MomentOut(BaseModel):
    wall_time: str = Field(description="When the stored snapshot was taken, ISO 8601.")
    time: int = Field(description="In the profile's time unit.")
    heap_B: int
    heap_extra_B: int
    stacks_B: int
    mapped_B: int | None
    rss_B: int | None


class StoredDiffOut(BaseModel):
    """What grew and what shrank between the last stored snapshots at or before two moments: the JSON of
    `heapscope diff --json`."""

    model_config = ConfigDict(populate_by_name=True)

    from_: MomentOut = Field(alias="from")
    to: MomentOut
    heap_delta_B: int
    new_sites: int = Field(description="Stacks with live bytes after and none before.")
    gone_sites: int
    grew: DeltaNodeOut
    shrank: DeltaNodeOut
    notes: list[str] = Field(default_factory=list, description="What the reader skipped (damaged data).")


def stored_diff_out(document: Mapping[str, object]) -> StoredDiffOut:
    return StoredDiffOut.model_validate(document)
