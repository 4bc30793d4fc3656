"""Health endpoints for operators (``curl /healthz``) and client probes."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hosted_tinker.server.api.auth import presented_key
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.metrics import Scrape, visible
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.serving.health import health

router = APIRouter(responses={413: {"model": rsp.ErrorResponse}, 415: {"model": rsp.ErrorResponse}})


@router.get("/healthz", response_model=rsp.ServerHealthResponse)
@router.get("/health", response_model=rsp.ServerHealthResponse)
@router.get("/", response_model=rsp.ServerHealthResponse)
async def healthz(request: Request) -> rsp.ServerHealthResponse:
    return health(server_state(request))


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus' text format (``server.metrics``). With keys on it needs one, unless
    ``--public-metrics`` (for a scraper on a private network); each model's series only for its
    own key, and every model's for an operator's (``--console-operator``)."""
    state = server_state(request)
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # --public-metrics: the key is not required, but counts where it is sent
        tenant = state.keys.tenant_of(presented_key(request))
    scrape = Scrape(list(state.scheduler.metrics.registry.collect()))
    if not state.is_operator(tenant):

        def owns(model: str) -> bool:
            return tenant is not None and state.tenancy.owns(tenant, model)

        scrape = await asyncio.to_thread(visible, scrape.families, owns)  # a query per model
    return Response(generate_latest(scrape), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/v1/healthz", response_model=rsp.HealthResponse)
async def api_healthz() -> rsp.HealthResponse:
    return rsp.HealthResponse(status="ok")
