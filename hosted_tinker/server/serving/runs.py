"""What the REST API and the console say of training runs and their checkpoints: one JSON shape
for each (``TrainingRun``, ``Checkpoint``), listings and their pages. Who may see what is
checked before (``Tenancy``); another key than a run's owner sees it as far as its published
checkpoints show it. And the checkpoint search (``RestClient.search_checkpoints``)."""

from __future__ import annotations

import dataclasses
from datetime import datetime

from hosted_tinker.core.checkpoints import KIND_TO_TYPE, TinkerPath
from hosted_tinker.core.errors import bad_request, not_found
from hosted_tinker.server.persistence.records import CheckpointRecord, ModelRecord
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.persistence.store_rows import DEFAULT_PROJECT
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.responses import iso_time

TYPE_TO_KIND = {t: k for k, t in KIND_TO_TYPE.items()}
# A cursor's time is the stored float to the microsecond (``iso_time``): the store reads rows up
# to a little past it, and the exact comparison is the wire's (``search_key``).
CURSOR_SLACK_S = 1e-3


def _iso(t: float) -> str:
    return iso_time(t).isoformat()


class RunViews:
    def __init__(self, store: Store) -> None:
        self.store = store

    def checkpoint_json(self, record: CheckpointRecord) -> rsp.Checkpoint:
        """A checkpoint as the REST API describes it."""
        path = TinkerPath(record.model_id, record.kind, record.name)
        return rsp.Checkpoint(
            checkpoint_id=path.checkpoint_id,
            checkpoint_type=path.checkpoint_type,
            time=_iso(record.created_at),
            tinker_path=str(path),
            size_bytes=record.size_bytes,
            public=record.public,
            user_metadata=record.user_metadata,
            expires_at=_iso(record.expires_at) if record.expires_at else None,
            base_model=record.base_model,
        )

    def run_json(self, model: ModelRecord, owned: bool = True) -> rsp.TrainingRun:
        """A run (checked by ``Tenancy``) as the REST API describes it: to another key than its
        owner's, as far as its published checkpoints show it."""
        checkpoints = self.store.list_checkpoints(model.model_id)
        if not owned:  # nor its metadata, nor when it was last used: only what was published
            checkpoints = [c for c in checkpoints if c.public]
            model = dataclasses.replace(model, user_metadata={})
        last = next((c for c in checkpoints if c.kind == "weights"), None)
        last_sampler = next((c for c in checkpoints if c.kind == "sampler_weights"), None)
        owner = self.store.session_owner(model.session_id)
        return rsp.TrainingRun(
            training_run_id=model.model_id,
            base_model=model.base_model,
            model_owner=owner or "local",
            is_lora=True,
            corrupted=False,
            lora_rank=model.lora["rank"],
            last_request_time=_iso(
                self.store.model_last_request(model.model_id)
                if owned
                else max((c.created_at for c in checkpoints), default=model.created_at)
            ),
            last_checkpoint=self.checkpoint_json(last) if last else None,
            last_sampler_checkpoint=self.checkpoint_json(last_sampler) if last_sampler else None,
            user_metadata={k: str(v) for k, v in model.user_metadata.items()},
        )

    def list_runs(
        self, owner: str, limit: int, offset: int, access_scope: str = "owned", project_id: str | None = None
    ) -> rsp.TrainingRunsResponse:
        """``owner``'s runs, newest first (``access_scope`` "accessible": and others' runs with a
        published checkpoint), of project ``project_id`` if given."""
        published = access_scope == "accessible"
        models, total = self.store.list_models(owner, limit, offset, published=published, project=project_id)
        return rsp.TrainingRunsResponse(
            training_runs=[self.run_json(m, self.store.session_owner(m.session_id) == owner) for m in models],
            cursor=rsp.Cursor(offset=offset, limit=limit, total_count=total),
        )

    def list_checkpoints(self, run_id: str, owned: bool = True) -> rsp.CheckpointsListResponse:
        """The checkpoints of a run (checked by ``Tenancy``), newest first: another key than its
        owner's sees its published ones."""
        checkpoints = self.store.list_checkpoints(run_id)
        return self._checkpoints_page(checkpoints if owned else [c for c in checkpoints if c.public], None, 0)

    def list_owned_checkpoints(self, owner: str, limit: int, offset: int) -> rsp.CheckpointsListResponse:
        """Every checkpoint of every run of ``owner``'s sessions, newest first."""
        return self._checkpoints_page(self.store.owned_checkpoints(owner), limit, offset)

    def _checkpoints_page(
        self, records: list[CheckpointRecord], limit: int | None, offset: int
    ) -> rsp.CheckpointsListResponse:
        page = records[offset : offset + limit] if limit is not None else records
        cursor = rsp.Cursor(offset=offset, limit=limit or len(records), total_count=len(records))
        return rsp.CheckpointsListResponse(checkpoints=[self.checkpoint_json(r) for r in page], cursor=cursor)

    # ---- search (RestClient.search_checkpoints) --------------------------------------------

    def search_checkpoints(self, req: wire.CheckpointSearchRequest, owner: str) -> rsp.CheckpointSearchResponse:
        """One page of the checkpoints ``owner`` may list that match, newest first: its own, and
        of other keys only the published ones, as every listing here shows them. ``project_ids``
        name the caller's own projects (another key's are not its to list), so with them only
        its own checkpoints match."""
        urns = req.owner.owner_urns
        if req.owner.type != "user" and urns is not None:
            raise bad_request(f"owner.owner_urns is only for owner.type 'user', not {req.owner.type!r}")
        if req.owner.type == "user" and urns is None:
            raise bad_request("owner.owner_urns: owner.type 'user' names 1 to 10 owners")
        if req.project_ids is not None:
            projects = self.store.projects_of(owner)
            unknown = [p for p in req.project_ids if p not in projects and p != DEFAULT_PROJECT]
            if unknown:
                raise not_found(f"project_ids: {unknown[0]!r} is not a project of yours")
        own = req.owner.type != "user" or owner in (urns or [])
        others: list[str] | None = None  # "accessible": every other key's published ones
        if req.owner.type == "own" or req.project_ids is not None:
            others = []
        elif req.owner.type == "user":
            others = [u for u in urns or [] if u != owner]
        after = (req.cursor.last_created_at, req.cursor.last_checkpoint_uuid) if req.cursor is not None else None
        records = self.store.search_checkpoints(
            owner,
            own=own,
            others=others,
            projects=req.project_ids,
            kind=TYPE_TO_KIND[req.checkpoint_type] if req.checkpoint_type is not None else None,
            base_models=req.base_models,
            until=after[0].timestamp() + CURSOR_SLACK_S if after is not None else None,
        )
        page, more = search_page(records, req.user_metadata, req.limit, after)
        next_cursor = None
        if more:
            last_created_at, last_path = search_key(page[-1])
            next_cursor = rsp.CheckpointSearchCursor(
                last_created_at=last_created_at.isoformat(), last_checkpoint_uuid=last_path
            )
        return rsp.CheckpointSearchResponse(
            checkpoints=[self.checkpoint_json(r) for r in page], next_cursor=next_cursor
        )


