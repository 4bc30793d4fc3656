"""JSON wire types of SDK 0.38 (protocol reference §3), validated strictly.

Requests forbid unknown fields, so a misspelt option is a 422 naming it rather than a
silently ignored setting. Fields the SDK always sends are accepted even where we do not act
on them (``type`` tags, ``sdk_version``); their handling is stated next to each.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, model_validator

from hosted_tinker.server.protocol.strict import ListOf, StrictRequest, TextMap, is_text

# What a session stores for good, bounded (each is kept with it, and read by every search).
Name = Annotated[str, Field(max_length=256)]  # a display name, a tag, a version
MAX_DETAIL = 16384  # why a client closed its session


# Set while a request is validated: the models inside it need not walk their parts again.
_WALKED: ContextVar[bool] = ContextVar("unicode_walked", default=False)


class Request(StrictRequest):
    @model_validator(mode="wrap")
    @classmethod
    def _unicode(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        # JSON may escape a lone surrogate ("\ud800"), which no string here could be stored or
        # encoded with: refused as the client's mistake, never met later as an encoding error.
        # Walked once, by the outermost request (its models are validated within this call).
        if _WALKED.get():
            return handler(data)
        where = _unpaired_surrogate(data)
        if where is not None:
            raise ValueError(f"{where or 'the body'}: a string holds an unpaired surrogate, which is not Unicode text")
        walked = _WALKED.set(True)
        try:
            return handler(data)
        finally:
            _WALKED.reset(walked)


Link = tuple["Link | None", str | int]  # a value's place: its parent's, and its key or index there


def _unpaired_surrogate(value: Any) -> str | None:
    """The path of the first string (or key) in ``value`` that cannot be encoded as UTF-8. The
    walk keeps its own stack (JSON nests as deep as its parser lets it), and each value's path
    is a link to its parent's, spelled only once found: a body's lists hold millions of items."""
    stack: list[tuple[Any, Link | None]] = [(value, None)]
    while stack:
        item, link = stack.pop()
        if isinstance(item, str):
            if not is_text(item):
                return _spelled(link)
            continue
        children: list[tuple[Any, Link]] = []
        if isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not is_text(key):
                    return _spelled(link)
                if type(child) in _NESTED and child:
                    children.append((child, (link, key)))
        elif isinstance(item, list):
            children = [(child, (link, i)) for i, child in enumerate(item) if type(child) in _NESTED and child]
        stack.extend(reversed(children))  # in document order
    return None


_NESTED = (str, dict, list)  # what JSON decodes to that may hold a string (if not empty)


def _spelled(link: Link | None) -> str:
    path: list[str | int] = []
    while link is not None:
        link, key = link
        path.append(key)
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in reversed(path)).lstrip(".")


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")  # every key sent is declared (``protocol.responses``)


# ---- configuration and sessions ------------------------------------------------------------


class ClientConfigRequest(Request):
    sdk_version: str


class CreateSessionRequest(Request):
    tags: ListOf[Name] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] | None = None
    sdk_version: Name | None = None
    project_id: str | None = None
    display_name: Name | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(Response):
    session_id: str
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(Request):
    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishReason(Request):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(Request):
    reason: FinishReason
    detail: str | None = Field(default=None, max_length=MAX_DETAIL)


class CopyWeightsRequest(Request):
    """``RestClient.copy_weights`` / ``ServiceClient.copy_weights``: into a new run of a new
    session in ``destination_project_id``, or into run ``model_seq_id`` of ``session_id``."""

    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0, lt=2**63)
    destination_project_id: str | None = None
    source_path: str
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


class SearchOwner(Request):
    """Whose sessions or checkpoints: ``own``; ``accessible`` (all a key may list: of sessions,
    its own; of checkpoints, its own and other keys' published ones); ``user``, those of the
    listed owners (``SessionSummary.owner``, ``TrainingRun.model_owner``) the key may list."""

    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: ListOf[str] | None = Field(default=None, min_length=1, max_length=10)


class SessionStatusQuery(Request):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: ListOf[Literal["success", "errored", "interrupted"]] | None = Field(default=None, min_length=1)


class SessionSearchCursor(Request):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(Request):
    """``RestClient.search_sessions`` (SDK ``types.SessionSearchRequest``)."""

    session_id: str | None = None
    project_ids: ListOf[str] | None = None
    user_metadata: TextMap = Field(default_factory=dict)
    display_name: Name | None = Field(default=None, min_length=1)
    owner: SearchOwner = Field(default_factory=SearchOwner)
    statuses: ListOf[SessionStatusQuery] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SessionSearchCursor | None = None


class CheckpointSearchCursor(Request):
    """A response's ``next_cursor``, passed back unchanged."""

    last_created_at: AwareDatetime
    # Checkpoints here have no uuid: a checkpoint's tinker path stands for it (unique, and the
    # second key of the order after the time).
    last_checkpoint_uuid: str


class CheckpointSearchRequest(Request):
    """``RestClient.search_checkpoints`` (SDK 0.39 ``types.CheckpointSearchRequest``, written from
    the service's API reference: 0.39 is not installable here). ``base_models=[]`` matches none."""

    project_ids: ListOf[str] | None = None
    user_metadata: TextMap = Field(default_factory=dict)
    checkpoint_type: Literal["training", "sampler", "external"] | None = None
    owner: SearchOwner = Field(default_factory=SearchOwner)
    base_models: ListOf[str] | None = None
    limit: int = Field(default=50, ge=1, le=200)
    cursor: CheckpointSearchCursor | None = None


class TelemetryRequest(BaseModel):
    # Telemetry is best-effort and its event schema grows with the SDK: accept any shape.
    model_config = ConfigDict(extra="allow")


# ---- training ------------------------------------------------------------------------------


class LoraConfig(Request):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class ExternalWeightsUploadStartRequest(Request):
    """``RestClient.external_weights_upload_start`` (SDK 0.39): an adapter in the
    ``save_weights_external`` format of this base model and LoRA shape, to be PUT file by file."""

    base_model: str
    lora_config: LoraConfig
    destination_project_id: str | None = None


class ExternalWeightsUploadFinishRequest(Request):
    """``RestClient.external_weights_upload_finish`` (SDK 0.39)."""

    upload_id: str = Field(max_length=128)


class OptimizerConfig(BaseModel):
    """The optimizer family fixed at creation: ``{"type": "adamw"}`` or ``{"type": "dimuon",
    "version": 1}``. Families carry their own fields, so any are let in here and checked by
    ``serving.optimizers`` (an unknown family or field is a 400 naming it)."""

    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelRequest(Request):
    session_id: str
    model_seq_id: int = Field(ge=0, lt=2**63)
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    type: Literal["create_model"] = "create_model"


class CustomLossInput(Request):
    name: str
    rank: Literal[0, 1, 2]


class CustomLossGraph(Request):
    format: Literal[1] = 1
    # Nodes as torch.fx records them; their ops, targets and arguments are checked by
    # ``core.custom_loss`` against what it allows (a 400 naming the node).
    nodes: ListOf[dict[str, Any]] = Field(max_length=512)


class CreateCustomLossRequest(Request):
    session_id: str
    custom_loss_seq_id: int = Field(ge=0, lt=2**63)
    name: str = Field(min_length=1, max_length=128)
    inputs: ListOf[CustomLossInput] = Field(min_length=1, max_length=16)
    graph: CustomLossGraph
    type: Literal["create_custom_loss"] = "create_custom_loss"


class GetInfoRequest(Request):
    model_id: str
    type: Literal["get_info"] = "get_info"


class AdamParams(Request):
    # Ranges are checked by the training service, so that a bad value still consumes the seq_id.
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class DimuonParams(Request):
    # Ranges are checked by the training service, as for AdamParams. The SDK 0.38 sends the
    # first three; the official documentation also lists the last two.
    type: Literal["dimuon"] = "dimuon"
    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    damping: float = 0.1
    rank_lr_correction_exponent: float = 0.5


class OptimStepRequest(Request):
    model_id: str
    seq_id: int
    adam_params: AdamParams | None = None
    # Other families (the SDK's `optimizer_params`, tagged by `type`): parsed by the training
    # service, so that a malformed one still uses up its seq_id.
    optimizer_params: dict[str, Any] | None = None
    type: Literal["optim_step"] = "optim_step"


class UnloadModelRequest(Request):
    model_id: str
    type: Literal["unload_model"] = "unload_model"


class SaveWeightsRequest(Request):
    model_id: str
    path: str | None = None  # the checkpoint's name
    seq_id: int
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: TextMap | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(Request):
    model_id: str
    path: str | None = None  # a name: a saved checkpoint; absent: an ephemeral sampling session
    sampling_session_seq_id: int | None = Field(default=None, ge=0, lt=2**63)
    kind: str = "snapshot"
    seq_id: int
    ttl_seconds: int | None = None
    user_metadata: TextMap | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsExternalRequest(Request):
    model_id: str
    path: str
    seq_id: int
    ttl_seconds: int | None = None
    age_encryption_recipients: ListOf[str] | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


class LoadWeightsRequest(Request):
    # Either model_id + seq_id (load into an existing model) or session_id + model_seq_id
    # (create a model from the checkpoint; the SDK names it {session_id}:train:{model_seq_id}).
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0, lt=2**63)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"


