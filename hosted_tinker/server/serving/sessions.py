"""Sessions: the SDK opens one per ServiceClient, heartbeats it, and finishes it on close."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from hosted_tinker.core.errors import ApiError, bad_request, not_found
from hosted_tinker.server.persistence.records import SessionRow
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.persistence.store_rows import DEFAULT_PROJECT
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.responses import iso_time
from hosted_tinker.server.quotas import Quotas
from hosted_tinker.server.serving.audit import AuditLog
from hosted_tinker.server.serving.training import TrainingService


class SessionService:
    def __init__(
        self,
        store: Store,
        training: TrainingService,
        quotas: Quotas,
        on_finish: Callable[[str], None] | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        self.store = store
        self.training = training
        self.quotas = quotas  # a key's live sessions and the size of their metadata
        self.on_finish = on_finish  # more clean-up for a finished session (its sampler snapshots)
        self.audit = audit  # sessions moved between projects (``serving.audit``)

    def create(self, req: wire.CreateSessionRequest, owner: str) -> wire.CreateSessionResponse:
        self.quotas.new_session(owner, req.user_metadata)
        if req.project_id is not None:
            check_project_id(req.project_id)
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

    def heartbeat(self, req: wire.SessionHeartbeatRequest) -> rsp.SessionHeartbeatResponse:
        status = self.store.session_status(req.session_id)
        if status is None:
            raise not_found(f"session_id {req.session_id!r} does not exist")
        if status != "active":
            # 410 tells the SDK's heartbeat loop that the session is over.
            raise ApiError(410, f"session {req.session_id} has finished")
        self.store.touch_session(req.session_id)
        return rsp.SessionHeartbeatResponse()

    def finish(self, session_id: str, req: wire.FinishSessionRequest) -> rsp.FinishSessionResponse:
        if not self._end(session_id, f"finished:{req.reason.type}", req.detail):
            raise not_found(f"session_id {session_id!r} does not exist")
        return rsp.FinishSessionResponse()

    def expire(self, session_id: str) -> None:
        """End a session silent for longer than results are kept (its client is gone): as if
        it had finished, interrupted. Its checkpoints stay; its models, parked ones too, go."""
        self._end(session_id, "finished:interrupted")

    def _end(self, session_id: str, status: str, detail: str | None = None) -> bool:
        if not self.store.finish_session(session_id, status, detail):
            return False
        # The SDK never unloads models itself: a closed client's adapters would otherwise
        # stay in memory (or parked on disk) for the life of the server.
        self.training.unload_session(session_id)
        if self.on_finish is not None:
            self.on_finish(session_id)
        return True

    def assign_project(self, session_id: str, project_id: str, actor: str) -> None:
        """Move a session (checked by ``Tenancy.session``), its runs and samplers, to a project."""
        if not project_id:
            raise bad_request("project_id is empty: a session cannot be moved out of its project")
        check_project_id(project_id)
        self.store.set_session_project(session_id, project_id)
        if self.audit is not None:
            self.audit.record(actor, "project_session_assign", actor, session_id=session_id, project_id=project_id)

    def get_session(self, session_id: str) -> rsp.GetSessionResponse:
        session = self.store.get_session(session_id)
        if session is None:
            raise not_found(f"session {session_id!r} does not exist")
        return rsp.GetSessionResponse(
            training_run_ids=session["training_run_ids"],
            sampler_ids=session["sampler_ids"],
            user_metadata={k: str(v) for k, v in session["user_metadata"].items()},
            display_name=session["display_name"],
        )

    # ---- search (RestClient.search_sessions) -----------------------------------------------

    def search(self, req: wire.SessionSearchRequest, owner: str) -> rsp.SessionSearchResponse:
        """One page of the caller's sessions that match, newest first. A key lists only its own
        sessions, so ``accessible`` is ``own`` and ``user`` finds the caller's among its URNs."""
        if req.owner.type == "user" and owner not in (req.owner.owner_urns or []):
            return rsp.SessionSearchResponse(sessions=[])
        if req.owner.type != "user" and req.owner.owner_urns is not None:
            raise bad_request(f"owner.owner_urns is only for owner.type 'user', not {req.owner.type!r}")
        # Pages are ordered and cut by the key the cursor carries: time at microseconds, then id.
        rows = sorted(self.store.sessions_of(owner), key=lambda r: (iso_time(r.created_at), r.session_id), reverse=True)
        if req.project_ids is not None:
            projects = {_project(r) for r in rows}
            unknown = [p for p in req.project_ids if p not in projects and p != DEFAULT_PROJECT]
            if unknown:
                raise not_found(f"project_ids: {unknown[0]!r} is not a project of yours")
        if req.cursor is not None:  # compared as the wire has it: microseconds, not the stored float
            after = (req.cursor.last_created_at, req.cursor.last_session_id)
            rows = [r for r in rows if (iso_time(r.created_at), r.session_id) < after]
        matches: list[SessionRow] = []
        for row in rows:
            if _matches(row, req):
                matches.append(row)
                if len(matches) > req.limit:  # one more than a page: there is a next page
                    break
        page = matches[: req.limit]
        next_cursor = None
        if len(matches) > req.limit:
            last = page[-1]
            next_cursor = rsp.SessionSearchCursor(
                last_created_at=iso_time(last.created_at).isoformat(), last_session_id=last.session_id
            )
        return rsp.SessionSearchResponse(sessions=[self._summary(r) for r in page], next_cursor=next_cursor)

    def _summary(self, row: SessionRow) -> rsp.SessionSummary:
        return rsp.SessionSummary(
            session_id=row.session_id,
            created_at=iso_time(row.created_at).isoformat(),
            owner=row.owner,
            project_id=_project(row),
            status=_status(row.status, row.status_detail),
            checkpoints_count=self.store.checkpoints_count(row.session_id),
            display_name=row.display_name,
            user_metadata={k: str(v) for k, v in row.user_metadata.items()},
        )


