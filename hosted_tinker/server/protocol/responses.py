"""JSON response types: what each route answers, for ``/openapi.json`` and the fuzzer's checks.

Field names and optionality mirror the SDK 0.38 response types (``tinker/types/*``, protocol
reference §3, §6.8) and the OpenAI SDK's. A model declares every key that is sent and no other
(``extra="forbid"``: a key a service adds that its model lacks is an error, not a silent extra
on the wire). Services build these models; the route declares the same one as its
``response_model``, and every field is sent, a ``None`` as ``null``. Where a key is left out of
some answers (a failed future's size, an open step's ``optim``), that answer has a model of its
own. Open sub-objects whose keys are another part's to choose (``/healthz``'s parts, a billing
event's ``event_info``) are typed ``dict[str, Any]``. Times are ISO 8601 strings (typed ``str``
so that their spelling is not re-rendered by pydantic).
"""

from __future__ import annotations

import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonDict

from hosted_tinker.server.protocol.json_types import CreateSessionResponse, UntypedFuture

__all__ = ["CreateSessionResponse", "UntypedFuture"]

_ISO: JsonDict = {"format": "date-time"}


def iso_time(t: float) -> datetime.datetime:
    """A stored time (Unix seconds) as the aware datetime the wire carries (``.isoformat()``),
    microsecond precision: compare with the client's copy as this, never as the float."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC)


class Response(BaseModel):
    # Floats keep NaN/Infinity as the JSON encoder wrote them before (logprobs may be -inf).
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), ser_json_inf_nan="constants")


# ---- errors ---------------------------------------------------------------------------------


class ValidationIssue(Response):
    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(Response):
    """Tinker's error body (``/api/v1`` and health): a message, or a 422's list of issues."""

    detail: str | list[ValidationIssue]


class OpenAIErrorBody(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(Response):
    """OpenAI's error body (``/v1``), which its SDK turns into typed exceptions."""

    error: OpenAIErrorBody


ERROR_STATUSES = (400, 401, 403, 404, 409, 413, 415, 422, 429, 503)
TINKER_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in ERROR_STATUSES}
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": OpenAIErrorResponse} for s in ERROR_STATUSES}


# ---- configuration, sessions, telemetry -----------------------------------------------------


class ClientConfigResponse(Response):
    """The SDK's feature flags; those not sent keep its defaults."""

    pjwt_auth_enabled: bool = False
    proto_compress_fwdbwd: bool = False
    use_pyqwest_transport: bool = True
    sample_use_retrieve_futures: bool  # one completions long-poll per sampling client
    sample_join_sampling_session: bool  # clone numbers (join_sampling_session)
    custom_loss_server_side: bool  # create_custom_loss stores it; forward_backward_custom runs it here


class ClientDynamicConfigResponse(Response):
    """The SDK's refreshed flags. ``refresh_interval_sec`` is not sent: the SDK's is an ``int``
    (300 by default), which a ``null`` would fail."""

    sample_cancel_enabled: bool  # an abandoned sample is cancelled (cancel_future)


class SessionHeartbeatResponse(Response):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishSessionResponse(Response):
    """The SDK ignores this body; it is ``{}``."""


class TelemetryResponse(Response):
    status: Literal["accepted"] = "accepted"


class SupportedModel(Response):
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


class GetServerCapabilitiesResponse(Response):
    supported_models: list[SupportedModel]


class HealthResponse(Response):
    status: Literal["ok"] = "ok"


class ServerHealthResponse(Response):
    """``/healthz`` for operators. Its inner parts come from the backend, the scheduler and the
    inference engine, and change with them: they stay open objects (``dict[str, Any]``)."""

    status: Literal["ok"] = "ok"
    served_models: list[str]
    capabilities: dict[str, Any]
    backend_options: dict[str, Any]
    queue: dict[str, Any]
    body_bytes: dict[str, Any]  # request bodies held now (server.api.inflight)
    worker: dict[str, Any]
    inference: dict[str, Any] | None = None
    active: dict[str, Any]
    residency: dict[str, Any]
    joint_passes: dict[str, Any]
    checkpoint_mirror: dict[str, Any] | None = None
    auth: dict[str, Any]


