from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import Manager
from api.fleetmodels import SelectorOut, selector_out
from api.routers import ERRORS

router = APIRouter(prefix="/selectors", tags=["targets"])


@router.get("", summary="The selectors: from the command line and from POST /targets", responses=ERRORS)
def list_selectors(manager: Manager) -> list[SelectorOut]:
    return [selector_out(s) for s in manager.selectors()]


@router.delete(
    "/{id}",
    summary="Stop choosing processes by this selector (the targets it chose stay profiled; one it chose and is "
    "being attached now is let go once attached)",
    responses=ERRORS,
)
def remove_selector(id: Annotated[int, Path(ge=1, le=1 << 31)], manager: Manager) -> SelectorOut:
    return selector_out(manager.remove_selector(id))
