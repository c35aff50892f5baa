"""The one place that turns heapscope's errors into HTTP: a JSON body `{"detail": ..., "error": ...}` with a 4xx
status, never a traceback. Anything unexpected becomes a 500 with a one-line body (and goes to the log)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agent.errors import HeapscopeError, TargetError, UsageError

log = logging.getLogger("heapscope.api")


def status_of(exc: HeapscopeError) -> int:
    explicit = getattr(exc, "http_status", None)
    if isinstance(explicit, int):
        return explicit
    if isinstance(exc, UsageError):
        return 400
    if isinstance(exc, TargetError):
        return 404  # no such process, a kernel thread, or it went away
    return 400  # EnvironmentProblem included: this target cannot be probed here (its allocator, permissions)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HeapscopeError)
    async def heapscope_error(request: Request, exc: HeapscopeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "error": type(exc).__name__}, status_code=status_of(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
        return JSONResponse({"detail": "internal error (see the daemon's log)", "error": "InternalError"}, 500)
