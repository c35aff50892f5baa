"""Massif's monitor commands as GETs, and one route per output format of agent.export.registry. Each text body is
exactly the file the monitor command (or the file option) writes, so ms_print and callgrind_annotate read it;
?format=json gives the same data as JSON where the API has a model for it.

The handlers are plain functions: FastAPI runs them in its thread pool, so a slow map read never blocks the
event loop, and the target is never stopped (the reads are syscalls made by the daemon)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from agent.export.massif import render_snapshot
from agent.export.registry import FORMATS, MASSIF, XTREE, OutputFormat
from api.deps import Format, Manager, Pid
from api.models import MassifOut, XtreeOut, massif_out, xtree_out
from api.ports import TargetPort
from api.routers import ERRORS
from api.routers.history import OptAt, OptFrom, OptTo, stored_series, stored_snapshot

router = APIRouter(tags=["profiles"])

_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def _responses(what: str) -> dict[int | str, dict[str, Any]]:
    return {**ERRORS, 200: {"description": what, "content": _TEXT}}


def _snapshot(manager: Manager, pid: int | None, fmt: str, detailed: bool, at: str | None) -> Response | MassifOut:
    target = manager.get(pid)
    if at is not None:  # from the store
        return stored_snapshot(target, at, detailed, fmt)
    header = target.header()
    snap = target.snapshot(detailed)
    if fmt == "json":
        return massif_out(header, [snap], single=True)
    text = render_snapshot(
        snap, desc=header.desc, cmd=header.cmd, time_unit=header.time_unit, threshold=header.threshold
    )
    return PlainTextResponse(text)


@router.get(
    "/snapshot",
    response_model=MassifOut,
    responses=_responses("A massif.out file with one normal snapshot, taken now (monitor command `snapshot`), or "
                         "the last stored at or before ?at="),
    summary="Take a snapshot now (or read the stored one of a moment: ?at=)",
)
def snapshot(manager: Manager, pid: Pid = None, fmt: Format = "text", at: OptAt = None) -> Response | MassifOut:
    return _snapshot(manager, pid, fmt, detailed=False, at=at)


@router.get(
    "/detailed_snapshot",
    response_model=MassifOut,
    responses=_responses("A massif.out file with one detailed snapshot, taken now (`detailed_snapshot`), or the "
                         "last stored at or before ?at="),
    summary="Take a detailed snapshot (with the heap tree) now (or read the stored one of a moment: ?at=)",
)
def detailed_snapshot(manager: Manager, pid: Pid = None, fmt: Format = "text", at: OptAt = None
                      ) -> Response | MassifOut:
    return _snapshot(manager, pid, fmt, detailed=True, at=at)


# The JSON forms of the formats that have one (`?format=json`): the same data as the file.
_JSON_VIEWS: dict[str, tuple[type[BaseModel], Callable[[TargetPort], BaseModel]]] = {
    MASSIF.name: (MassifOut, lambda t: massif_out(t.header(), t.snapshots())),
    XTREE.name: (XtreeOut, lambda t: xtree_out(t.header(), t.xtree_sites())),
}


def _format_route(fmt: OutputFormat) -> Callable[..., Any]:
    """GET fmt.route: the file the format writes, rendered now (for an ended target: at its end)."""
    json_view = _JSON_VIEWS.get(fmt.name)
    if fmt.variant is not None:
        v = fmt.variant
        Choice = Annotated[Literal[v.choices], Query(alias=v.param, description=v.help)]  # type: ignore[name-defined]

        def with_variant(manager: Manager, pid: Pid = None, variant: Choice = v.default) -> Response:
            return Response(manager.get(pid).render(fmt.name, variant), media_type=fmt.media_type)

        with_variant.__annotations__["variant"] = Choice  # a local type: FastAPI cannot resolve its name
        return with_variant
    if fmt.name == MASSIF.name:
        massif_json = json_view[1] if json_view is not None else None

        def with_range(manager: Manager, pid: Pid = None, fmt_: Format = "text", start: OptFrom = None,
                       end: OptTo = None) -> Response | BaseModel:
            """The snapshots kept in memory (Massif's culled series); with ?from= or ?to=, those of the store."""
            target = manager.get(pid)
            if start is not None or end is not None:
                return stored_series(target, start, end, fmt_)
            if fmt_ == "json" and massif_json is not None:
                return massif_json(target)
            return Response(target.render(fmt.name), media_type=fmt.media_type)

        return with_range
    if json_view is not None:
        to_json = json_view[1]

        def with_json(manager: Manager, pid: Pid = None, fmt_: Format = "text") -> Response | BaseModel:
            target = manager.get(pid)
            if fmt_ == "json":
                return to_json(target)
            return Response(target.render(fmt.name), media_type=fmt.media_type)

        return with_json

    def plain(manager: Manager, pid: Pid = None) -> Response:
        return Response(manager.get(pid).render(fmt.name), media_type=fmt.media_type)

    return plain


for _fmt in FORMATS:
    _view = _JSON_VIEWS.get(_fmt.name)
    router.add_api_route(
        _fmt.route,
        _format_route(_fmt),
        methods=["GET"],
        response_model=_view[0] if _view is not None else None,
        responses={**ERRORS, 200: {"description": f"{_fmt.summary}.", "content": {_fmt.media_type: {}}}},
        summary=_fmt.summary[0].upper() + _fmt.summary[1:],
        name=_fmt.name,
    )
