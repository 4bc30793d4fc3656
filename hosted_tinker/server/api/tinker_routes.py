"""``/api/v1`` routes of the Tinker protocol. HTTP only: parse, check that the caller's key owns
the ids it names (``state.tenancy``), call a service, answer. The key's limits are the services'
to check (``server.quotas``), where a refused ordered request still uses up its seq_id."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request, Response

from hosted_tinker.core.errors import ApiError, UserError, not_found
from hosted_tinker.server.api.auth import tenant_of
from hosted_tinker.server.api.errors import large_body, ordered, refuse_unparsed
from hosted_tinker.server.api.json_body import OffLoopJson
from hosted_tinker.server.api.request_log import note
from hosted_tinker.server.api.state import ServerState, server_state
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.ordering import head_limit
from hosted_tinker.server.protocol.proto_codec import WireForwardBackward, decode_forward_backward, decompress
from hosted_tinker.server.protocol.proto_scan import check_prefix
from hosted_tinker.server.serving.futures import check_cancellable

router = APIRouter(prefix="/api/v1", responses=rsp.TINKER_ERRORS, route_class=OffLoopJson)


def _owner_of_model(request: Request, model_id: str) -> ServerState:
    """The server state, once the caller's key is known to own ``model_id`` (else a 404)."""
    state = server_state(request)
    state.tenancy.model(tenant_of(request), model_id)
    return state


def _future(request: Request, request_id: str, model_id: str | None = None) -> wire.UntypedFuture:
    note(request, request_id=request_id)
    return wire.UntypedFuture(request_id=request_id, model_id=model_id)


def _optimizer_sent(req: wire.OptimStepRequest) -> str | None:
    return "adamw" if req.optimizer_params is None else str(req.optimizer_params.get("type"))


# ---- client configuration, sessions, telemetry -----------------------------------------------


@router.post("/client/config", response_model=rsp.ClientConfigResponse)
async def client_config(req: wire.ClientConfigRequest, request: Request) -> rsp.ClientConfigResponse:
    config = server_state(request).config
    return rsp.ClientConfigResponse(
        pjwt_auth_enabled=False,
        proto_compress_fwdbwd=config.proto_compress,
        use_pyqwest_transport=config.sdk_transport == "pyqwest",
        # Served here: one completions long-poll per sampling client, and clone numbers.
        sample_use_retrieve_futures=True,
        sample_join_sampling_session=True,
        custom_loss_server_side=True,  # create_custom_loss stores it; forward_backward_custom runs it here
    )


@router.post("/client/dynamic_config", response_model=rsp.ClientDynamicConfigResponse)
async def client_dynamic_config(req: wire.ClientConfigRequest) -> rsp.ClientDynamicConfigResponse:
    return rsp.ClientDynamicConfigResponse(sample_cancel_enabled=True)  # an abandoned sample is cancelled


@router.post("/create_session")
async def create_session(req: wire.CreateSessionRequest, request: Request) -> wire.CreateSessionResponse:
    return server_state(request).sessions.create(req, owner=tenant_of(request))


@router.post("/session_heartbeat", response_model=rsp.SessionHeartbeatResponse)
async def session_heartbeat(req: wire.SessionHeartbeatRequest, request: Request) -> rsp.SessionHeartbeatResponse:
    state = server_state(request)
    state.tenancy.session(tenant_of(request), req.session_id)
    return state.sessions.heartbeat(req)


@router.post("/sessions/{session_id}/finish", response_model=rsp.FinishSessionResponse)
async def finish_session(
    session_id: str, req: wire.FinishSessionRequest, request: Request
) -> rsp.FinishSessionResponse:
    state = server_state(request)
    state.tenancy.session(tenant_of(request), session_id)
    return state.sessions.finish(session_id, req)


@router.post("/telemetry", response_model=rsp.TelemetryResponse)
async def telemetry(req: wire.TelemetryRequest) -> rsp.TelemetryResponse:
    # Telemetry batches can carry API keys in captured headers: never log or store them.
    return rsp.TelemetryResponse(status="accepted")


@router.get("/get_server_capabilities", response_model=rsp.GetServerCapabilitiesResponse)
async def get_server_capabilities(request: Request) -> rsp.GetServerCapabilitiesResponse:
    state = server_state(request)
    caps = state.backend.capabilities
    sampleable = caps.sampling or state.vllm is not None  # see SamplingService._check_engine
    return rsp.GetServerCapabilitiesResponse(
        supported_models=[
            rsp.SupportedModel(
                model_name=name, max_context_length=caps.max_seq_len, trainable=True, sampleable=sampleable
            )
            for name in state.config.served_names()
        ]
    )


# ---- training --------------------------------------------------------------------------------


