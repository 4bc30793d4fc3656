"""What an attacker's audit found in the operations surfaces (issue 38, items 6 and 7), each
reproduced against a real keyed server: a keyless flood must not rotate keyed lines out of the
request log; a key in the query string is never logged; ``/metrics`` shows a key only its own
models' series (an operator key every model's); a malformed link token is a 4xx; a download
link stops working when its checkpoint is unpublished, and a trace link when its key is revoked.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import ALIAS, ServerProcess, start_server
from tests.support.tenants import cli, result
from tests.support.wire import fwdbwd_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROTOBUF = {"Content-Type": "application/x-protobuf"}


@dataclass
class Keyed:
    server: ServerProcess
    keys: dict[str, str]  # name -> key
    ids: dict[str, str]  # name -> key id

    def http(self, name: str | None) -> httpx.Client:
        headers = {"X-API-Key": self.keys[name]} if name else {}
        return httpx.Client(base_url=self.server.base_url, headers=headers, timeout=60)


def make_keys(data: Path, *names: str) -> tuple[dict[str, str], dict[str, str]]:
    keys = {name: cli("keys", "create", "--data-dir", str(data), "--name", name) for name in names}
    listing = cli("keys", "list", "--data-dir", str(data)).splitlines()
    ids = {line.split()[-1]: line.split()[0] for line in listing if line.split()[-1] in names}
    return keys, ids


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    """alice (an operator), bob and carol."""
    data = tmp_path_factory.mktemp("hostile-ops")
    keys, ids = make_keys(data, "alice", "bob", "carol")
    srv = start_server(data, "--model", str(tiny_model_dir), "--console-operator", ids["alice"])
    yield Keyed(srv, keys, ids)
    srv.stop()


def raw_model(c: httpx.Client) -> str:
    """A training model made over plain HTTP (its next seq_id is 1)."""
    session = c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4}}
    return result(c, c.post("/api/v1/create_model", json=body).json()["request_id"])["model_id"]


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- the request log and the access log ---------------------------------------------------------


def test_a_keyless_flood_is_summarised_and_keyed_lines_survive(tmp_path: Path, tiny_model_dir: Path):
    """240 s of keyless 404s at 510/s rotated every keyed line out of requests.jsonl, and the
    access log (with ``?api_key=`` in it) grew without bound. Here: a keyed request, then 3,000
    keyless ones (404s, 401s, bad links, a key in the query string): the log grows by a bounded
    number of lines, the keyed line is there, the rest are counted in a summary line, and no log
    holds the key."""
    keys, ids = make_keys(tmp_path, "alice")
    # At --log-level info uvicorn's access log, if it were on, would print every request.
    srv = start_server(tmp_path, "--model", str(tiny_model_dir), "--log-level", "info")
    log_path = tmp_path / "requests.jsonl"
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as anonymous:
            keyed = anonymous.get("/api/v1/training_runs", headers={"X-API-Key": keys["alice"]})
            assert keyed.status_code == 200
            before = log_path.stat().st_size
            for i in range(1000):
                assert anonymous.get(f"/no-such-page-{i}").status_code == 404
                assert anonymous.get(f"/api/v1/no-such-route?api_key={keys['alice']}").status_code == 401
                assert anonymous.get(f"/api/v1/files/31/00/x?token=secret-{i}").status_code == 404
            grown = log_path.stat().st_size - before
            assert grown < 40_000, f"3,000 keyless requests wrote {grown} bytes of request log"
    finally:
        srv.stop()
    lines = log_lines(log_path)
    assert any(x.get("key_id") == ids["alice"] and x.get("route") == "/api/v1/training_runs" for x in lines)
    summaries = [x for x in lines if "suppressed" in x]
    counted = sum(x["suppressed"] for x in summaries)
    written = sum(1 for x in lines if "key_id" not in x and "suppressed" not in x)
    assert counted + written >= 3000  # every request is a line or counted in one
    groups = [g for x in summaries for g in x["groups"]]
    assert {g["status"] for g in groups} >= {401, 404} and all(g["client"] == "127.0.0.1" for g in groups)
    text = log_path.read_text() + srv.log_path.read_text()
    assert keys["alice"] not in text and "secret-1" not in text
    assert "no-such-page-999" not in srv.log_path.read_text()  # no access log by default


# ---- /metrics ------------------------------------------------------------------------------------


def queue_series(c: httpx.Client) -> dict[str, float]:
    """Each model's ``hosted_tinker_queue_depth`` in a scrape with ``c``'s key, and the total."""
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    series = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "hosted_tinker_queue_depth":
                series[sample.labels["model"]] = sample.value
            elif sample.name == "hosted_tinker_pending_requests":
                series[""] = sample.value
    return series


def test_metrics_show_a_key_its_own_models_and_an_operator_every_model(keyed: Keyed):
    """Any key could read every other key's model ids in ``queue_depth{model=...}``."""
    models = {}
    for name in ("alice", "bob"):
        with keyed.http(name) as c:
            models[name] = raw_model(c)  # its next seq_id is 1: a request for 2 waits in the queue
            r = c.post("/api/v1/forward_backward", content=fwdbwd_body(models[name], 2), headers=PROTOBUF)
            assert r.status_code == 200, r.text
    with keyed.http("bob") as bob, keyed.http("alice") as alice:
        seen_by_bob = queue_series(bob)
        assert seen_by_bob.get(models["bob"]) == 1.0
        assert models["alice"] not in seen_by_bob and not any(m.startswith(models["alice"][:12]) for m in seen_by_bob)
        assert seen_by_bob[""] >= 2.0  # what is queued over all keys, as one number
        seen_by_alice = queue_series(alice)  # an operator's key
        assert seen_by_alice.get(models["alice"]) == 1.0 and seen_by_alice.get(models["bob"]) == 1.0
        for name, c in (("alice", alice), ("bob", bob)):  # the awaited requests drain both queues
            assert c.post("/api/v1/forward_backward", content=fwdbwd_body(models[name], 1), headers=PROTOBUF).is_success
        deadline = time.monotonic() + 60
        while any(m in queue_series(alice) for m in models.values()):
            assert time.monotonic() < deadline, "the queues never drained"
            time.sleep(0.1)


