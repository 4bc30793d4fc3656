"""Health endpoints for operators (``curl /healthz``) and client probes."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hosted_tinker.rank.plans import backend_options
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol import responses as rsp

router = APIRouter(responses={413: {"model": rsp.ErrorResponse}, 415: {"model": rsp.ErrorResponse}})


@router.get("/healthz", **rsp.as_built(rsp.ServerHealthResponse))
@router.get("/health", **rsp.as_built(rsp.ServerHealthResponse))
@router.get("/", **rsp.as_built(rsp.ServerHealthResponse))
async def healthz(request: Request) -> dict:
    state = server_state(request)
    return {
        "status": "ok",
        "served_models": state.config.served_names(),
        "capabilities": asdict(state.backend.capabilities),
        "backend_options": backend_options(state.config).model_dump(),
        "queue": state.scheduler.queue_status(),
        "worker": state.backend.status(),
        "inference": state.vllm.status() if state.vllm is not None else state.sampling.embedded.status(),
        "active": state.store.count_active(),
        "residency": state.training.residency.status(),
        "joint_passes": state.training.joint.status(),
        "checkpoint_mirror": state.checkpoints.mirror.status() if state.checkpoints.mirror is not None else None,
        "auth": state.keys.describe(),
    }


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus' text format (``server.metrics``). It names every tenant's model ids: with keys
    on it needs one, unless ``--public-metrics`` (for a scraper on a private network)."""
    registry = server_state(request).scheduler.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/v1/healthz", **rsp.as_built(rsp.HealthResponse))
async def api_healthz() -> dict:
    return {"status": "ok"}
