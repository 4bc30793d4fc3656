"""REST routes used by RestClient, the cookbook and the ``tinker`` CLI: runs, checkpoints,
sessions, samplers and checkpoint downloads. HTTP only; each route checks that the caller's key
owns what it names (published checkpoints can be read by every key)."""

from __future__ import annotations

import asyncio
from datetime import date, datetime
from typing import Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse

from hosted_tinker.core.errors import bad_request
from hosted_tinker.server.api.auth import tenant_of
from hosted_tinker.server.api.state import ServerState, server_state
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.serving.traces import session_trace

MAX_OFFSET = 2**62  # SQLite integers are 64-bit: a larger offset is a 422, not an overflow

router = APIRouter(prefix="/api/v1", responses=rsp.TINKER_ERRORS)
# Signed download links are their own credential: the CLI fetches them without an API key.
downloads = APIRouter(prefix="/api/v1", responses=rsp.TINKER_ERRORS)
NO_CONTENT: dict[str, Any] = {"status_code": 204, "response_class": Response}


# "owned": the key's own. "accessible": also what it may read of others', which here is runs
# with a published checkpoint (keys are tenants, not members of an organization that share).
AccessScope = Literal["owned", "accessible"]


@router.get("/training_runs", response_model=rsp.TrainingRunsResponse)
async def list_training_runs(
    request: Request,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
    access_scope: AccessScope = "owned",
    project_id: str | None = None,
) -> rsp.TrainingRunsResponse:
    return server_state(request).runs.list_runs(tenant_of(request), limit, offset, access_scope, project_id)


def _own_run(request: Request, run_id: str) -> ServerState:
    state = server_state(request)
    state.tenancy.run(tenant_of(request), run_id)
    return state


@router.get("/training_runs/{run_id}", response_model=rsp.TrainingRun)
async def get_training_run(run_id: str, request: Request, access_scope: AccessScope = "owned") -> rsp.TrainingRun:
    state, tenant = server_state(request), tenant_of(request)
    if access_scope == "owned":
        return state.runs.run_json(state.tenancy.run(tenant, run_id))
    return state.runs.run_json(*state.tenancy.visible_run(tenant, run_id))


@router.get("/training_runs/{run_id}/checkpoints", response_model=rsp.CheckpointsListResponse)
async def list_run_checkpoints(run_id: str, request: Request) -> rsp.CheckpointsListResponse:
    """A run's checkpoints: all of them to its owner, the published ones to every other key."""
    state = server_state(request)
    _, owned = state.tenancy.visible_run(tenant_of(request), run_id)
    return state.runs.list_checkpoints(run_id, owned)


@router.get("/training_runs/{run_id}/metrics", response_model=rsp.RunMetricsResponse)
async def get_run_metrics(
    run_id: str,
    request: Request,
    after: int = Query(-1, ge=-1, le=MAX_OFFSET),
    limit: int = Query(500, ge=1, le=5000),
) -> rsp.RunMetricsResponse:
    """The run's closed steps after step ``after``, oldest first, and its open step."""
    state = _own_run(request, run_id)
    # A page of thousands of steps is a large read: off the event loop. The store's page (which
    # the console's charts read too) is checked as the answer here.
    page = await asyncio.to_thread(state.run_metrics.steps, run_id, after, limit)
    return rsp.RunMetricsResponse.model_validate(page)


@router.get("/checkpoints", response_model=rsp.CheckpointsListResponse)
async def list_user_checkpoints(
    request: Request, limit: int = Query(100, ge=1, le=10000), offset: int = Query(0, ge=0, le=MAX_OFFSET)
) -> rsp.CheckpointsListResponse:
    return server_state(request).runs.list_owned_checkpoints(tenant_of(request), limit, offset)


