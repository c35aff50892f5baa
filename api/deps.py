"""Dependencies the routers share: the settings and the manager, from the app's state (tests override them)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Depends, Query, Request

from agent.model.target import PID_MAX
from api.ports import ManagerPort
from api.settings import ApiSettings


def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_manager(request: Request) -> ManagerPort:
    return request.app.state.manager  # type: ignore[no-any-return]


Settings = Annotated[ApiSettings, Depends(get_settings)]
Manager = Annotated[ManagerPort, Depends(get_manager)]
Pid = Annotated[
    int | None, Query(ge=1, le=PID_MAX, description="The target; may be left out when there is only one.")
]
Format = Annotated[
    Literal["text", "json"],
    Query(alias="format", description="text: the file Massif's monitor command writes; json: the same data."),
]
