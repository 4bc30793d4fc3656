"""``RestClient.search_checkpoints`` (SDK 0.39) and ``Checkpoint.base_model``, on a server with two
keys: checkpoints made through the real SDK 0.38, searched over HTTP (0.38 has no
``search_checkpoints``; 0.39 is not installable here, so its types are mirrored below from the
service's API reference). Order, every filter, owners, cursor pages, and that another key's
unpublished checkpoints never show."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from pydantic import AwareDatetime, BaseModel, ConfigDict
from tinker import types

from tests.support.server import ALIAS
from tests.support.tenants import datum, serve_two_keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SEARCH = "/api/v1/checkpoints/search"
STRICT = ConfigDict(frozen=True, extra="forbid")  # exactly 0.39's fields, no more


class Checkpoint(types.Checkpoint):  # 0.39 adds the run's base model
    model_config = STRICT
    base_model: str | None = None


class CheckpointSearchCursor(BaseModel):
    model_config = STRICT
    last_created_at: AwareDatetime
    last_checkpoint_uuid: str


class CheckpointSearchResponse(BaseModel):
    model_config = STRICT
    checkpoints: list[Checkpoint]
    next_cursor: CheckpointSearchCursor | None = None


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    """A server of this module's own: a published checkpoint is every key's to find, and the
    searches below expect exactly the checkpoints made here (not the shared server's others)."""
    srv, key_a, key_b = serve_two_keys(tmp_path_factory.mktemp("search"), tiny_model_dir)
    yield srv, key_a, key_b
    srv.stop()


def test_search_checkpoints_and_their_base_model(keyed) -> None:
    srv, key_a, key_b = keyed
    alice = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": key_a}, timeout=30)
    bob = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": key_b}, timeout=30)
    seen_by_alice: set[str] = set()

    def search(client: httpx.Client, **body) -> CheckpointSearchResponse:
        r = client.post(SEARCH, json=body)
        assert r.status_code == 200, r.text
        reply = CheckpointSearchResponse.model_validate(r.json())
        if client is alice:
            seen_by_alice.update(c.tinker_path for c in reply.checkpoints)
        return reply

    def found(client: httpx.Client = alice, **body) -> list[str]:
        reply = search(client, **body)
        assert reply.next_cursor is None
        return [c.tinker_path for c in reply.checkpoints]

    with (
        tinker.ServiceClient(base_url=srv.base_url, api_key=key_a, project_id="proj-a") as in_a,
        tinker.ServiceClient(base_url=srv.base_url, api_key=key_a) as unfiled,
        tinker.ServiceClient(base_url=srv.base_url, api_key=key_b, project_id="proj-b") as bobs,
    ):
        tc = in_a.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
        tc.forward_backward([datum()], "cross_entropy").result()
        a1 = tc.save_state("a1", user_metadata={"stage": "warm", "pick": "yes"}).result().path
        a2 = tc.save_weights_for_sampler("a2", user_metadata={"stage": "warm"}).result().path
        tc_unfiled = unfiled.create_lora_training_client(base_model=ALIAS, rank=4, seed=2).result()
        a3 = tc_unfiled.save_weights_external("a3").result().path
        tb = bobs.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
        b_pub = tb.save_state("b-pub", user_metadata={"stage": "warm"}).result().path
        b_priv = tb.save_weights_for_sampler("b-priv", user_metadata={"stage": "warm"}).result().path
        rest = tinker.RestClient(base_url=srv.base_url, api_key=key_a)
        rest_b = tinker.RestClient(base_url=srv.base_url, api_key=key_b)
        rest_b.publish_checkpoint_from_tinker_path(b_pub).result()
        run_a, run_b = tc.get_info().model_id, tb.get_info().model_id
        base = rest.get_training_run(run_a).result().base_model
        alice_urn = rest.get_training_run(run_a).result().model_owner
        bob_urn = rest_b.get_training_run(run_b).result().model_owner
        assert alice_urn != bob_urn

        # owners: one's own (the default), and of another key only what it published
        mine = [a3, a2, a1]  # newest first
        everyone = [b_pub, *mine]
        own = search(alice)
        assert [c.tinker_path for c in own.checkpoints] == mine and own.next_cursor is None
        assert [c.checkpoint_type for c in own.checkpoints] == ["external", "sampler", "training"]
        assert own.checkpoints[2].user_metadata == {"stage": "warm", "pick": "yes"}
        assert all(c.base_model == base for c in own.checkpoints)
        assert found(owner={"type": "own"}) == mine
        accessible = search(alice, owner={"type": "accessible"})
        assert [c.tinker_path for c in accessible.checkpoints] == everyone
        assert accessible.checkpoints[0].public and accessible.checkpoints[0].base_model == base
        assert found(owner={"type": "user", "owner_urns": [bob_urn]}) == [b_pub]
        assert found(owner={"type": "user", "owner_urns": [alice_urn, bob_urn]}) == everyone
        assert found(owner={"type": "user", "owner_urns": [alice_urn]}) == mine
        assert found(owner={"type": "user", "owner_urns": ["nobody"]}) == []
        assert found(bob) == [b_priv, b_pub]
        assert found(bob, owner={"type": "accessible"}) == [b_priv, b_pub]  # alice has published nothing yet
        rest.publish_checkpoint_from_tinker_path(a1).result()
        assert found(bob, owner={"type": "accessible"}) == [b_priv, b_pub, a1]
        assert found(bob, owner={"type": "user", "owner_urns": [alice_urn]}) == [a1]

        # filters
        warm = {"owner": {"type": "accessible"}, "user_metadata": {"stage": "warm"}}
        assert found(**warm) == [b_pub, a2, a1]
        assert found(**{**warm, "user_metadata": {"stage": "warm", "pick": "yes"}}) == [a1]
        assert found(**{**warm, "user_metadata": {"stage": "cold"}}) == []
        for kind, paths in (("training", [b_pub, a1]), ("sampler", [a2]), ("external", [a3])):
            assert found(owner={"type": "accessible"}, checkpoint_type=kind) == paths
        assert found(owner={"type": "accessible"}, base_models=[base, "other/model"]) == everyone
        assert found(owner={"type": "accessible"}, base_models=["other/model"]) == []
        assert found(owner={"type": "accessible"}, base_models=[]) == []  # an empty list matches none
        # projects are the caller's own: another key's published checkpoints are in none of them
        assert found(owner={"type": "accessible"}, project_ids=["proj-a"]) == [a2, a1]
        assert found(project_ids=["default", "proj-a"]) == mine
        assert found(owner={"type": "user", "owner_urns": [bob_urn]}, project_ids=["proj-a"]) == []
        for unknown in ("proj-b", "proj-never"):  # bob's project name is as unknown to alice as any
            r = alice.post(SEARCH, json={"owner": {"type": "accessible"}, "project_ids": [unknown]})
            assert r.status_code == 404 and r.json()["detail"] == f"project_ids: {unknown!r} is not a project of yours"

        # pages: each checkpoint once, in order; the cursor passed back as the SDK would send it
        for limit in (1, 3):
            paths, cursor = [], None
            for _ in range(len(everyone) + 1):
                page = search(alice, owner={"type": "accessible"}, limit=limit, cursor=cursor)
                paths += [c.tinker_path for c in page.checkpoints]
                if page.next_cursor is None:
                    break
                assert page.next_cursor.last_checkpoint_uuid == paths[-1]
                cursor = page.next_cursor.model_dump(mode="json")
            assert paths == everyone, limit

        # bad input names its field
        for body, field in (
            ({"limit": 0}, "limit"),
            ({"limit": 201}, "limit"),
            ({"checkpoint_type": "weights"}, "checkpoint_type"),
            ({"owner": {"type": "user", "owner_urns": []}}, "owner_urns"),
            ({"cursor": {"last_created_at": "2025-01-01T00:00:00", "last_checkpoint_uuid": a1}}, "last_created_at"),
            ({"base_model": [base]}, "base_model"),
        ):
            r = alice.post(SEARCH, json=body)
            assert r.status_code == 422 and field in r.text, (body, r.text)
        for owner in ({"type": "own", "owner_urns": [alice_urn]}, {"type": "user"}):
            r = alice.post(SEARCH, json={"owner": owner})
            assert r.status_code == 400 and "owner_urns" in r.json()["detail"], r.text

        assert b_priv not in seen_by_alice and b_pub in seen_by_alice

        # base_model on every checkpoint row of every listing (the 0.38 SDK ignores it: raw JSON)
        rows = alice.get(f"/api/v1/training_runs/{run_a}/checkpoints").json()["checkpoints"]
        rows += alice.get("/api/v1/checkpoints").json()["checkpoints"]
        rows += bob.get(f"/api/v1/training_runs/{run_a}/checkpoints").json()["checkpoints"]  # a1, published
        run = alice.get(f"/api/v1/training_runs/{run_a}").json()
        rows += [run["last_checkpoint"], run["last_sampler_checkpoint"]]
        shared = bob.get(f"/api/v1/training_runs/{run_a}", params={"access_scope": "accessible"}).json()
        rows.append(shared["last_checkpoint"])
        assert len(rows) == 2 + 3 + 1 + 2 + 1
        assert all(row["base_model"] == base for row in rows), rows
        for row in rows:
            Checkpoint.model_validate(row)
        # and the 0.38 SDK still reads them
        assert [c.tinker_path for c in rest.list_checkpoints(run_a).result().checkpoints] == [a2, a1]
        assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == mine
        assert rest_b.get_training_run(run_a, access_scope="accessible").result().last_checkpoint.tinker_path == a1
    alice.close()
    bob.close()