# ---- training -------------------------------------------------------------------------------


class ModelData(Response):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(Response):
    type: Literal["get_info"] | None = None
    model_data: ModelData
    model_id: str
    optimizer_config: dict[str, Any] | None = None
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


class CreateSamplingSessionResponse(Response):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class SampleFuture(Response):
    """``asample``'s future: the SDK requires one sequence id per sample."""

    request_id: str
    sample_sequence_ids: list[str]


# ---- futures --------------------------------------------------------------------------------


class TryAgainResponse(Response):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"]


class RequestFailedResponse(Response):
    error: str
    category: Literal["unknown", "server", "user"]
    request_id: str | None = None


class FutureFinished(Response):
    state: Literal["finished"] = "finished"
    request_id: str
    response_payload_uncompressed_size: int | None


class FutureFailed(Response):
    """A failed request: no payload, so no size (the SDK's ``FutureFailed``)."""

    state: Literal["failed"] = "failed"
    request_id: str


FutureCompletion = Annotated[FutureFinished | FutureFailed, Field(discriminator="state")]


class FuturesRetrieveResponse(Response):
    completions: list[FutureCompletion]
    cursor: int


class CancelFutureResponse(Response):
    type: Literal["cancel_future"] = "cancel_future"
    request_id: str
    cancelled: bool  # false: it had already finished


class JoinSamplingSessionResponse(Response):
    type: Literal["join_sampling_session"] = "join_sampling_session"
    client_counter: int


class CreateModelResponse(Response):
    model_id: str
    type: Literal["create_model"] | None = None


class OptimStepResponse(Response):
    metrics: dict[str, float] | None = None
    type: Literal["optim_step"] | None = None


class SaveWeightsResponse(Response):
    path: str
    type: Literal["save_weights"] | None = None


class SaveWeightsForSamplerResponse(Response):
    path: str | None = None
    sampling_session_id: str | None = None
    type: Literal["save_weights_for_sampler"] | None = None


class SaveWeightsExternalResponse(Response):
    path: str | None = None
    size_bytes: int | None = None
    type: Literal["save_weights_external"] | None = None


class LoadWeightsResponse(Response):
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] | None = None


class UnloadModelResponse(Response):
    model_id: str
    type: Literal["unload_model"] | None = None


# The JSON forms of a future's answer. A finished forward_backward or asample is protobuf
# (``application/x-protobuf``); an unfinished one is try_again; a failed one, RequestFailed.
FutureJsonResult = (
    TryAgainResponse
    | RequestFailedResponse
    | CreateModelResponse
    | OptimStepResponse
    | SaveWeightsResponse
    | SaveWeightsForSamplerResponse
    | SaveWeightsExternalResponse
    | LoadWeightsResponse
    | UnloadModelResponse
)


# ---- REST -----------------------------------------------------------------------------------


class Cursor(Response):
    offset: int
    limit: int
    total_count: int


class Checkpoint(Response):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: str = Field(json_schema_extra=_ISO)
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: str | None = Field(default=None, json_schema_extra=_ISO)
    base_model: str | None = None  # its run's (SDK 0.39)


class TrainingRun(Response):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: str = Field(json_schema_extra=_ISO)
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(Response):
    training_runs: list[TrainingRun]
    cursor: Cursor


class CheckpointsListResponse(Response):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class ExternalWeightsUrlsResponse(Response):
    urls: dict[str, str]
    expires: str = Field(json_schema_extra=_ISO)


class WeightsInfoResponse(Response):
    base_model: str
    optimizer_config: dict[str, Any] | None = None
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class CheckpointStorageUsageItem(Response):
    project_id: str | None = None
    org_user_urn: str | None = None
    user_name: str | None = None  # (the SDK's user_email is not sent: keys here have none)
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    estimated_monthly_cost_usd: float | None = None


class CheckpointStorageUsageResponse(Response):
    effective_rate_usd_per_gigabyte_month: float | None = None
    data: list[CheckpointStorageUsageItem]


