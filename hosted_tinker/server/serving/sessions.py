"""Sessions: the SDK opens one per ServiceClient, heartbeats it, and finishes it on close."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from hosted_tinker.core.errors import ApiError, not_found
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.serving.training import TrainingService
from hosted_tinker.server.store import Store


class SessionService:
    def __init__(self, store: Store, training: TrainingService, on_finish: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.training = training
        self.on_finish = on_finish  # more clean-up for a finished session (its sampler snapshots)

    def create(self, req: wire.CreateSessionRequest, owner: str) -> wire.CreateSessionResponse:
        session_id = f"sess-{secrets.token_urlsafe(12)}"
        self.store.add_session(
            session_id,
            owner=owner,
            tags=req.tags,
            user_metadata=req.user_metadata or {},
            project_id=req.project_id,
            display_name=req.display_name,
            sdk_version=req.sdk_version,
        )
        return wire.CreateSessionResponse(session_id=session_id)

    def heartbeat(self, req: wire.SessionHeartbeatRequest) -> dict:
        status = self.store.session_status(req.session_id)
        if status is None:
            raise not_found(f"session_id {req.session_id!r} does not exist")
        if status != "active":
            # 410 tells the SDK's heartbeat loop that the session is over.
            raise ApiError(410, f"session {req.session_id} has finished")
        self.store.touch_session(req.session_id)
        return {"type": "session_heartbeat"}

    def finish(self, session_id: str, req: wire.FinishSessionRequest) -> dict:
        if not self.store.finish_session(session_id, f"finished:{req.reason.type}"):
            raise not_found(f"session_id {session_id!r} does not exist")
        # The SDK never unloads models itself: a closed client's adapters would otherwise
        # stay in memory for the life of the server.
        self.training.unload_session(session_id)
        if self.on_finish is not None:
            self.on_finish(session_id)
        return {}