def search_key(record: CheckpointRecord) -> tuple[datetime, str]:
    """Where a checkpoint stands in the search's order (descending) and in its cursor: its time
    as the wire has it (microseconds, not the stored float), then its tinker path, which stands
    for the uuid checkpoints here do not have (``last_checkpoint_uuid``)."""
    return iso_time(record.created_at), str(TinkerPath(record.model_id, record.kind, record.name))


def metadata_matches(record: CheckpointRecord, wanted: dict[str, str]) -> bool:
    """Every wanted pair is one of the checkpoint's own ``user_metadata``, exactly."""
    return all(k in record.user_metadata and str(record.user_metadata[k]) == v for k, v in wanted.items())


def search_page(
    records: list[CheckpointRecord], wanted: dict[str, str], limit: int, after: tuple[datetime, str] | None
) -> tuple[list[CheckpointRecord], bool]:
    """The first ``limit`` records after the cursor key ``after`` whose metadata matches, newest
    first, and whether more match."""
    rows = sorted(records, key=search_key, reverse=True)
    if after is not None:
        rows = [r for r in rows if search_key(r) < after]
    matches: list[CheckpointRecord] = []
    for row in rows:
        if metadata_matches(row, wanted):
            matches.append(row)
            if len(matches) > limit:  # one more than a page: there is a next page
                break
    return matches[:limit], len(matches) > limit