# ---- links ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["files", "traces"])
@pytest.mark.parametrize(
    "token",
    [
        ("[" * 5000 + "]" * 5000).encode().hex(),  # a RecursionError in the JSON decoder: was a 500
        ("[" * 500 + "]" * 500).encode().hex(),
        "ff" * 40,  # not UTF-8
        "3",  # not hex
        "5b5d" * 10_000,  # 40 KB of [][]...
        json.dumps({"a": [1] * 3}).encode().hex(),
    ],
    ids=["deep", "nested", "not-utf8", "odd", "long", "object"],
)
def test_a_malformed_link_token_is_a_4xx(keyed: Keyed, kind: str, token: str):
    with keyed.http(None) as anonymous:
        r = anonymous.get(f"/api/v1/{kind}/{token}/00/x")
    assert 400 <= r.status_code < 500 and "detail" in r.json(), (r.status_code, r.text[:300])


def test_a_download_link_of_a_published_checkpoint_ends_with_its_publication(keyed: Keyed):
    """bob's links to alice's published export kept working for their hour after she unpublished."""
    with keyed.http("alice") as alice, keyed.http("bob") as bob, keyed.http(None) as anonymous:
        model = raw_model(alice)
        r = alice.post("/api/v1/save_weights_external", json={"model_id": model, "seq_id": 1, "path": "shared"})
        path = result(alice, r.json()["request_id"])["path"]
        run, checkpoint = path.removeprefix("tinker://").split("/", 1)
        links = f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}/external_weights_urls"
        assert alice.post(f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}/publish").status_code == 204
        bobs = bob.get(links).json()["urls"]
        alices = alice.get(links).json()["urls"]
        assert {anonymous.get(url).status_code for url in [*bobs.values(), *alices.values()]} == {200}
        assert alice.delete(f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}/publish").status_code == 204
        for url in bobs.values():
            stale = anonymous.get(url)
            assert stale.status_code == 404 and "no such download" in stale.text
        assert {anonymous.get(url).status_code for url in alices.values()} == {200}  # still hers


def test_a_trace_link_ends_with_its_key(keyed: Keyed):
    """A trace link kept working for its hour after the key that made it was revoked."""
    with keyed.http("carol") as carol, keyed.http(None) as anonymous:
        session = carol.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()
        url = carol.get(f"/api/v1/sessions/{session['session_id']}/trace_export").json()["url"]
        assert anonymous.get(url).status_code == 200
        cli("keys", "revoke", "--data-dir", str(keyed.server.data_dir), keyed.ids["carol"])
        revoked = anonymous.get(url)
        assert revoked.status_code == 404 and "no such download" in revoked.text


def test_a_links_fetches_are_held_to_its_keys_rate(keyed: Keyed):
    """From a review: a link's fetch carries no key on the wire, so it passed the rate check: a
    key at requests_per_s=10 fetched its trace link 2,000 times in 3 s, each a keyed line of the
    request log. A fetch is its key's request, in a bucket of its own (here 1/s, bursts of 10)."""
    data = keyed.server.data_dir
    key = cli("keys", "create", "--data-dir", str(data), "--name", "erin", "--limit=requests_per_s=1")
    with httpx.Client(base_url=keyed.server.base_url, headers={"X-API-Key": key}, timeout=30) as erin:
        session = erin.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()
        url = erin.get(f"/api/v1/sessions/{session['session_id']}/trace_export").json()["url"]
    with keyed.http(None) as anonymous:
        answers = [anonymous.get(url) for _ in range(30)]
    codes = [a.status_code for a in answers]
    assert codes[:10] == [200] * 10 and 429 in codes, codes
    assert "requests_per_s" in answers[-1].text