class WeightsInfoRequest(Request):
    tinker_path: str


class AssignSessionProjectRequest(Request):
    project_id: str


class CheckpointTtlRequest(Request):
    ttl_seconds: int | None = None


class CreateSamplingSessionRequest(Request):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0, lt=2**63)
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"


# ---- sampling -----------------------------------------------------------------------------


class EncodedTextChunk(Request):
    tokens: ListOf[int]
    type: Literal["encoded_text"] = "encoded_text"


class ModelInput(Request):
    # Chunks are parsed loosely: each is validated by the service (``sampling.prompt_tokens``: a
    # text chunk, an image laid in by ``serving.images``, audio refused), its errors named by index.
    chunks: ListOf[dict[str, Any]]


class SamplingParams(Request):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | ListOf[str] | ListOf[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class TensorData(Request):
    """The SDK's JSON ``TensorData`` (protocol reference §6.2): flat row-major values, or CSR."""

    data: ListOf[int | float]
    dtype: Literal["int64", "float32"]
    shape: ListOf[int] | None = None
    sparse_crow_indices: ListOf[int] | None = None
    sparse_col_indices: ListOf[int] | None = None


class SampleRequest(Request):
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = Field(default=None, ge=0, lt=2**63)  # a clone's reach 10^18: int64
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool = False
    type: Literal["sample"] = "sample"


# ---- futures -------------------------------------------------------------------------------


class RetrieveFutureRequest(Request):
    request_id: str
    allow_metadata_only: bool = False


class CancelFutureRequest(Request):
    request_id: str


class SamplingSessionFuturesTarget(Request):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    # A sampling client's number (0: the one that created the session; ``join_sampling_session``
    # numbers the others): its requests' seq_ids lie in [n·10⁹, (n+1)·10⁹).
    cloned_sampler_id: int = Field(0, ge=0, le=9_000_000_000)


class FuturesRetrieveRequest(Request):
    target: SamplingSessionFuturesTarget
    prev_cursor: int = Field(0, ge=0, lt=2**63)
    timeout: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: the server's long-poll
    retrieved_request_ids: ListOf[str] = Field(default_factory=list, max_length=10_000)


class JoinSamplingSessionRequest(Request):
    sampling_session_id: str
    type: Literal["join_sampling_session"] = "join_sampling_session"


class UntypedFuture(Response):
    request_id: str
    model_id: str | None = None
