"""The web page (`GET /`) and the data it draws: per target, the timeline, a snapshot's tree and the diff of
two snapshots. The page itself is agent.export.webpage's, the same one `heapscope view` writes to a file."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse

from agent.export.webdata import Mode, SiteCache, build_timeline, diff_snapshots, memory_lookup, snapshot_tree
from agent.export.webpage import render_page
from agent.model.target import PID_MAX
from api.deps import Manager
from api.ports import TargetPort
from api.routers import ERRORS
from api.webmodels import DiffOut, SnapshotTreeOut, TimelineOut, diff_out, timeline_out, tree_out

router = APIRouter(tags=["web page"])
# The page holds no data (it is the same for everyone), so it needs no token: it asks for the token itself
# (in the address's #token=... fragment, which the browser never sends) and sends it with its data requests.
page_router = APIRouter(tags=["web page"])

TargetPid = Annotated[int, Path(ge=1, le=PID_MAX)]
SnapshotId = Annotated[str, Path(max_length=64, description="A point's id from the timeline (TIME.N).")]


def _mode(t: TargetPort) -> Mode:
    return "sampled" if t.mode == "sampled" else "exact"


def _cache(request: Request) -> SiteCache:
    return request.app.state.site_cache  # type: ignore[no-any-return]


@page_router.get("/", response_class=HTMLResponse, summary="The web page: targets, timelines, trees and diffs")
def page() -> HTMLResponse:
    # Everything the page needs is in this one response (no other file, nothing from outside).
    return HTMLResponse(render_page(None), headers={"Cache-Control": "no-cache"})


@router.get(
    "/targets/{pid}/timeline",
    summary="One point per kept snapshot: heap, extra, mapped, RSS, and the bytes of the top sites",
    responses=ERRORS,
)
def timeline(
    pid: TargetPid,
    manager: Manager,
    request: Request,
    top: Annotated[int, Query(ge=1, le=50, description="Sites stacked; the others are summed.")] = 12,
) -> TimelineOut:
    t = manager.get(pid)
    line = build_timeline(
        t.snapshots(), time_unit=t.header().time_unit, mode=_mode(t), memory=memory_lookup(t.memory_line()),
        top=top, cache=_cache(request),
    )
    return timeline_out(line, pid=t.pid, command=t.command, state=t.state)


@router.get(
    "/targets/{pid}/snapshots/{sid}/tree",
    summary="A kept snapshot's tree for a flame graph: the biggest nodes, the smaller siblings summed",
    responses=ERRORS,
)
def tree(
    pid: TargetPid,
    sid: SnapshotId,
    manager: Manager,
    nodes: Annotated[int, Query(ge=10, le=20_000, description="Most nodes in the answer.")] = 1000,
) -> SnapshotTreeOut:
    t = manager.get(pid)
    return tree_out(snapshot_tree(t.snapshots(), sid, mode=_mode(t), max_nodes=nodes))


@router.get(
    "/targets/{pid}/diff",
    summary="What grew and what shrank between two kept snapshots, by site and by stack",
    responses=ERRORS,
)
def diff(
    pid: TargetPid,
    manager: Manager,
    request: Request,
    a: Annotated[str, Query(max_length=64, description="The earlier snapshot's id.")],
    b: Annotated[str, Query(max_length=64, description="The later snapshot's id.")],
) -> DiffOut:
    t = manager.get(pid)
    return diff_out(diff_snapshots(t.snapshots(), a, b, mode=_mode(t), cache=_cache(request)))
