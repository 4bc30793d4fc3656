"""Projects, access scopes and the REST surface around them, through the real SDK with two keys:
``list_training_runs(project_id=..., access_scope=...)``, ``assign_session_project``, what
another key sees of a run once a checkpoint of it is published, ``AdminClient``'s checkpoint
storage, the detail a client gives when it closes, and a copied run's last request time."""

from __future__ import annotations

import warnings
from datetime import UTC, datetime

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS
from tests.support.sessions import search
from tests.support.tenants import datum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_ids(runs: types.TrainingRunsResponse) -> set[str]:
    return {r.training_run_id for r in runs.training_runs}


def test_projects_scopes_and_storage(keyed) -> None:
    srv, key_a, key_b = keyed
    with (
        tinker.ServiceClient(base_url=srv.base_url, api_key=key_a, project_id="proj-a") as in_a,
        tinker.ServiceClient(base_url=srv.base_url, api_key=key_a) as unfiled,
    ):
        tc = in_a.create_lora_training_client(
            base_model=ALIAS, rank=4, seed=1, user_metadata={"private": "yes"}
        ).result()
        tc.forward_backward([datum()], "cross_entropy").result()
        state = tc.save_state("shared").result().path
        tc.save_weights_for_sampler("private").result()
        first = tc.get_info().model_id
        second = unfiled.create_lora_training_client(base_model=ALIAS, rank=4, seed=2).result().get_info().model_id
        rest = tinker.RestClient(base_url=srv.base_url, api_key=key_a)
        rest_b = tinker.RestClient(base_url=srv.base_url, api_key=key_b)

        # project_id filters; a session made without a project is in "default"
        assert run_ids(rest.list_training_runs(project_id="proj-a").result()) == {first}
        assert run_ids(rest.list_training_runs(project_id="default").result()) == {second}
        assert run_ids(rest.list_training_runs(project_id="nowhere").result()) == set()
        assert run_ids(rest.list_training_runs().result()) == {first, second}

        # a session moves to another project, with its runs
        rest.assign_session_project(unfiled.holder.get_session_id(), "proj-b").result()
        assert run_ids(rest.list_training_runs(project_id="proj-b").result()) == {second}
        moved = search(rest, project_ids=["proj-b"]).sessions
        assert [s.session_id for s in moved] == [unfiled.holder.get_session_id()]
        with pytest.raises(tinker.NotFoundError):  # not bob's to move
            rest_b.assign_session_project(unfiled.holder.get_session_id(), "proj-c").result()
        with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": key_a}) as c:
            for bad in ("", "   ", "a\nb", "x" * 129):
                moved = c.put(f"/api/v1/sessions/{unfiled.holder.get_session_id()}/project", json={"project_id": bad})
                assert moved.status_code == 400 and "project_id" in moved.json()["detail"], bad
            made = c.post("/api/v1/create_session", json={"project_id": "\x00", "tags": [], "sdk_version": "0.38.0"})
            assert made.status_code == 400 and "project_id" in made.json()["detail"]
            scope = c.get("/api/v1/training_runs", params={"access_scope": "everyone"})
            assert scope.status_code == 422 and "access_scope" in scope.text

        # another key: nothing of a run until a checkpoint of it is published, then that only
        for access_scope in ("owned", "accessible"):
            with pytest.raises(tinker.NotFoundError):
                rest_b.get_training_run(first, access_scope=access_scope).result()
        rest.publish_checkpoint_from_tinker_path(state).result()
        with pytest.raises(tinker.NotFoundError):
            rest_b.get_training_run(first).result()  # "owned" is bob's own
        seen = rest_b.get_training_run(first, access_scope="accessible").result()
        assert seen.last_checkpoint.tinker_path == state and seen.last_sampler_checkpoint is None
        assert seen.user_metadata == {} and seen.last_request_time == seen.last_checkpoint.time  # nothing private
        assert run_ids(rest_b.list_training_runs(access_scope="accessible", project_id="proj-a").result()) == set()
        assert [c.tinker_path for c in rest_b.list_checkpoints(first).result().checkpoints] == [state]
        assert len(rest.list_checkpoints(first).result().checkpoints) == 2  # the owner sees both
        assert first in run_ids(rest_b.list_training_runs(access_scope="accessible").result())
        assert run_ids(rest_b.list_training_runs().result()) == set()

        # checkpoint storage, per project, of the key's own checkpoints only
        admin = tinker.AdminClient(base_url=srv.base_url, api_key=key_a)
        usage = admin.get_current_checkpoint_storage_usage().result()
        assert usage.effective_rate_usd_per_gigabyte_month is None  # nobody is billed
        (row,) = usage.data
        assert (row.project_id, row.checkpoint_count, row.user_name) == ("proj-a", 2, "alice")
        assert row.size_bytes > 0 and row.size_gigabytes == row.size_bytes / 1e9
        assert admin.get_current_checkpoint_storage_usage(project_id="proj-b").result().data == []
        assert (
            tinker.AdminClient(base_url=srv.base_url, api_key=key_b)
            .get_current_checkpoint_storage_usage()
            .result()
            .data
            == []
        )

        # a copy's run was last asked for when it was made, not in 1970
        copied = tinker.ServiceClient(base_url=srv.base_url, api_key=key_a, project_id="proj-a")
        try:
            path = copied.copy_weights(state).result()
        finally:
            copied.close("success").result()
        copy_run = rest.get_training_run_by_tinker_path(path).result()
        assert copy_run.last_request_time > datetime(2026, 1, 1, tzinfo=UTC)


def test_a_closing_client_says_why(keyed) -> None:
    srv, key_a, _ = keyed
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=key_a, user_metadata={"why": "closing"})
    session_id = sc.holder.get_session_id()
    sc.close("errored", detail="the reward model went away").result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (found,) = search(tinker.RestClient(base_url=srv.base_url, api_key=key_a), session_id=session_id).sessions
    assert found.status.type == "client_finished" and found.status.reason.type == "errored"
    assert found.status.detail == "the reward model went away"