@router.post("/create_custom_loss")
async def create_custom_loss(req: wire.CreateCustomLossRequest, request: Request) -> wire.UntypedFuture:
    state = server_state(request)
    note(request, session_id=req.session_id, custom_loss=req.name)
    state.tenancy.session(tenant_of(request), req.session_id)
    return _future(request, state.custom_losses.create(req, tenant_of(request)))


@router.post("/create_model")
async def create_model(req: wire.CreateModelRequest, request: Request) -> wire.UntypedFuture:
    state = server_state(request)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    note(
        request,
        model_id=model_id,
        optimizer=req.optimizer_config.type,
        lora_rank=req.lora_config and req.lora_config.rank,
    )
    tenant = tenant_of(request)
    state.tenancy.session(tenant, req.session_id)
    return _future(request, state.training.create_model(req, tenant))


@router.post("/get_info", response_model=rsp.GetInfoResponse)
async def get_info(req: wire.GetInfoRequest, request: Request) -> rsp.GetInfoResponse:
    state = _owner_of_model(request, req.model_id)
    return state.training.get_info(req)


@router.post("/forward_backward", **ordered("forward_backward", large_body=True))
async def forward_backward(request: Request) -> wire.UntypedFuture:
    state = server_state(request)
    content_type = request.headers.get("content-type", "")
    if "protobuf" not in content_type:
        raise ApiError(
            415,
            f"forward_backward takes an application/x-protobuf ForwardBackwardRequest body "
            f"(tinker SDK >= 0.25), got Content-Type {content_type!r}",
        )
    # The app's BodyLimit has already bounded the body; the same limit bounds its inflated size,
    # which the body's hold takes as it comes (api.inflight: a 429 the SDK resends past the key's share).
    limit, max_tokens = state.config.max_body_bytes, state.backend.capabilities.max_tokens_per_batch
    body, encoding = await request.body(), request.headers.get("content-encoding")
    hold = request.scope.get("state", {}).get("body_hold")

    def decode() -> tuple[WireForwardBackward, int]:
        charge = hold.take if hold is not None else None
        raw = decompress(body, encoding, limit, charge, check=lambda start: check_prefix(start, max_tokens))
        return decode_forward_backward(raw, max_tokens), len(raw)

    try:  # inflating and walking up to the limit takes a while: not on the event loop
        req, size = await asyncio.to_thread(decode)
    except UserError as e:  # unreadable: the seq_id its head names is still used up
        refused = ApiError(e.status, str(e), headers=e.headers, code=e.code)
        raise refuse_unparsed(request, body[: head_limit(encoding)], refused) from None
    note(request, model_id=req.model_id, seq_id=req.seq_id, loss_fn=req.loss_fn, datums=req.num_datums)
    state.tenancy.model(tenant_of(request), req.model_id)  # before any datum is built
    await asyncio.to_thread(req.build)  # the datums, off the event loop; the body let go
    if hold is not None:
        hold.release()  # from here the batch is counted as pending (--max-pending-bytes)
    return _future(request, state.training.forward_backward(req, size), req.model_id)


@router.post("/optim_step", **ordered("optim_step"))
async def optim_step(req: wire.OptimStepRequest, request: Request) -> wire.UntypedFuture:
    note(request, model_id=req.model_id, seq_id=req.seq_id, optimizer=_optimizer_sent(req))
    state = _owner_of_model(request, req.model_id)
    return _future(request, state.training.optim_step(req), req.model_id)


@router.post("/unload_model")
async def unload_model(req: wire.UnloadModelRequest, request: Request) -> wire.UntypedFuture:
    note(request, model_id=req.model_id)
    state = _owner_of_model(request, req.model_id)
    return _future(request, state.training.unload_model(req.model_id), req.model_id)


# ---- checkpoints and sampling sessions -------------------------------------------------------


@router.post("/save_weights", **ordered("save_weights"))
async def save_weights(req: wire.SaveWeightsRequest, request: Request) -> wire.UntypedFuture:
    note(request, model_id=req.model_id, seq_id=req.seq_id)
    state = _owner_of_model(request, req.model_id)
    return _future(request, state.checkpoints.save_weights(req, tenant_of(request)), req.model_id)


@router.post("/save_weights_for_sampler", **ordered("save_weights_for_sampler"))
async def save_weights_for_sampler(req: wire.SaveWeightsForSamplerRequest, request: Request) -> wire.UntypedFuture:
    note(request, model_id=req.model_id, seq_id=req.seq_id)
    state = _owner_of_model(request, req.model_id)
    return _future(request, state.checkpoints.save_weights_for_sampler(req, tenant_of(request)), req.model_id)


@router.post("/save_weights_external", **ordered("save_weights_external"))
async def save_weights_external(req: wire.SaveWeightsExternalRequest, request: Request) -> wire.UntypedFuture:
    note(request, model_id=req.model_id, seq_id=req.seq_id)
    state = _owner_of_model(request, req.model_id)
    return _future(request, state.checkpoints.save_weights_external(req, tenant_of(request)), req.model_id)