MAX_PROJECT_ID = 128


def check_project_id(project_id: str) -> None:
    """A project id is a name: 1-128 characters, printable, not only spaces (400 otherwise)."""
    if not 0 < len(project_id) <= MAX_PROJECT_ID or not project_id.isprintable() or not project_id.strip():
        raise bad_request(
            f"project_id must be 1 to {MAX_PROJECT_ID} printable characters, not only spaces; got {project_id[:40]!r}"
        )


def _project(row: SessionRow) -> str:
    return row.project_id or DEFAULT_PROJECT


def _status(stored: str, detail: str | None = None) -> dict:
    """The SDK's ``SessionStatus`` of a stored status (``active``, ``finished:<reason>``) and the
    detail its client gave when it finished it."""
    if stored == "active":
        return {"type": "active"}
    return {"type": "client_finished", "reason": {"type": stored.removeprefix("finished:")}, "detail": detail}


def _matches(row: SessionRow, req: wire.SessionSearchRequest) -> bool:
    # session_id and display_name: either one (the SDK's rule); each word of the name, anywhere.
    named = []
    if req.session_id is not None:
        named.append(row.session_id == req.session_id)
    if req.display_name is not None:
        name = (row.display_name or "").casefold()
        named.append(all(word in name for word in req.display_name.casefold().split()))
    if named and not any(named):
        return False
    if req.project_ids is not None and _project(row) not in req.project_ids:
        return False
    if any(str(row.user_metadata.get(k)) != v or k not in row.user_metadata for k, v in req.user_metadata.items()):
        return False
    if req.statuses is not None:
        status = _status(row.status)
        if not any(_status_matches(status, q) for q in req.statuses):
            return False
    return True


def _status_matches(status: dict, query: wire.SessionStatusQuery) -> bool:
    if status["type"] != query.type:
        return False
    return query.reasons is None or status.get("reason", {}).get("type") in query.reasons