@router.post("/checkpoints/search", response_model=rsp.CheckpointSearchResponse)
async def search_checkpoints(req: wire.CheckpointSearchRequest, request: Request) -> rsp.CheckpointSearchResponse:
    """``RestClient.search_checkpoints`` (SDK 0.39): the caller's checkpoints and other keys'
    published ones. Every visible checkpoint may be read and matched: off the event loop."""
    return await asyncio.to_thread(server_state(request).runs.search_checkpoints, req, tenant_of(request))


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", **NO_CONTENT)
async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request) -> Response:
    # Removing a large adapter's files takes a while: keep it off the event loop.
    await asyncio.to_thread(_own_run(request, run_id).checkpoints.delete, run_id, f"{kind}/{name}", tenant_of(request))
    return Response(status_code=204)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id}", include_in_schema=False)
async def delete_checkpoint_without_kind(run_id: str, checkpoint_id: str, request: Request) -> Response:
    """A checkpoint named without its kind (``RestClient.delete_checkpoint(run, "step-5")``): say
    which form it takes, rather than the framework's bare "Not Found"."""
    _own_run(request, run_id)
    raise bad_request(
        f"checkpoint_id {checkpoint_id!r} names no kind: a checkpoint id is <kind>/<name>, "
        f"weights/{checkpoint_id} or sampler_weights/{checkpoint_id}"
    )


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", **NO_CONTENT)
async def publish_checkpoint(run_id: str, kind: str, name: str, request: Request) -> Response:
    _own_run(request, run_id).checkpoints.set_public(run_id, f"{kind}/{name}", True, tenant_of(request))
    return Response(status_code=204)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", **NO_CONTENT)
async def unpublish_checkpoint(run_id: str, kind: str, name: str, request: Request) -> Response:
    _own_run(request, run_id).checkpoints.set_public(run_id, f"{kind}/{name}", False, tenant_of(request))
    return Response(status_code=204)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", **NO_CONTENT)
async def set_checkpoint_ttl(
    run_id: str, kind: str, name: str, req: wire.CheckpointTtlRequest, request: Request
) -> Response:
    _own_run(request, run_id).checkpoints.set_ttl(run_id, f"{kind}/{name}", req.ttl_seconds)
    return Response(status_code=204)


@router.get(
    "/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls",
    response_model=rsp.ExternalWeightsUrlsResponse,
)
async def external_weights_urls(run_id: str, kind: str, name: str, request: Request) -> rsp.ExternalWeightsUrlsResponse:
    state = server_state(request)
    state.tenancy.readable(tenant_of(request), f"tinker://{run_id}/{kind}/{name}", purpose="download")
    base_url = str(request.base_url).rstrip("/")
    return state.checkpoints.download_urls(run_id, f"{kind}/{name}", base_url, tenant_of(request))


@downloads.get("/files/{token}/{signature}/{file_name}", response_class=FileResponse, responses=rsp.FILE)
async def download_file(token: str, signature: str, file_name: str, request: Request) -> FileResponse:
    state = server_state(request)
    path, request.state.tenant = state.checkpoints.links.file(token, signature, file_name)
    _admit_link(state, request.state.tenant)
    return FileResponse(path, filename=file_name)  # its line in the request log names the link's key


def _admit_link(state: ServerState, tenant: str) -> None:
    """A link's fetch is its key's request: held to the key's rate, in a bucket of its own (keyless
    on the wire, it passed ``KeyCheck``'s; 2,000 fetches in 3 s each wrote a keyed log line)."""
    if (over := state.quotas.admit(tenant, "links")) is not None:
        raise over


@router.post("/weights_info", response_model=rsp.WeightsInfoResponse)
async def weights_info(req: wire.WeightsInfoRequest, request: Request) -> rsp.WeightsInfoResponse:
    state = server_state(request)
    state.tenancy.readable(tenant_of(request), req.tinker_path, field="tinker_path", purpose="describe")
    return state.checkpoints.weights_info(req.tinker_path)


@router.get("/samplers/{sampler_id}", response_model=rsp.GetSamplerResponse)
async def get_sampler(sampler_id: str, request: Request) -> rsp.GetSamplerResponse:
    state = server_state(request)
    state.tenancy.sampler(tenant_of(request), sampler_id, field="sampler")
    return state.sampling.get_sampler(sampler_id)


