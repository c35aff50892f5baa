from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from agent.model.target import PID_MAX
from api.deps import Manager
from api.models import AttachRequest, ModeRequest, TargetOut, profile_mode, target_out
from api.routers import ERRORS

router = APIRouter(prefix="/targets", tags=["targets"])


@router.get("", summary="The targets: profiled now, or exited (their last state stays queryable)", responses=ERRORS)
def list_targets(manager: Manager) -> list[TargetOut]:
    return [target_out(t.status()) for t in manager.targets()]


@router.post("", status_code=201, summary="Attach to a running process", responses=ERRORS)
def attach(body: AttachRequest, manager: Manager) -> TargetOut:
    return target_out(manager.attach(body.pid, profile_mode(body.mode, body.sample_rate)).status())


@router.post(
    "/{pid}/mode",
    summary="Profile the target in another mode from now on (its history continues; figures restart from 0)",
    responses=ERRORS,
)
def switch_mode(pid: Annotated[int, Path(ge=1, le=PID_MAX)], body: ModeRequest, manager: Manager) -> TargetOut:
    mode = profile_mode(body.mode, body.sample_rate)
    assert mode is not None  # the body names a mode
    return target_out(manager.switch_mode(pid, mode).status())


@router.delete(
    "/{pid}",
    summary="Detach (the process runs on unharmed), write its files, and forget it",
    responses=ERRORS,
)
def detach(pid: Annotated[int, Path(ge=1, le=PID_MAX)], manager: Manager) -> TargetOut:
    return target_out(manager.detach(pid))
