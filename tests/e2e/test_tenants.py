"""API keys and tenant isolation, end to end: keys made with the CLI, the real SDKs, raw HTTP.

Tenant A trains, saves, samples; tenant B then names every one of A's ids and paths on every
endpoint that takes one, and must get a 404 with a body each time, while the same request with
A's key is not a 404 (so the 404 is about ownership, not a malformed probe).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, ServerProcess, start_server
from tests.support.tenants import cli, datum, result
from tests.support.wire import fwdbwd_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def http(srv: ServerProcess, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=srv.base_url, headers={"X-API-Key": key} if key else {}, timeout=60)


def test_keys_are_created_listed_and_stored_as_hashes(keyed):
    srv, key_a, key_b = keyed
    assert key_a.startswith("tml-") and len(key_a) > 40 and key_a != key_b
    listing = cli("keys", "list", "--data-dir", str(srv.data_dir))
    assert "alice" in listing and "bob" in listing and "active" in listing
    assert key_a not in listing and key_a not in (srv.data_dir / "hosted_tinker.sqlite").read_bytes().decode("latin1")


def test_requests_without_a_valid_key_get_401_with_a_body(keyed):
    srv, key_a, _ = keyed
    for key in (None, "tml-not-a-key", "sk-wrong"):
        with http(srv, key) as c:
            r = c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"})
            assert r.status_code == 401 and "API key" in r.json()["detail"], r.text
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = c.get("/api/v1/training_runs")
            assert r.status_code == 401 and r.json()["detail"]
            for door in ("/v1", "/oai/api/v1"):
                r = c.post(f"{door}/completions", json={"model": ALIAS, "prompt": "hi", "max_tokens": 1})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            for door in ("/v1", "/anthropic/api/v1"):  # Anthropic's shape, with its type for a 401
                r = c.post(f"{door}/messages", json={"model": ALIAS, "max_tokens": 1, "messages": []})
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    with http(srv, None) as c:  # health stays open for `curl /healthz`
        health = c.get("/healthz").json()
        assert health["status"] == "ok" and health["auth"] == {"mode": "api-keys"}
        # The API's description is for key holders (--public-docs opens it).
        assert c.get("/openapi.json").status_code == 401 and c.get("/docs").status_code == 401
        assert c.get("/metrics").status_code == 401  # it names every tenant's models (--public-metrics opens it)
    with http(srv, key_a) as c:
        assert c.get("/openapi.json").json()["info"]["title"] == "hosted-tinker"
        assert "hosted_tinker_requests_total" in c.get("/metrics").text
    with pytest.raises(tinker.AuthenticationError):
        with tinker.ServiceClient(base_url=srv.base_url, api_key="tml-wrong") as sc:
            sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
    with openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="tml-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key_a, max_retries=0) as client:  # Bearer
        answer = client.completions.create(model=ALIAS, prompt="hi", max_tokens=2)
        # sampled: the tiny model may end at once (EOS is 1 of its 512 tokens)
        assert 1 <= answer.usage.completion_tokens <= 2 and answer.choices[0].finish_reason in ("length", "stop")


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def test_an_anonymous_request_costs_its_headers_only(keyed):
    """Authentication comes first, from the headers: no body is read or parsed for a request
    without a valid key (a malformed one is a 401, not a 422), and a 50 MiB upload is refused
    before its first byte is sent, its connection closed."""
    srv, _, _ = keyed
    with http(srv, None) as c:
        r = c.post("/api/v1/create_session", content=b"{bad", headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and "API key" in r.json()["detail"]
    host, port = srv.base_url.removeprefix("http://").split(":")
    rss_before = _rss_kib(srv.proc.pid)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(
            b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            + f"Content-Length: {50 << 20}\r\n\r\n".encode()
        )
        conn.sendall(b"\0" * 65536)  # the start of the body; the rest is never sent
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    # Bounds far below --body-timeout's 30 s, which a server waiting for the body would take, and
    # loose enough for a 2-core box running two test processes.
    assert time.monotonic() - started < 2
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
    assert _rss_kib(srv.proc.pid) - rss_before < 50 * 1024
    health_started = time.monotonic()
    assert httpx.get(f"{srv.base_url}/healthz").status_code == 200
    assert time.monotonic() - health_started < 1


def test_a_revoked_key_is_refused_at_once(keyed):
    srv, _, _ = keyed
    key = cli("keys", "create", "--data-dir", str(srv.data_dir), "--name", "carol")
    with http(srv, key) as c:
        assert c.get("/api/v1/training_runs").status_code == 200
        cli("keys", "revoke", "--data-dir", str(srv.data_dir), "carol")  # another process, server running
        r = c.get("/api/v1/training_runs")
        assert r.status_code == 401 and "revoked" in r.json()["detail"]
    assert "revoked" in cli("keys", "list", "--data-dir", str(srv.data_dir))


@pytest.fixture(scope="module")
def alice(keyed):
    """Tenant A's objects: a session, a trained model, checkpoints of each kind, samplers, a future."""
    srv, key_a, _ = keyed
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=key_a)
    tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=0).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    model_id = tc.get_info().model_id
    state_path = tc.save_state("a-state").result().path
    sampler_path = tc.save_weights_for_sampler("a-sampler").result().path
    ephemeral = tc.save_weights_and_get_sampling_client().result()
    ephemeral_id = ephemeral._sampling_session_id
    sampler = sc.create_sampling_client(model_path=sampler_path).result()
    sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)).result()
    with http(srv, key_a) as c:  # the SDK has no call for an external export: raw HTTP, on a raw model
        raw = c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        body = {"session_id": raw, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4}}
        raw_model = result(c, c.post("/api/v1/create_model", json=body).json()["request_id"])["model_id"]
        r = c.post("/api/v1/save_weights_external", json={"model_id": raw_model, "seq_id": 1, "path": "a-export"})
        export = result(c, r.json()["request_id"])["path"]
    objects = {
        "session_id": model_id.split(":train:")[0],
        "model_id": model_id,
        "state_path": state_path,
        "sampler_path": sampler_path,
        "export_path": export,
        "sampler_id": sampler._sampling_session_id,
        "ephemeral_id": ephemeral_id,
        "request_id": r.json()["request_id"],
    }
    yield objects