@router.get("/sessions", response_model=rsp.ListSessionsResponse)
async def list_sessions(
    request: Request,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
    access_scope: AccessScope = "owned",  # a key may read only its own sessions: both scopes are those
) -> rsp.ListSessionsResponse:
    return rsp.ListSessionsResponse(
        sessions=server_state(request).store.list_sessions(tenant_of(request), limit, offset)
    )


@router.put("/sessions/{session_id}/project", **NO_CONTENT)
async def assign_session_project(session_id: str, req: wire.AssignSessionProjectRequest, request: Request) -> Response:
    state = server_state(request)
    state.tenancy.session(tenant_of(request), session_id, field="session")
    state.sessions.assign_project(session_id, req.project_id, tenant_of(request))
    return Response(status_code=204)


@router.get("/sessions/{session_id}/trace_export", response_model=rsp.TraceExportResponse)
async def export_session_trace(session_id: str, request: Request) -> rsp.TraceExportResponse:
    """Ready at once: the link builds the trace when it is fetched (``serving.traces``)."""
    state = server_state(request)
    state.tenancy.session(tenant_of(request), session_id, field="session")
    base_url = str(request.base_url).rstrip("/")
    url = state.checkpoints.links.trace_url(session_id, base_url, tenant_of(request))
    return rsp.TraceExportResponse(status="ready", url=url)


@downloads.get("/traces/{token}/{signature}/{file_name}", response_class=Response, responses=rsp.TRACE)
async def download_trace(token: str, signature: str, file_name: str, request: Request) -> Response:
    state = server_state(request)
    session_id, request.state.tenant = state.checkpoints.links.trace_session(token, signature, file_name)
    _admit_link(state, request.state.tenant)
    # A long session's rows are many: read and encoded off the event loop.
    trace = await asyncio.to_thread(session_trace, state.store, session_id)
    return Response(trace, media_type="application/json")


@router.get("/audit", response_model=rsp.AuditLogResponse)
async def audit_log(
    request: Request,
    event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all",
    day: date | None = None,
) -> rsp.AuditLogResponse:
    """``AdminClient.get_audit_log``: what concerned the key's resources or was done by it."""
    state = server_state(request)
    return await asyncio.to_thread(state.audit.entries, tenant_of(request), event_type, day)


@router.get("/billing/usage/events", response_model=rsp.BillingUsageResponse)
async def billing_usage(request: Request, starting_on: datetime, ending_before: datetime) -> rsp.BillingUsageResponse:
    """``AdminClient.get_billing_usage``: the key's own usage, per UTC hour (``serving.usage``)."""
    state, tenant = server_state(request), tenant_of(request)
    name = state.store.api_key_name(tenant)
    return await asyncio.to_thread(state.usage.report, tenant, name, starting_on, ending_before)


@router.get("/billing/usage/checkpoints/current", response_model=rsp.CheckpointStorageUsageResponse)
async def checkpoint_storage_usage(
    request: Request, project_id: str | None = None
) -> rsp.CheckpointStorageUsageResponse:
    state, tenant = server_state(request), tenant_of(request)
    return state.usage.stored_now(tenant, state.store.api_key_name(tenant), project_id)


@router.post("/copy_weights", response_model=rsp.CopyWeightsResponse)
async def copy_weights(
    req: wire.CopyWeightsRequest,
    request: Request,
    idempotency_key: str | None = Header(None, alias="X-Idempotency-Key"),
) -> rsp.CopyWeightsResponse:
    state = server_state(request)
    return await asyncio.to_thread(state.copies.copy, req, tenant_of(request), idempotency_key)


@router.post("/sessions/search", response_model=rsp.SessionSearchResponse)
async def search_sessions(req: wire.SessionSearchRequest, request: Request) -> rsp.SessionSearchResponse:
    return server_state(request).sessions.search(req, tenant_of(request))


@router.get("/sessions/{session_id}", response_model=rsp.GetSessionResponse)
async def get_session(session_id: str, request: Request, access_scope: AccessScope = "owned") -> rsp.GetSessionResponse:
    state = server_state(request)
    state.tenancy.session(tenant_of(request), session_id, field="session")
    return state.sessions.get_session(session_id)
