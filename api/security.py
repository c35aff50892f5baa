"""Bearer-token check. Built from the settings at app creation: with no token configured there is no check and
the OpenAPI schema declares no security; with one, every router but /healthz depends on it.

No `from __future__ import annotations` here: FastAPI must see the closure's Depends(bearer) at definition."""


import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.settings import ApiSettings


def token_dependency(settings: ApiSettings) -> Callable[..., None] | None:
    if settings.token is None:
        return None
    expected = settings.token.get_secret_value().encode()
    bearer = HTTPBearer(auto_error=False, description="The daemon's token (--token or HEAPSCOPE_TOKEN).")

    def require_token(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        given = cred.credentials.encode() if cred is not None and cred.scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, expected):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    return require_token
