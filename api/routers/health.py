from __future__ import annotations

from fastapi import APIRouter

from api.deps import Manager
from api.models import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: no token needed")
def healthz(manager: Manager) -> Health:
    return Health(targets=len(manager.targets()))
