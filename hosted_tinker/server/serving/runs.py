"""What the REST API and the console say of training runs and their checkpoints: one JSON shape
for each (``TrainingRun``, ``Checkpoint``), listings and their pages. Who may see what is
checked before (``Tenancy``); another key than a run's owner sees it as far as its published
checkpoints show it."""

from __future__ import annotations

import dataclasses

from hosted_tinker.core.checkpoints import TinkerPath
from hosted_tinker.server.protocol.responses import iso_time
from hosted_tinker.server.records import CheckpointRecord, ModelRecord
from hosted_tinker.server.store import Store


def _iso(t: float) -> str:
    return iso_time(t).isoformat()


class RunViews:
    def __init__(self, store: Store) -> None:
        self.store = store

    def checkpoint_json(self, record: CheckpointRecord) -> dict:
        """A checkpoint as the REST API describes it."""
        path = TinkerPath(record.model_id, record.kind, record.name)
        return {
            "checkpoint_id": path.checkpoint_id,
            "checkpoint_type": path.checkpoint_type,
            "time": _iso(record.created_at),
            "tinker_path": str(path),
            "size_bytes": record.size_bytes,
            "public": record.public,
            "user_metadata": record.user_metadata,
            "expires_at": _iso(record.expires_at) if record.expires_at else None,
        }

    def run_json(self, model: ModelRecord, owned: bool = True) -> dict:
        """A run (checked by ``Tenancy``) as the REST API describes it: to another key than its
        owner's, as far as its published checkpoints show it."""
        checkpoints = self.store.list_checkpoints(model.model_id)
        if not owned:  # nor its metadata, nor when it was last used: only what was published
            checkpoints = [c for c in checkpoints if c.public]
            model = dataclasses.replace(model, user_metadata={})
        last = next((c for c in checkpoints if c.kind == "weights"), None)
        last_sampler = next((c for c in checkpoints if c.kind == "sampler_weights"), None)
        owner = self.store.session_owner(model.session_id)
        return {
            "training_run_id": model.model_id,
            "base_model": model.base_model,
            "model_owner": owner or "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": model.lora["rank"],
            "last_request_time": _iso(
                self.store.model_last_request(model.model_id)
                if owned
                else max((c.created_at for c in checkpoints), default=model.created_at)
            ),
            "last_checkpoint": self.checkpoint_json(last) if last else None,
            "last_sampler_checkpoint": self.checkpoint_json(last_sampler) if last_sampler else None,
            "user_metadata": {k: str(v) for k, v in model.user_metadata.items()},
        }

    def list_runs(
        self, owner: str, limit: int, offset: int, access_scope: str = "owned", project_id: str | None = None
    ) -> dict:
        """``owner``'s runs, newest first (``access_scope`` "accessible": and others' runs with a
        published checkpoint), of project ``project_id`` if given."""
        published = access_scope == "accessible"
        models, total = self.store.list_models(owner, limit, offset, published=published, project=project_id)
        return {
            "training_runs": [self.run_json(m, self.store.session_owner(m.session_id) == owner) for m in models],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    def list_checkpoints(self, run_id: str, owned: bool = True) -> dict:
        """The checkpoints of a run (checked by ``Tenancy``), newest first: another key than its
        owner's sees its published ones."""
        checkpoints = self.store.list_checkpoints(run_id)
        return self._checkpoints_page(checkpoints if owned else [c for c in checkpoints if c.public], None, 0)

    def list_owned_checkpoints(self, owner: str, limit: int, offset: int) -> dict:
        """Every checkpoint of every run of ``owner``'s sessions, newest first."""
        return self._checkpoints_page(self.store.owned_checkpoints(owner), limit, offset)

    def _checkpoints_page(self, records: list[CheckpointRecord], limit: int | None, offset: int) -> dict:
        page = records[offset : offset + limit] if limit is not None else records
        cursor = {"offset": offset, "limit": limit or len(records), "total_count": len(records)}
        return {"checkpoints": [self.checkpoint_json(r) for r in page], "cursor": cursor}
