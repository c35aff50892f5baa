"""One router per resource: health, profiles (the monitor commands as GETs), monitor, targets, metrics, the stored
history, what is growing (growth), pprof, selectors and the web page."""

from __future__ import annotations

from typing import Any

from api.models import ErrorBody

# Documented error responses (every one is JSON: {"detail": ..., "error": ...}).
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Bad request (several targets and no ?pid=, a bad command, ...)"},
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token (when the daemon has a token)"},
    404: {"model": ErrorBody, "description": "No such target"},
    409: {
        "model": ErrorBody,
        "description": "The target is busy (already profiled, or not attached yet), or MALT statistics are off",
    },
}
# A new target at one of the daemon's limits (--max-targets, --max-sites, --max-memory).
REFUSED: dict[int | str, dict[str, Any]] = {
    429: {"model": ErrorBody, "description": "Refused: the daemon is at one of its limits (targets, sites, memory)"},
}
