"""The checkpoint search (``RunViews.search_checkpoints``) over a store with two keys' runs: who
sees what, each filter, the order (the wire's microseconds, then the path) and cursor pages;
and every checkpoint row carries its run's base model."""

from __future__ import annotations

from datetime import timedelta, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol.json_types import CheckpointSearchRequest
from hosted_tinker.server.serving.runs import RunViews

pytestmark = pytest.mark.fast

ALICE, BOB = "key-alice", "key-bob"
# (run, kind, name, created_at, public, user_metadata)
ROWS = [
    ("sa:train:0", "weights", "s1", 100.0, False, {"k": "1"}),
    ("sa:train:0", "sampler_weights", "s1", 101.0, False, {"k": "1", "x": "y"}),
    ("sb:train:0", "weights", "w", 102.0, False, {}),
    ("sb:train:0", "external_weights", "e", 102.0, False, {}),  # the same time: the path decides
    ("sc:train:0", "weights", "pub", 103.0, True, {}),
    ("sc:train:0", "weights", "priv", 104.0, False, {"k": "1"}),
    ("sc:train:0", "sampler_weights", "pub2", 99.0, True, {}),
    # two floats the wire cannot tell apart (one microsecond): ordered by path
    ("sa:train:0", "weights", "a-tie", 50.0000001, False, {}),
    ("sa:train:0", "weights", "z-tie", 50.0000002, False, {}),
]


def path(run: str, kind: str, name: str) -> str:
    return f"tinker://{run}/{kind}/{name}"


@pytest.fixture
def views(tmp_path: Path) -> RunViews:
    store = Store(tmp_path / "db.sqlite")
    for session, owner, project in (("sa", ALICE, "proj-a"), ("sb", ALICE, None), ("sc", BOB, "proj-b")):
        store.add_session(
            session, owner=owner, tags=[], user_metadata={}, project_id=project, display_name=None, sdk_version=None
        )
    for run, base in (("sa:train:0", "base-1"), ("sb:train:0", "base-2"), ("sc:train:0", "base-1")):
        store.add_model(
            run, session_id=run.partition(":")[0], model_seq_id=0, base_model=base, lora={"rank": 4}, user_metadata={}
        )
    for run, kind, name, at, public, metadata in ROWS:
        store.put_checkpoint(run, kind, name, size_bytes=1, ttl_seconds=None, user_metadata=metadata)
        store.update_checkpoint(run, kind, name, created_at=at, public=int(public))
    return RunViews(store)


def found(views: RunViews, caller: str = ALICE, **fields) -> list[str]:
    reply = views.search_checkpoints(CheckpointSearchRequest(**fields), caller)
    assert reply.next_cursor is None
    return [c.tinker_path for c in reply.checkpoints]


ALICE_ALL = [
    path("sb:train:0", "weights", "w"),
    path("sb:train:0", "external_weights", "e"),
    path("sa:train:0", "sampler_weights", "s1"),
    path("sa:train:0", "weights", "s1"),
    path("sa:train:0", "weights", "z-tie"),
    path("sa:train:0", "weights", "a-tie"),
]
BOB_PUBLISHED = [path("sc:train:0", "weights", "pub"), path("sc:train:0", "sampler_weights", "pub2")]


def test_owners_see_their_own_and_others_published_only(views: RunViews):
    assert found(views) == ALICE_ALL  # "own" by default, newest first
    accessible = found(views, owner={"type": "accessible"})
    assert accessible == [BOB_PUBLISHED[0], *ALICE_ALL[:4], BOB_PUBLISHED[1], *ALICE_ALL[4:]]
    assert found(views, owner={"type": "user", "owner_urns": [BOB]}) == BOB_PUBLISHED
    assert found(views, owner={"type": "user", "owner_urns": [ALICE, BOB]}) == accessible
    assert found(views, owner={"type": "user", "owner_urns": ["nobody"]}) == []
    # bob sees all of his own, unpublished too, and nothing of alice's (she published none)
    assert len(found(views, BOB)) == 3 and found(views, BOB, owner={"type": "user", "owner_urns": [ALICE]}) == []
    assert path("sc:train:0", "weights", "priv") not in found(views, owner={"type": "accessible"}, limit=200)


