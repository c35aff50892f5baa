from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from agent.model.target import PID_MAX
from api.deps import Manager
from api.fleetmodels import SelectorOut, selector_out
from api.models import AttachRequest, ModeRequest, TargetOut, profile_mode, target_out
from api.routers import ERRORS, REFUSED

router = APIRouter(prefix="/targets", tags=["targets"])


@router.get("", summary="The targets: profiled now, or exited (their last state stays queryable)", responses=ERRORS)
def list_targets(manager: Manager) -> list[TargetOut]:
    profiled = [target_out(t.status()) for t in manager.targets()]
    return profiled + [target_out(s) for s in manager.not_profiled()]  # waiting (tried again), or refused


@router.post(
    "",
    status_code=201,
    summary="Attach to a running process (pid), or add a selector: the processes it matches are attached as they "
    "appear, and those running now",
    responses={**ERRORS, **REFUSED},
)
def attach(body: AttachRequest, manager: Manager) -> TargetOut | SelectorOut:
    if body.pid is not None:
        return target_out(manager.attach(body.pid, profile_mode(body.mode, body.sample_rate)).status())
    return selector_out(manager.add_selector(body.comm, body.cmdline, body.cgroup, body.follow_children))


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