def probes(a: dict, b_session: str) -> list[tuple[str, str, dict]]:
    """(method, path, request kwargs) for every endpoint that takes an id or path, naming A's."""
    m, sid = a["model_id"], a["session_id"]
    run, ckpt = m, a["state_path"].split("/", 3)[3]  # tinker://RUN/weights/NAME -> weights/NAME
    export_run, export_ckpt = a["export_path"].removeprefix("tinker://").split("/", 1)
    post = "POST"
    return [
        (post, "/api/v1/session_heartbeat", {"json": {"session_id": sid}}),
        (
            post,
            "/api/v1/create_model",
            {"json": {"session_id": sid, "model_seq_id": 50, "base_model": ALIAS, "lora_config": {"rank": 4}}},
        ),
        (post, "/api/v1/get_info", {"json": {"model_id": m}}),
        (
            post,
            "/api/v1/forward_backward",
            {"content": fwdbwd_body(m, 200, length=8), "headers": {"Content-Type": "application/x-protobuf"}},
        ),
        (post, "/api/v1/optim_step", {"json": {"model_id": m, "seq_id": 201, "adam_params": {"learning_rate": 1e-4}}}),
        (post, "/api/v1/save_weights", {"json": {"model_id": m, "seq_id": 202, "path": "b-was-here"}}),
        (post, "/api/v1/save_weights_for_sampler", {"json": {"model_id": m, "seq_id": 203, "path": "b-s"}}),
        (post, "/api/v1/save_weights_external", {"json": {"model_id": m, "seq_id": 204, "path": "b-e"}}),
        (
            post,
            "/api/v1/load_weights",
            {"json": {"model_id": m, "seq_id": 205, "path": a["state_path"], "optimizer": False}},
        ),
        (
            post,
            "/api/v1/load_weights",
            {"json": {"session_id": b_session, "model_seq_id": 7, "path": a["state_path"], "optimizer": False}},
        ),
        (
            post,
            "/api/v1/create_sampling_session",
            {"json": {"session_id": sid, "sampling_session_seq_id": 90, "base_model": ALIAS}},
        ),
        (
            post,
            "/api/v1/create_sampling_session",
            {"json": {"session_id": b_session, "sampling_session_seq_id": 91, "model_path": a["sampler_path"]}},
        ),
        (
            post,
            "/api/v1/asample",
            {
                "json": {
                    "sampling_session_id": a["sampler_id"],
                    "num_samples": 1,
                    "prompt": {"chunks": [{"tokens": [5, 6]}]},
                    "sampling_params": {"max_tokens": 1},
                }
            },
        ),
        (
            post,
            "/api/v1/asample",
            {
                "json": {
                    "sampling_session_id": a["ephemeral_id"],
                    "num_samples": 1,
                    "prompt": {"chunks": [{"tokens": [5, 6]}]},
                    "sampling_params": {"max_tokens": 1},
                }
            },
        ),
        (post, "/api/v1/retrieve_future", {"json": {"request_id": a["request_id"]}}),
        (post, "/api/v1/cancel_future", {"json": {"request_id": a["request_id"]}}),
        (
            post,
            "/api/v1/retrieve_futures",
            {"json": {"target": {"sampling_session_id": a["sampler_id"]}, "timeout": 0}},
        ),
        (post, "/api/v1/join_sampling_session", {"json": {"sampling_session_id": a["sampler_id"]}}),
        ("GET", f"/api/v1/training_runs/{run}", {}),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints", {}),
        ("PUT", f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/ttl", {"json": {"ttl_seconds": 7200}}),
        (post, f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish", {}),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish", {}),
        (
            "GET",
            f"/api/v1/training_runs/{export_run}/checkpoints/{export_ckpt}/external_weights_urls",
            {},
        ),
        (post, "/api/v1/weights_info", {"json": {"tinker_path": a["state_path"]}}),
        ("GET", f"/api/v1/samplers/{a['sampler_id']}", {}),
        ("GET", f"/api/v1/sessions/{sid}", {}),
        (post, "/v1/completions", {"json": {"model": a["sampler_path"], "prompt": [5, 6], "max_tokens": 1}}),
        (post, "/v1/completions", {"json": {"model": a["ephemeral_id"], "prompt": [5, 6], "max_tokens": 1}}),
        (
            post,
            "/oai/api/v1/completions",
            {"json": {"model": f"{ALIAS};{a['sampler_path']}", "prompt": [5, 6], "max_tokens": 1}},
        ),
        (
            post,
            "/v1/chat/completions",
            {"json": {"model": a["sampler_path"], "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}},
        ),
        (
            post,
            "/anthropic/api/v1/messages",
            {"json": {"model": a["sampler_path"], "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}},
        ),
        (
            post,
            "/v1/messages/count_tokens",
            {"json": {"model": a["ephemeral_id"], "messages": [{"role": "user", "content": "hi"}]}},
        ),
        # Destructive ones last: A's control run of them would change A's objects.
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/{ckpt}", {}),
        (post, "/api/v1/unload_model", {"json": {"model_id": m}}),
        (post, f"/api/v1/sessions/{sid}/finish", {"json": {"reason": {"type": "success"}}}),
    ]


def test_another_tenant_gets_404_for_everything_of_ours(keyed, alice):
    srv, key_a, key_b = keyed
    with http(srv, key_b) as b, http(srv, key_a) as a:
        b_session = b.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        refused = []
        for method, path, kw in probes(alice, b_session):
            r = b.request(method, path, **kw)
            assert r.status_code == 404, f"B {method} {path}: {r.status_code} {r.text}"
            body = r.json()
            assert body.get("detail") or body.get("error", {}).get("message"), r.text
            refused.append(path)
        # B's listings show nothing of A's.
        assert alice["model_id"] not in b.get("/api/v1/training_runs").text
        assert alice["model_id"] not in b.get("/api/v1/checkpoints").text
        assert alice["session_id"] not in b.get("/api/v1/sessions").text
        assert (
            alice["model_id"] not in b.get("/v1/models").text and alice["ephemeral_id"] not in b.get("/v1/models").text
        )
        # The same requests from A are not 404s: the probes were well-formed, ownership refused them.
        for method, path, kw in probes(alice, b_session)[:-3]:
            if "load_weights" in path and "session_id" in kw["json"]:
                continue  # names B's session, which A does not own
            if "create_sampling_session" in path and kw["json"]["session_id"] == b_session:
                continue
            r = a.request(method, path, **kw)
            assert r.status_code != 404, f"A {method} {path}: {r.status_code} {r.text}"
        assert alice["model_id"] in a.get("/api/v1/training_runs").text
        assert alice["sampler_path"] in a.get("/v1/models").text
    print(f"isolation: {len(refused)} cross-tenant requests, all 404")


def test_a_published_checkpoint_is_readable_by_others_but_theirs_to_change(keyed):
    srv, key_a, key_b = keyed
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key_a) as sa:
        tc = sa.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
        tc.forward_backward([datum()], "cross_entropy").result()
        path = tc.save_state("shared").result().path
        rest_a = sa.create_rest_client()
        with tinker.ServiceClient(base_url=srv.base_url, api_key=key_b) as sb:
            with pytest.raises(tinker.NotFoundError):  # private: B cannot even see it
                sb.create_training_client_from_state(path).result()
            rest_a.publish_checkpoint_from_tinker_path(path).result()
            copy = sb.create_training_client_from_state(path).result()
            copy.forward_backward([datum()], "cross_entropy").result()
            assert copy.get_info().model_id.split(":train:")[0] != tc.get_info().model_id.split(":train:")[0]
            with pytest.raises(tinker.NotFoundError):
                sb.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
        assert path in {c.tinker_path for c in rest_a.list_checkpoints(tc.get_info().model_id).result().checkpoints}


def test_unpublishing_or_deleting_ends_other_keys_sampling_at_once(keyed):
    """B samples A's published weights (SDK and /v1); A unpublishes: B's next call is a 404, on
    both doors; published again, B samples again; A deletes: B's and A's own samplers 404."""
    srv, key_a, key_b = keyed
    prompt, params = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=2, stop=[])
    with (
        tinker.ServiceClient(base_url=srv.base_url, api_key=key_a) as sa,
        tinker.ServiceClient(base_url=srv.base_url, api_key=key_b) as sb,
    ):
        tc = sa.create_lora_training_client(base_model=ALIAS, rank=4, seed=2).result()
        path = tc.save_weights_for_sampler("to-share").result().path
        rest_a = sa.create_rest_client()
        rest_a.publish_checkpoint_from_tinker_path(path).result()
        own = sa.create_sampling_client(model_path=path).result()
        theirs = sb.create_sampling_client(model_path=path).result()
        assert theirs.sample(prompt, 1, params).result().sequences
        b_openai = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key_b)

        def b_completion() -> int:
            try:
                b_openai.completions.create(model=theirs._sampling_session_id, prompt="hi", max_tokens=2)
                return 200
            except openai.NotFoundError:
                return 404

        assert b_completion() == 200

        rest_a.unpublish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError, match="its owner no longer publishes"):
            theirs.sample(prompt, 1, params).result()
        assert b_completion() == 404
        assert own.sample(prompt, 1, params).result().sequences  # the owner's is untouched

        rest_a.publish_checkpoint_from_tinker_path(path).result()
        assert theirs.sample(prompt, 1, params).result().sequences
        rest_a.delete_checkpoint_from_tinker_path(path).result()
        for sampler in (theirs, own):
            with pytest.raises(tinker.NotFoundError):
                sampler.sample(prompt, 1, params).result()
        assert b_completion() == 404


def test_a_download_link_serves_only_the_version_it_was_made_for(keyed):
    """An export deleted and made again under the same name is a new version: links to the old
    one answer 404 (without a key, as links are used), links to the new one serve it."""
    srv, key_a, _ = keyed
    with http(srv, key_a) as c, httpx.Client(timeout=30) as anonymous:
        session = c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4}}
        model = result(c, c.post("/api/v1/create_model", json=body).json()["request_id"])["model_id"]

        def export(seq_id: int) -> dict[str, str]:
            r = c.post("/api/v1/save_weights_external", json={"model_id": model, "seq_id": seq_id, "path": "again"})
            run, checkpoint = result(c, r.json()["request_id"])["path"].removeprefix("tinker://").split("/", 1)
            return c.get(f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}/external_weights_urls").json()["urls"]

        old = export(1)
        assert all(anonymous.get(url).status_code == 200 for url in old.values())
        renamed = next(iter(old.values())).rsplit("/", 1)[0] + "/page.html"  # served as another name
        assert anonymous.get(renamed).status_code == 404
        assert c.delete(f"/api/v1/training_runs/{model}/checkpoints/external_weights/again").status_code == 204
        assert {anonymous.get(url).status_code for url in old.values()} == {404}
        new = export(2)
        assert set(new) == set(old) and new != old
        for name, url in old.items():
            stale = anonymous.get(url)
            assert stale.status_code == 404 and "no such download" in stale.text
            assert anonymous.get(new[name]).status_code == 200


