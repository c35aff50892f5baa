from __future__ import annotations

from fastapi import APIRouter

from api.deps import Manager, Pid
from api.models import MonitorOut, MonitorRequest, monitor_out
from api.routers import ERRORS

router = APIRouter(tags=["monitor"])


@router.post(
    "/monitor",
    responses=ERRORS,
    summary="Run a Massif monitor command; a named file is written under the daemon's output directory",
)
def monitor(body: MonitorRequest, manager: Manager, pid: Pid = None) -> MonitorOut:
    return monitor_out(manager.monitor(pid, body.command))
