"""``RestClient.search_sessions`` through the real SDK: filters, statuses, checkpoint counts and
cursor paging over one key's sessions."""

from __future__ import annotations

import uuid

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, ServerProcess
from tests.support.sessions import search

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_search_filters_and_pages(server: ServerProcess) -> None:
    suite = uuid.uuid4().hex  # the shared server holds other tests' sessions too
    clients = [
        tinker.ServiceClient(
            base_url=server.base_url,
            user_metadata={"suite": suite, "i": str(i)},
            project_id="proj-a" if i < 3 else None,
            display_name=f"Nightly run {i}" if i % 2 == 0 else f"adhoc {i}",
        )
        for i in range(5)
    ]
    ids = [c.holder.get_session_id() for c in clients]
    tc = clients[4].create_lora_training_client(base_model=ALIAS, rank=4).result()
    tc.save_state("one").result()
    tc.save_weights_for_sampler("two").result()
    for c in clients[:2]:
        c.close("success").result()
    rest = clients[4].create_rest_client()
    mine = {"suite": suite}
    try:
        everything = search(rest, user_metadata=mine)
        assert [s.session_id for s in everything.sessions] == ids[::-1]  # newest first
        assert everything.next_cursor is None
        newest = everything.sessions[0]
        assert newest.checkpoints_count == 2 and newest.project_id == "default"
        assert newest.display_name == "Nightly run 4" and newest.user_metadata == {"suite": suite, "i": "4"}
        assert newest.status.type == "active"
        assert everything.sessions[-1].status.type == "client_finished"
        assert everything.sessions[-1].status.reason.type == "success"

        # pages of two, by cursor: every session once, in order
        seen, cursor = [], None
        for _ in range(5):
            page = search(rest, user_metadata=mine, limit=2, cursor=cursor)
            seen += [s.session_id for s in page.sessions]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert seen == ids[::-1]

        def found(**fields) -> list[str]:
            return [s.session_id for s in search(rest, **{"user_metadata": mine, **fields}).sessions]

        assert found(display_name="NIGHTLY run") == [ids[4], ids[2], ids[0]]  # words, any case
        assert found(display_name="nightly 2", session_id=ids[1]) == [ids[2], ids[1]]  # either one
        assert found(user_metadata={"suite": suite, "i": "3"}) == [ids[3]]
        assert found(project_ids=["proj-a"]) == [ids[2], ids[1], ids[0]]
        assert found(statuses=[types.ActiveSessionStatusQuery()]) == [ids[4], ids[3], ids[2]]
        finished = types.ClientFinishedSessionStatusQuery(reasons=["success"])
        assert found(statuses=[finished]) == [ids[1], ids[0]]
        assert found(statuses=[types.FailedSessionStatusQuery()]) == []
        assert found(owner=types.UserSearchOwner(owner_urns=["someone-else"])) == []
        assert found(owner=types.AccessibleSearchOwner()) == ids[::-1]
        with pytest.raises(tinker.NotFoundError, match="proj-never"):
            search(rest, project_ids=["proj-never"])
        r = httpx.post(f"{server.base_url}/api/v1/sessions/search", json={"limit": 0}, headers={"X-API-Key": "tml-x"})
        assert r.status_code == 422 and "limit" in r.text
    finally:
        for c in clients[2:]:
            c.close("success").result()