def test_filters(views: RunViews):
    everyone = {"owner": {"type": "accessible"}}
    assert found(views, **everyone, user_metadata={"k": "1"}) == ALICE_ALL[2:4]  # not bob's unpublished one
    assert found(views, **everyone, user_metadata={"k": "1", "x": "y"}) == ALICE_ALL[2:3]
    assert found(views, **everyone, user_metadata={"k": "2"}) == []
    assert found(views, **everyone, checkpoint_type="external") == ALICE_ALL[1:2]
    assert found(views, **everyone, checkpoint_type="sampler") == [ALICE_ALL[2], BOB_PUBLISHED[1]]
    base_1 = [BOB_PUBLISHED[0], ALICE_ALL[2], ALICE_ALL[3], BOB_PUBLISHED[1], *ALICE_ALL[4:]]
    assert found(views, **everyone, base_models=["base-1"]) == base_1
    assert found(views, **everyone, base_models=["base-1", "base-2"]) == found(views, **everyone)
    assert found(views, **everyone, base_models=[]) == [] and found(views, base_models=["none"]) == []
    # projects are the caller's own: with them, another key's published checkpoints match none
    assert found(views, **everyone, project_ids=["proj-a"]) == ALICE_ALL[2:]
    assert found(views, owner={"type": "user", "owner_urns": [BOB]}, project_ids=["default"]) == []
    assert found(views, project_ids=["default"]) == ALICE_ALL[:2]  # sessions made without a project
    for unknown in ("proj-b", "nowhere"):  # bob's project is no more alice's than one never made
        with pytest.raises(ApiError) as e:
            found(views, **everyone, project_ids=["proj-a", unknown])
        assert e.value.status == 404 and e.value.detail == f"project_ids: {unknown!r} is not a project of yours"


def test_pages_visit_every_checkpoint_once_in_order(views: RunViews):
    everyone = {"owner": {"type": "accessible"}}
    whole = found(views, **everyone)
    for limit in (1, 2, 3):
        seen, cursor = [], None
        for _ in range(len(whole) + 1):
            reply = views.search_checkpoints(CheckpointSearchRequest(**everyone, limit=limit, cursor=cursor), ALICE)
            seen += [c.tinker_path for c in reply.checkpoints]
            cursor = reply.next_cursor and reply.next_cursor.model_dump()
            if cursor is None:
                break
            assert cursor["last_checkpoint_uuid"] == seen[-1]
        assert seen == whole, limit
    # the cursor's time in another zone is the same instant
    first = views.search_checkpoints(CheckpointSearchRequest(limit=1), ALICE).next_cursor.model_dump()
    parsed = CheckpointSearchRequest(cursor=first).cursor
    elsewhere = {**first, "last_created_at": parsed.last_created_at.astimezone(timezone(timedelta(hours=5)))}
    assert found(views, cursor=elsewhere) == ALICE_ALL[1:]


def test_bad_owners_and_bad_fields(views: RunViews):
    for owner, field in (({"type": "own", "owner_urns": [ALICE]}, "owner_urns"), ({"type": "user"}, "owner_urns")):
        with pytest.raises(ApiError) as e:
            found(views, owner=owner)
        assert e.value.status == 400 and field in e.value.detail
    for fields, field in (
        ({"limit": 0}, "limit"),
        ({"limit": 201}, "limit"),
        ({"checkpoint_type": "weights"}, "checkpoint_type"),
        ({"owner": {"type": "user", "owner_urns": [f"k{i}" for i in range(11)]}}, "owner_urns"),
        ({"cursor": {"last_created_at": "2025-01-01T00:00:00", "last_checkpoint_uuid": "x"}}, "last_created_at"),
        ({"base_model": ["base-1"]}, "base_model"),
    ):
        with pytest.raises(ValidationError, match=field):
            CheckpointSearchRequest(**fields)


def test_every_checkpoint_row_carries_its_run_s_base_model(views: RunViews):
    store = views.store
    assert store.get_checkpoint("sb:train:0", "weights", "w").base_model == "base-2"
    assert {c.base_model for c in store.list_checkpoints("sc:train:0")} == {"base-1"}
    assert {c.base_model for c in store.owned_checkpoints(ALICE)} == {"base-1", "base-2"}
    assert {c.base_model for c in store.expired_checkpoints(float("inf"))} == set()  # none expires
    store.update_checkpoint("sa:train:0", "weights", "s1", expires_at=1.0)
    assert [c.base_model for c in store.expired_checkpoints(2.0)] == ["base-1"]
    assert views.list_checkpoints("sb:train:0").checkpoints[0].base_model == "base-2"
    assert views.list_owned_checkpoints(ALICE, 100, 0).checkpoints[0].base_model == "base-2"
    run = views.run_json(store.get_model("sa:train:0"))
    assert run.last_checkpoint.base_model == run.last_sampler_checkpoint.base_model == "base-1"
