"""What is growing: `GET /growth` (`?pid=N` when the daemon holds several targets) and `/targets/N/growth`, the
document `heapscope growth --format=json` prints, read from the target's stored history (api.routers.history
reads the same store)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from agent.model.growth import DEFAULT_WINDOW_S
from api.deps import Manager, Pid
from api.growthmodels import GrowthOut, growth_out
from api.ports import TargetPort
from api.routers.history import HISTORY_ERRORS, TIME, TargetPid

router = APIRouter(tags=["history"])

Window = Annotated[
    float | None,
    Query(gt=0, le=366 * 86400, description=f"Seconds of history judged, back from the last stored snapshot "
          f"(or on from `since`). Default {DEFAULT_WINDOW_S:.0f}; with `since` alone, up to the last snapshot."),
]
Since = Annotated[str | None, Query(max_length=64, description=f"The start of the window: {TIME}")]
Top = Annotated[int, Query(ge=0, le=100_000, description="Sites listed, ranked (0: all). Every site is judged.")]


def stored_growth(t: TargetPort, window: float | None, since: str | None, top: int) -> GrowthOut:
    if window is None and since is None:
        window = DEFAULT_WINDOW_S
    return growth_out(t.stored_growth(since, window, top))


@router.get("/growth", summary="What is growing: sites ranked by steady growth, leak suspects first",
            responses=HISTORY_ERRORS)
def growth(manager: Manager, pid: Pid = None, window: Window = None, since: Since = None,
           top: Top = 50) -> GrowthOut:
    return stored_growth(manager.get(pid), window, since, top)


@router.get("/targets/{pid}/growth", summary="What is growing: sites ranked by steady growth, leak suspects first",
            responses=HISTORY_ERRORS)
def target_growth(pid: TargetPid, manager: Manager, window: Window = None, since: Since = None,
                  top: Top = 50) -> GrowthOut:
    return stored_growth(manager.get(pid), window, since, top)
