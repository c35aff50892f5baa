"""The stored history (the daemon's store, agent.store), per target: a snapshot at a moment, Massif's series over a
range, and what grew between two moments. Times are those of `heapscope report` and `heapscope diff`: ISO 8601
(2026-11-23T08:00, local time unless a zone is given), a time of day (09:00), `now`, or relative (-30m, -24h).

`/snapshot?at=`, `/detailed_snapshot?at=` and `/all_snapshots?from=&to=` (api.routers.profiles) read the same
history at the top level; here are the diff, the store's state, and the same reads under /targets/N/history."""

from __future__ import annotations

import io
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import PlainTextResponse, Response

from agent.export.massif import render_snapshot, write_massif
from agent.model.target import PID_MAX
from api.deps import Format, Manager, Pid
from api.historymodels import HistoryOut, StoredDiffOut, history_out, stored_diff_out
from api.models import MassifOut, massif_out
from api.ports import TargetPort
from api.routers import ERRORS

router = APIRouter(tags=["history"])

TIME = "ISO 8601 (2026-11-23T08:00), a time of day (09:00), `now`, or relative (-30m, -24h)."
At = Annotated[str, Query(max_length=64, description=f"The moment: {TIME}")]
OptAt = Annotated[
    str | None, Query(max_length=64, description=f"Read the last snapshot stored at or before this moment: {TIME}")
]
From = Annotated[str, Query(alias="from", max_length=64, description=f"The start: {TIME}")]
To = Annotated[str, Query(alias="to", max_length=64, description=f"The end: {TIME}")]
OptFrom = Annotated[
    str | None, Query(alias="from", max_length=64, description=f"The start (default: the first): {TIME}")
]
OptTo = Annotated[str | None, Query(alias="to", max_length=64, description=f"The end (default: the last): {TIME}")]
Threshold = Annotated[
    float, Query(ge=0.0, le=100.0, description="Nodes below this percent of the growth (or shrinkage) are merged.")
]
TargetPid = Annotated[int, Path(ge=1, le=PID_MAX)]
DiffFormat = Annotated[
    str, Query(alias="format", pattern="^(json|text)$", description="json (default), or text as `heapscope diff`.")
]

HISTORY_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    404: {"model": ERRORS[404]["model"], "description": "No such target, or the store holds no snapshot there"},
    409: {"model": ERRORS[409]["model"], "description": "The daemon keeps no history for this target (--no-store)"},
}
_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def notes_header(notes: list[str]) -> dict[str, str]:
    """What the store's reader left out, as one header line (ASCII: paths are escaped)."""
    if not notes:
        return {}
    text = "; ".join(" ".join(n.splitlines()) for n in notes)
    return {"X-Heapscope-Notes": text.encode("ascii", "backslashreplace").decode()[:8000]}


def stored_snapshot(t: TargetPort, at: str, detailed: bool, fmt: str) -> Response | MassifOut:
    header = t.header()
    snap = t.stored_snapshot(at, detailed)
    if fmt == "json":
        return massif_out(header, [snap], single=True)
    text = render_snapshot(snap, desc=header.desc, cmd=header.cmd, time_unit=header.time_unit,
                           threshold=header.threshold)
    return PlainTextResponse(text)


def stored_series(t: TargetPort, start: str | None, end: str | None, fmt: str) -> Response | MassifOut:
    header = t.header()
    got = t.stored_snapshots(start, end)
    if fmt == "json":
        return massif_out(header, got.snapshots)
    buf = io.StringIO()
    write_massif(buf, got.snapshots, desc=header.desc, cmd=header.cmd, time_unit=header.time_unit,
                 threshold=header.threshold)
    return PlainTextResponse(buf.getvalue(), headers=notes_header(got.notes))


def stored_diff(t: TargetPort, start: str, end: str, threshold: float, fmt: str) -> Response | StoredDiffOut:
    d = t.stored_diff(start, end, threshold)
    if fmt == "text":
        return PlainTextResponse(d.text, headers=notes_header(d.notes))
    return stored_diff_out(d.document)


@router.get(
    "/diff",
    response_model=StoredDiffOut,
    responses={**HISTORY_ERRORS, 200: {"description": "The tree of byte deltas.", "content": _TEXT}},
    summary="What grew and what shrank between two stored moments (as `heapscope diff`)",
)
def diff(manager: Manager, start: From, end: To, pid: Pid = None, threshold: Threshold = 1.0,
         fmt: DiffFormat = "json") -> Response | StoredDiffOut:
    return stored_diff(manager.get(pid), start, end, threshold, fmt)


@router.get("/history", summary="The target's history store: what it wrote, what it holds",
            responses=HISTORY_ERRORS)
def history(manager: Manager, pid: Pid = None) -> HistoryOut:
    t = manager.get(pid)
    return history_out(t.pid, t.history_status())


@router.get("/targets/{pid}/history", summary="The target's history store: what it wrote, what it holds",
            responses=HISTORY_ERRORS)
def target_history(pid: TargetPid, manager: Manager) -> HistoryOut:
    t = manager.get(pid)
    return history_out(t.pid, t.history_status())


@router.get(
    "/targets/{pid}/history/snapshot",
    response_model=MassifOut,
    responses={**HISTORY_ERRORS, 200: {"description": "A massif.out with the stored snapshot.", "content": _TEXT}},
    summary="The last stored snapshot at or before a moment (detailed: with its heap tree)",
)
def target_snapshot(pid: TargetPid, manager: Manager, at: At, detailed: bool = False,
                    fmt: Format = "text") -> Response | MassifOut:
    return stored_snapshot(manager.get(pid), at, detailed, fmt)


@router.get(
    "/targets/{pid}/history/all_snapshots",
    response_model=MassifOut,
    responses={**HISTORY_ERRORS, 200: {"description": "A massif.out of the range.", "content": _TEXT}},
    summary="Massif's snapshots of a stored range, culled as Massif culls (`heapscope report`)",
)
def target_series(pid: TargetPid, manager: Manager, start: OptFrom = None, end: OptTo = None,
                  fmt: Format = "text") -> Response | MassifOut:
    return stored_series(manager.get(pid), start, end, fmt)


@router.get(
    "/targets/{pid}/history/diff",
    response_model=StoredDiffOut,
    responses={**HISTORY_ERRORS, 200: {"description": "The tree of byte deltas.", "content": _TEXT}},
    summary="What grew and what shrank between two stored moments (as `heapscope diff`)",
)
def target_diff(pid: TargetPid, manager: Manager, start: From, end: To, threshold: Threshold = 1.0,
                fmt: DiffFormat = "json") -> Response | StoredDiffOut:
    return stored_diff(manager.get(pid), start, end, threshold, fmt)
