"""Massif's monitor commands as GETs. Each text body is exactly the file the monitor command writes, so
ms_print and callgrind_annotate read it; ?format=json gives the same data as JSON.

The handlers are plain functions: FastAPI runs them in its thread pool, so a slow map read never blocks the
event loop, and the target is never stopped (the reads are syscalls made by the daemon)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, Response

from agent.export.massif import render_snapshot
from api.deps import Format, Manager, Pid
from api.models import MassifOut, XtreeOut, massif_out, xtree_out
from api.routers import ERRORS

router = APIRouter(tags=["profiles"])

_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def _responses(what: str) -> dict[int | str, dict[str, Any]]:
    return {**ERRORS, 200: {"description": what, "content": _TEXT}}


def _snapshot(manager: Manager, pid: int | None, fmt: str, detailed: bool) -> Response | MassifOut:
    target = manager.get(pid)
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
    responses=_responses("A massif.out file with one normal snapshot, taken now (monitor command `snapshot`)."),
    summary="Take a snapshot now",
)
def snapshot(manager: Manager, pid: Pid = None, fmt: Format = "text") -> Response | MassifOut:
    return _snapshot(manager, pid, fmt, detailed=False)


@router.get(
    "/detailed_snapshot",
    response_model=MassifOut,
    responses=_responses("A massif.out file with one detailed snapshot, taken now (`detailed_snapshot`)."),
    summary="Take a detailed snapshot (with the heap tree) now",
)
def detailed_snapshot(manager: Manager, pid: Pid = None, fmt: Format = "text") -> Response | MassifOut:
    return _snapshot(manager, pid, fmt, detailed=True)


@router.get(
    "/all_snapshots",
    response_model=MassifOut,
    responses=_responses("The whole massif.out so far (monitor command `all_snapshots`)."),
    summary="Every snapshot recorded so far",
)
def all_snapshots(manager: Manager, pid: Pid = None, fmt: Format = "text") -> Response | MassifOut:
    target = manager.get(pid)
    if fmt == "json":
        return massif_out(target.header(), target.snapshots())
    return PlainTextResponse(target.massif_text())


@router.get(
    "/xtmemory",
    response_model=XtreeOut,
    responses=_responses("The xtree heap memory report in callgrind format (monitor command `xtmemory`)."),
    summary="The xtree memory report",
)
def xtmemory(manager: Manager, pid: Pid = None, fmt: Format = "text") -> Response | XtreeOut:
    target = manager.get(pid)
    if fmt == "json":
        return xtree_out(target.header(), target.xtree_sites())
    return PlainTextResponse(target.xtree_text())


MaltVersion = Annotated[
    Literal["1.1", "1.6"],
    Query(description="1.1: the documented format; 1.6: what current MALT's reader (its viewer) requires."),
]


@router.get(
    "/malt",
    responses={
        **ERRORS,
        200: {
            "description": "MALT's JSON profile of the target, as --malt-out-file writes it.",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
    },
    summary="MALT's whole profile: per-stack statistics, lifetimes, timelines, memory, threads, leaks",
)
def malt(manager: Manager, pid: Pid = None, version: MaltVersion = "1.1") -> Response:
    return Response(manager.get(pid).malt_json(version), media_type="application/json")
