"""Health endpoints for operators (``curl /healthz``) and client probes."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.serving.health import health

router = APIRouter(responses={413: {"model": rsp.ErrorResponse}, 415: {"model": rsp.ErrorResponse}})


@router.get("/healthz", **rsp.as_built(rsp.ServerHealthResponse))
@router.get("/health", **rsp.as_built(rsp.ServerHealthResponse))
@router.get("/", **rsp.as_built(rsp.ServerHealthResponse))
async def healthz(request: Request) -> dict:
    return health(server_state(request))


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus' text format (``server.metrics``). It names every tenant's model ids: with keys
    on it needs one, unless ``--public-metrics`` (for a scraper on a private network)."""
    registry = server_state(request).scheduler.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/v1/healthz", **rsp.as_built(rsp.HealthResponse))
async def api_healthz() -> dict:
    return {"status": "ok"}
