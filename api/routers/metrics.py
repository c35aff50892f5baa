from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client.exposition import choose_encoder

from api.routers import ERRORS

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format, or OpenMetrics when asked for)",
    responses={
        **ERRORS,
        200: {
            "description": "The metrics",
            "content": {
                "text/plain": {"schema": {"type": "string"}},
                "application/openmetrics-text": {"schema": {"type": "string"}},
            },
        },
    },
    response_class=Response,
)
def metrics(request: Request) -> Response:
    registry = request.app.state.registry
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(registry), media_type=content_type)
