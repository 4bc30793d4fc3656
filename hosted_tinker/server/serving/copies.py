"""``copy_weights``: a checkpoint copied into a new training run that holds it and cannot be
trained on (the SDK's contract), sharing the source's files rather than duplicating them.

Two destinations, as the SDK sends them:

- ``destination_project_id`` (``RestClient.copy_weights``, ``ServiceClient.copy_weights``): a new
  session of the caller's, in that project, finished at once (no client runs in it), whose run 0
  holds the copy. With an ``X-Idempotency-Key`` (the SDK sends one, the same on every retry)
  that session's id is derived from the key, so a retry finds the copy it already made.
- ``session_id`` + ``model_seq_id``: run ``{session_id}:train:{model_seq_id}`` of one of the
  caller's sessions; a retry finds it too.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from functools import partial

from hosted_tinker.core.checkpoints import CheckpointError, CheckpointFiles, TinkerPath
from hosted_tinker.core.errors import ApiError, bad_request, not_found
from hosted_tinker.server.persistence.records import COPY_STATUS
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.quotas import Quotas, store_checkpoint
from hosted_tinker.server.serving.checkpoints import check_ttl
from hosted_tinker.server.serving.events import CheckpointEvents, Made
from hosted_tinker.server.serving.sessions import check_project_id
from hosted_tinker.server.serving.tenancy import Tenancy


class CopyService:
    def __init__(
        self,
        store: Store,
        files: CheckpointFiles,
        tenancy: Tenancy,
        quotas: Quotas,
        events: CheckpointEvents | None = None,
    ) -> None:
        self.store = store
        self.files = files
        self.tenancy = tenancy
        self.quotas = quotas  # a new copy takes its owner's checkpoint bytes
        self.events = events if events is not None else CheckpointEvents()  # a copy is a checkpoint like any other
        self._lock = threading.Lock()  # one copy at a time: a retry racing its original finds it

    def copy(
        self,
        req: wire.CopyWeightsRequest,
        owner: str,
        idempotency_key: str | None,
    ) -> rsp.CopyWeightsResponse:
        """The copy's ``tinker_path`` (made now, or found: a retry of the same request; a new one
        reserves the source's size from ``owner``'s checkpoint bytes). Reads and links files:
        call it off the event loop."""
        with self._lock:
            return self._copy(req, owner, idempotency_key)

    def _copy(
        self,
        req: wire.CopyWeightsRequest,
        owner: str,
        idempotency_key: str | None,
    ) -> rsp.CopyWeightsResponse:
        if req.weights_access_token is not None:
            raise bad_request("weights_access_token is not supported: checkpoints here have no access tokens")
        check_ttl(req.ttl_seconds)
        try:
            source = TinkerPath.parse(req.source_path, field="source_path")
        except CheckpointError as e:
            raise bad_request(str(e)) from None
        if source.kind not in ("weights", "sampler_weights"):
            raise bad_request(f"source_path: {source.kind} checkpoints cannot be copied (weights or sampler_weights)")
        self.tenancy.readable(owner, req.source_path, field="source_path", purpose="copy")
        record = self.store.get_checkpoint(source.run_id, source.kind, source.name)
        run = self.store.get_model(source.run_id)
        if record is None or run is None:
            raise not_found(f"source_path: checkpoint {source} does not exist")

        run_id = self._destination(req, owner, idempotency_key, source)
        target = TinkerPath(run_id, source.kind, source.name)
        existing = self.store.get_model(run_id)
        if existing is not None:
            if existing.status == COPY_STATUS and self.store.get_checkpoint(run_id, source.kind, source.name):
                return rsp.CopyWeightsResponse(tinker_path=str(target))  # the same copy, asked for again
            raise ApiError(409, f"training run {run_id} already exists; copy into another model_seq_id")
        held = self.quotas.reserve_checkpoint(owner, None, record.size_bytes)  # a new copy: not a retry
        if isinstance(held, ApiError):
            raise held

        def put() -> None:
            self.store.add_model(
                run_id,
                session_id=run_id.rpartition(":train:")[0],
                model_seq_id=int(run_id.rpartition(":")[2]),
                base_model=run.base_model,
                lora=run.lora,
                user_metadata=run.user_metadata,
            )
            self.store.set_model_status(run_id, COPY_STATUS)
            self.store.put_checkpoint(
                run_id,
                source.kind,
                source.name,
                size_bytes=size,
                ttl_seconds=req.ttl_seconds,  # the source's expiry is not inherited
                user_metadata=record.user_metadata,
            )

        size = record.size_bytes  # a hard link of the source's files: the same bytes

        def link() -> None:
            self.files.delete(target)  # a copy that a crash left without its rows, if any
            try:
                self.files.link(source, target)
            except CheckpointError as e:
                raise bad_request(f"source_path: {e}") from None

        store_checkpoint(held, size, link, put, undo=partial(self.files.delete, target))
        self.events.made(Made(target, owner, size, self.files, "copy", {"copied_from": str(source)}))
        return rsp.CopyWeightsResponse(tinker_path=str(target))

    def _destination(
        self, req: wire.CopyWeightsRequest, owner: str, idempotency_key: str | None, source: TinkerPath
    ) -> str:
        """The id of the run that receives the copy (its session made here for a project)."""
        if req.session_id is not None or req.model_seq_id is not None:
            if req.session_id is None or req.model_seq_id is None:
                raise bad_request("copy_weights into a session needs both session_id and model_seq_id")
            self.tenancy.session(owner, req.session_id)
            return f"{req.session_id}:train:{req.model_seq_id}"
        if not req.destination_project_id:
            raise bad_request("copy_weights needs destination_project_id, or session_id and model_seq_id")
        check_project_id(req.destination_project_id)
        if idempotency_key:
            digest = hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()[:20]
            session_id = f"sess-copy-{digest}"
        else:
            session_id = f"sess-copy-{secrets.token_hex(10)}"
        if self.store.session_owner(session_id) is None:
            self.store.add_session(
                session_id,
                owner=owner,
                tags=["copy_weights"],
                user_metadata={"copied_from": str(source)},
                project_id=req.destination_project_id,
                display_name=f"copy of {source}",
                sdk_version=None,
            )
            self.store.finish_session(session_id, "finished:success")
        return f"{session_id}:train:0"
