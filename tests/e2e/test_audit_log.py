"""``AdminClient.get_audit_log`` through the real SDKs with two keys: a key's checkpoints created,
published, read by the other key (loaded, sampled through Tinker and /v1, described), unpublished
and deleted, and its sessions moved between projects, each with who did it; the reader sees its
own reads and nothing else of the owner's; event types filter."""

from __future__ import annotations

from datetime import date

import openai
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS
from tests.support.tenants import datum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def events(log: types.AuditLogResponse) -> list[tuple[str, str | None, str | None]]:
    return [(e.event, e.event_details.get("actor"), e.event_details.get("purpose")) for e in log.entries]


def test_what_was_done_to_a_keys_checkpoints_and_by_whom(keyed) -> None:
    srv, key_a, key_b = keyed
    admin_a = tinker.AdminClient(base_url=srv.base_url, api_key=key_a)
    admin_b = tinker.AdminClient(base_url=srv.base_url, api_key=key_b)
    before_a, before_b = len(admin_a.get_audit_log().result().entries), len(admin_b.get_audit_log().result().entries)
    rest_a = tinker.RestClient(base_url=srv.base_url, api_key=key_a)
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key_a) as alice:
        tc = alice.create_lora_training_client(base_model=ALIAS, rank=4, seed=9).result()
        tc.forward_backward([datum()], "cross_entropy").result()
        state = tc.save_state("audited").result().path
        weights = tc.save_weights_for_sampler("audited").result().path
        alice.create_training_client_from_state(state).result()  # the owner's own read: no event
        rest_a.publish_checkpoint_from_tinker_path(state).result()
        rest_a.publish_checkpoint_from_tinker_path(weights).result()
        with tinker.ServiceClient(base_url=srv.base_url, api_key=key_b) as bob:
            bob.create_training_client_from_state(state).result()
            bob.create_sampling_client(model_path=weights).result()
            for _ in range(3):  # one entry a day per checkpoint and purpose, however many calls
                tinker.RestClient(base_url=srv.base_url, api_key=key_b).get_weights_info_by_tinker_path(state).result()
        openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key_b).completions.create(
            model=state, prompt=[5, 6], max_tokens=2
        )
        rest_a.unpublish_checkpoint_from_tinker_path(weights).result()
        rest_a.delete_checkpoint_from_tinker_path(weights).result()
        rest_a.assign_session_project(alice.holder.get_session_id(), "audited-project").result()

    log_a = admin_a.get_audit_log().result()
    got = events(log_a)[before_a:]
    actor_a = got[0][1]  # the keys' ids
    actor_b = next(actor for _, actor, purpose in got if purpose is not None)
    assert actor_a and actor_b and actor_a != actor_b
    assert got == [
        ("checkpoint_create", actor_a, None),
        ("checkpoint_create", actor_a, None),
        ("checkpoint_publish", actor_a, None),
        ("checkpoint_publish", actor_a, None),
        ("checkpoint_read", actor_b, "load"),
        ("checkpoint_read", actor_b, "sample"),
        ("checkpoint_read", actor_b, "describe"),  # once, though asked three times
        ("checkpoint_read", actor_b, "sample"),  # /v1, by path
        ("checkpoint_unpublish", actor_a, None),
        ("checkpoint_delete", actor_a, None),
        ("project_session_assign", actor_a, None),
    ]
    read = next(e for e in log_a.entries if e.event == "checkpoint_read")
    assert (read.tinker_path, read.purpose, read.model_id) == (state, "load", state.split("/")[2])
    assert [e.event for e in admin_a.get_audit_log(event_type="projects").result().entries][-1:] == [
        "project_session_assign"
    ]
    assert all(
        e.event.startswith("checkpoint_") for e in admin_a.get_audit_log(event_type="checkpoints").result().entries
    )
    assert admin_a.get_audit_log(event_type="teams").result().entries == []
    assert (
        admin_a.get_audit_log(day=date.max).result().entries
        == admin_a.get_audit_log(day=date.min).result().entries
        == []
    )

    # the reader sees its reads, and none of the owner's own doings
    assert [(event, purpose) for event, _, purpose in events(admin_b.get_audit_log().result())[before_b:]] == [
        ("checkpoint_read", "load"),
        ("checkpoint_read", "sample"),
        ("checkpoint_read", "describe"),
        ("checkpoint_read", "sample"),
    ]