@router.post("/load_weights", **ordered("load_weights"))
async def load_weights(req: wire.LoadWeightsRequest, request: Request) -> wire.UntypedFuture:
    state, tenant = server_state(request), tenant_of(request)
    note(request, model_id=req.model_id, seq_id=req.seq_id, session_id=req.session_id, path=req.path)
    if req.model_id is not None:
        state.tenancy.model(tenant, req.model_id)
    elif req.session_id is not None:  # creates a model in this session
        state.tenancy.session(tenant, req.session_id)
    return _future(request, state.checkpoints.load_weights(req, tenant), req.model_id)


@router.post("/create_sampling_session", response_model=rsp.CreateSamplingSessionResponse)
async def create_sampling_session(
    req: wire.CreateSamplingSessionRequest, request: Request
) -> rsp.CreateSamplingSessionResponse:
    state, tenant = server_state(request), tenant_of(request)
    state.tenancy.session(tenant, req.session_id)
    if req.model_path is not None:
        state.tenancy.readable(tenant, req.model_path, field="model_path", purpose="sample")
    return state.sampling.create_sampling_session(req)


@router.post("/join_sampling_session", response_model=rsp.JoinSamplingSessionResponse)
async def join_sampling_session(
    req: wire.JoinSamplingSessionRequest, request: Request
) -> rsp.JoinSamplingSessionResponse:
    """A number for another client of the session (an unpickled SamplingClient), so that the
    clients' seq_ids never collide: its own block of 10⁹."""
    state = server_state(request)
    state.tenancy.sampler(tenant_of(request), req.sampling_session_id)
    if state.store.get_sampler(req.sampling_session_id) is None:
        raise not_found(f"sampling_session_id {req.sampling_session_id!r} does not exist")
    counter = state.store.join_sampler(req.sampling_session_id)
    return rsp.JoinSamplingSessionResponse(client_counter=counter)


@router.post("/asample", response_model=rsp.SampleFuture, **large_body("prompt"))
async def asample(req: wire.SampleRequest, request: Request) -> rsp.SampleFuture:
    state = server_state(request)
    note(request, sampling_session_id=req.sampling_session_id, seq_id=req.seq_id, num_samples=req.num_samples)
    if req.sampling_session_id is not None:
        state.tenancy.sampler(tenant_of(request), req.sampling_session_id)
    request_id, sequence_ids = state.sampling.asample(req)
    note(request, request_id=request_id)
    return rsp.SampleFuture(request_id=request_id, sample_sequence_ids=sequence_ids)


# ---- futures ---------------------------------------------------------------------------------


@router.post(
    "/retrieve_future",
    response_class=Response,
    responses={
        200: {
            "model": rsp.FutureJsonResult,
            "content": rsp.PROTOBUF,
            "description": "JSON: try_again, the request's failure, or its JSON result; "
            "protobuf: a finished forward_backward's or asample's result",
        }
    },
)
async def retrieve_future(req: wire.RetrieveFutureRequest, request: Request) -> Response:
    state = server_state(request)
    note(request, request_id=req.request_id)
    state.tenancy.future(tenant_of(request), req.request_id)
    record = await state.scheduler.wait(req.request_id, state.config.poll_timeout_s)
    if record is None:
        raise not_found(f"request_id {req.request_id!r} does not exist")
    if not record.finished:
        # The SDK re-polls at once on try_again, so this is only sent after a full long-poll.
        body: dict[str, Any] = {"type": "try_again", "request_id": record.request_id, "queue_state": "active"}
        return Response(json.dumps(body), media_type="application/json")
    if record.status == "failed":
        body = {"error": record.error, "category": record.category, "request_id": record.request_id}
        return Response(json.dumps(body), media_type="application/json")
    return Response(record.payload, media_type=record.media_type)


@router.post("/retrieve_futures", response_model=rsp.FuturesRetrieveResponse)
async def retrieve_futures(req: wire.FuturesRetrieveRequest, request: Request) -> rsp.FuturesRetrieveResponse:
    state = server_state(request)
    state.tenancy.sampler(tenant_of(request), req.target.sampling_session_id, "target.sampling_session_id")
    return await state.futures.completions(req)


@router.post("/cancel_future", response_model=rsp.CancelFutureResponse)
async def cancel_future(req: wire.CancelFutureRequest, request: Request) -> rsp.CancelFutureResponse:
    state = server_state(request)
    note(request, request_id=req.request_id)
    state.tenancy.future(tenant_of(request), req.request_id)
    record = state.store.get_future(req.request_id)
    if record is None:
        raise not_found(f"request_id {req.request_id!r} does not exist")
    check_cancellable(record)
    return rsp.CancelFutureResponse(request_id=req.request_id, cancelled=state.sampling.cancel(req.request_id))
