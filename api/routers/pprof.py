"""The pprof profile (agent.export.registry's PPROF, served at /pprof by the profiles router) also at Go's
conventional paths, so that scrapers set up for Go services collect it unchanged: `/debug/pprof/heap` (inuse_space
shown first, as Go's) and `/debug/pprof/allocs` (alloc_space first: the path Grafana Alloy's and Parca's memory
scrapes ask for by default). Each takes `?pid=N`, or none when one target is served; `/targets/N/debug/pprof/...`
names the target in the path instead, for scrapers that give each target a path prefix (Alloy's
`__profile_path_prefix__`, Parca's `path_prefix`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response

from agent.errors import UsageError
from agent.export.registry import PPROF
from agent.model.target import PID_MAX
from api.deps import Manager, Pid
from api.routers import ERRORS

router = APIRouter(tags=["pprof"])

_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {
        "description": "A gzipped pprof profile.proto: alloc_objects, alloc_space, inuse_objects, inuse_space.",
        "content": {PPROF.media_type: {"schema": {"type": "string", "format": "binary"}}},
    },
}

Debug = Annotated[int, Query(description="Go's text forms (debug=1, 2) are not served: only 0, the protobuf.")]
Seconds = Annotated[
    int | None, Query(description="Go's delta profiles are not served: take two profiles and compare them.")
]
Gc = Annotated[int, Query(description="Accepted for Go's clients; a C heap has no collector to run.")]
TargetPid = Annotated[int, Path(ge=1, le=PID_MAX)]


def _profile(manager: Manager, pid: int | None, sample_type: str, debug: int, seconds: int | None) -> Response:
    if debug != 0:
        raise UsageError(f"debug={debug}: only the protobuf form (debug=0) is served")
    if seconds is not None:
        raise UsageError("delta profiles (?seconds=) are not served: take two profiles and use -diff_base")
    return Response(manager.get(pid).render(PPROF.name, sample_type), media_type=PPROF.media_type)


@router.get(
    "/debug/pprof/heap", responses=_RESPONSES, response_class=Response, summary="Go's heap profile path (inuse_space)"
)
def go_heap(manager: Manager, pid: Pid = None, debug: Debug = 0, seconds: Seconds = None, gc: Gc = 0) -> Response:
    return _profile(manager, pid, "inuse_space", debug, seconds)


@router.get(
    "/debug/pprof/allocs",
    responses=_RESPONSES,
    response_class=Response,
    summary="Go's allocations profile path (the same profile, alloc_space shown first)",
)
def go_allocs(manager: Manager, pid: Pid = None, debug: Debug = 0, seconds: Seconds = None, gc: Gc = 0) -> Response:
    return _profile(manager, pid, "alloc_space", debug, seconds)


@router.get(
    "/targets/{pid}/debug/pprof/heap",
    responses=_RESPONSES,
    response_class=Response,
    summary="Go's heap profile path, per target",
)
def target_heap(manager: Manager, pid: TargetPid, debug: Debug = 0, seconds: Seconds = None, gc: Gc = 0) -> Response:
    return _profile(manager, pid, "inuse_space", debug, seconds)


@router.get(
    "/targets/{pid}/debug/pprof/allocs",
    responses=_RESPONSES,
    response_class=Response,
    summary="Go's allocations profile path, per target",
)
def target_allocs(manager: Manager, pid: TargetPid, debug: Debug = 0, seconds: Seconds = None, gc: Gc = 0) -> Response:
    return _profile(manager, pid, "alloc_space", debug, seconds)