class AuditLogEntry(Response):
    timestamp: str = Field(json_schema_extra=_ISO)
    event: str
    event_details: dict[str, Any] = Field(default_factory=dict)  # what each event records: open
    # The SDK's deprecated copies of checkpoint events' details: null on other events.
    model_id: str | None = None
    tinker_path: str | None = None
    purpose: str | None = None


class AuditLogResponse(Response):
    entries: list[AuditLogEntry]


class BillingUsageEvent(Response):
    bucket_start: str = Field(json_schema_extra=_ISO)
    bucket_end: str = Field(json_schema_extra=_ISO)
    base_model: str | None = None
    user_id: str | None = None
    user_name: str | None = None
    session_id: str | None = None
    project_id: str | None = None
    estimated_cost_usd: float | None = None
    effective_rate_usd_per_million_tokens: float | None = None
    effective_rate_usd_per_gigabyte_month: float | None = None
    # {"type": "training" | "sampling_prefill" | "sampling_sample", "token_count", ("cached")} |
    # {"type": "checkpoint", "count"} | {"type": "storage", "free", "gigabyte_hours"}
    event_info: dict[str, Any]


class BillingUsageSession(Response):
    user_metadata: dict[str, str] | None = None


class BillingUsageResponse(Response):
    data: list[BillingUsageEvent]
    sessions: dict[str, BillingUsageSession] = Field(default_factory=dict)
    cost_data_through: str | None = None


class TraceExportResponse(Response):
    """Always ready here: the link builds the trace when it is fetched (``serving.traces``)."""

    status: Literal["pending", "ready", "failed"]
    url: str | None = None


class GetSamplerResponse(Response):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class ListSessionsResponse(Response):
    sessions: list[str]


class GetSessionResponse(Response):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class CopyWeightsResponse(Response):
    tinker_path: str


class ExternalWeightsUploadStartResponse(Response):
    upload_id: str
    urls: dict[str, str]  # a signed URL per file, to PUT it to
    expires: str = Field(json_schema_extra=_ISO)


class ExternalWeightsUploadFinishResponse(Response):
    tinker_path: str


class SessionSearchCursor(Response):
    last_created_at: str = Field(json_schema_extra=_ISO)
    last_session_id: str


class SessionSummary(Response):
    session_id: str
    created_at: str = Field(json_schema_extra=_ISO)
    owner: str
    project_id: str
    status: dict[str, Any] | None = None  # SDK SessionStatus: {"type": "active"} | {"type": "client_finished", ...}
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None


class SessionSearchResponse(Response):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None


class CheckpointSearchCursor(Response):
    last_created_at: str = Field(json_schema_extra=_ISO)
    last_checkpoint_uuid: str  # the checkpoint's tinker path (checkpoints here have no uuid)


class CheckpointSearchResponse(Response):
    checkpoints: list[Checkpoint]
    next_cursor: CheckpointSearchCursor | None = None


class OpenRunStep(Response):
    """The step still open (``serving.run_metrics``): its forward_backward calls summed up
    (``metrics`` merged by their ``:sum``/``:mean``/``:max``/``:min`` suffix)."""

    step: int
    time: float  # Unix seconds: when its optim_step finished (an open step: its latest call)
    duration_s: float
    tokens: int
    calls: int
    metrics: dict[str, float | None]  # null: a NaN or infinite value


class RunStep(OpenRunStep):
    """A closed optimizer step: also its optim_step's own metrics."""

    optim: dict[str, float | None]


class RunMetricsResponse(Response):
    run_id: str
    steps: list[RunStep]
    next_after: int | None = None  # the last step shown when there are more: the next page's ``after``
    open_step: OpenRunStep | None = None


# ---- non-JSON bodies (declared with ``responses=``) -----------------------------------------

# typed as FastAPI's ``responses=`` and ``content`` take them
_BINARY: dict[str, Any] = {"type": "string", "format": "binary"}
SSE: dict[str, Any] = {
    "text/event-stream": {"schema": {"type": "string", "description": "server-sent events, ending in [DONE]"}}
}
FILE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": _BINARY}}, "description": "the file's bytes"}
}
PROTOBUF: dict[str, Any] = {"application/x-protobuf": {"schema": _BINARY}}
TRACE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {"schema": {"type": "object"}}}, "description": "Chrome trace-event JSON"}
}