def test_dev_mode_accepts_any_tml_key_and_isolates_each(tmp_path: Path, tiny_model_dir: Path):
    srv = start_server(tmp_path, "--model", str(tiny_model_dir), "--dev-any-key")
    try:
        with http(srv, None) as anon, http(srv, "tml-dev-one") as one, http(srv, "tml-dev-two") as two:
            assert anon.get("/api/v1/training_runs").status_code == 401
            assert one.get("/api/v1/training_runs").status_code == 200
            sid = one.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
            assert two.get(f"/api/v1/sessions/{sid}").status_code == 404
            assert one.get(f"/api/v1/sessions/{sid}").status_code == 200
            assert anon.get("/healthz").json()["auth"] == {"mode": "dev-any-key"}
        assert "development only" in srv.log_path.read_text()
    finally:
        srv.stop()


def test_open_server_on_a_public_address_warns(tmp_path: Path, tiny_model_dir: Path):
    srv = start_server(tmp_path, "--model", str(tiny_model_dir), "--host", "0.0.0.0")
    try:
        assert httpx.get(f"{srv.base_url}/healthz").json()["auth"] == {"mode": "open"}
    finally:
        srv.stop()
    assert "no API key configured" in srv.log_path.read_text()


def test_the_anthropic_sdk_sends_its_key_as_x_api_key_and_sees_only_its_own(keyed, alice):
    srv, key_a, key_b = keyed
    hi = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

    def client(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=f"{srv.base_url}/anthropic/api", api_key=key, max_retries=0)

    assert client(key_a).messages.create(model=alice["sampler_path"], **hi).usage.output_tokens >= 1
    with pytest.raises(anthropic.NotFoundError):
        client(key_b).messages.create(model=alice["sampler_path"], **hi)
    with pytest.raises(anthropic.NotFoundError):
        client(key_b).messages.count_tokens(model=f"{ALIAS};{alice['sampler_path']}", messages=hi["messages"])
    with pytest.raises(anthropic.AuthenticationError):
        client("tml-not-a-key").messages.create(model=ALIAS, **hi)
