"""The rows the server keeps (``store.Store``), as the services read them: immutable records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FutureRecord:
    request_id: str
    model_id: str | None
    seq_id: int | None
    kind: str
    status: str  # pending | done | failed
    media_type: str | None
    payload: bytes | None
    error: str | None
    category: str | None

    @property
    def finished(self) -> bool:
        return self.status != "pending"


@dataclass(frozen=True)
class CheckpointRecord:
    model_id: str
    kind: str
    name: str
    created_at: float
    size_bytes: int
    expires_at: float | None
    public: bool
    user_metadata: dict[str, str]
    base_model: str | None = None  # its run's (``models.base_model``); None if that row is gone


# models.status of a run that holds weights made elsewhere (``copy_weights``, an adapter upload): never trained
COPY_STATUS = "copy"


@dataclass(frozen=True)
class SamplerRecord:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None  # tinker:// path it samples from, if made from one
    model_id: str | None  # the training model it was saved from, if ephemeral
    snapshot: str | None  # where an ephemeral sampler's frozen adapter lives
    # snapshot: those weights, always; inflight: the newest inflight snapshot of its model
    kind: str = "snapshot"


@dataclass(frozen=True)
class ApiKeyRecord:
    key_id: str
    name: str
    prefix: str  # the key's first characters, to tell keys apart in a listing
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class ModelRecord:
    model_id: str
    session_id: str
    model_seq_id: int
    base_model: str
    lora: dict[str, Any]
    user_metadata: dict[str, Any]
    status: str  # active | unloaded | lost | failed | copy (holds copy_weights, never trained)
    created_at: float = 0.0


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    created_at: float
    owner: str
    project_id: str | None
    status: str  # active | finished:<success|errored|interrupted>
    display_name: str | None
    user_metadata: dict[str, Any]
    status_detail: str | None = None  # what the client said when it finished the session
