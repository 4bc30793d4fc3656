"""Routes ordered by ``seq_id`` within their model, found by walking the served route table
(``x-ordered`` in ``/openapi.json``, declared with ``errors.ordered``), and every way each of
them can fail: the model's next seq_id must still run.

- the owner's request that fails (422 schema, 400 bad value, 404 checkpoint it may not read,
  413 body over ``--max-body-bytes``, 400 body that will not inflate or decode) uses its seq_id
  up: the next one runs, and a resend gets the original, failed, future. A 413 is answered
  without reading the body past its head, which names the seq_id (``protocol.ordering``);
- a stranger's (404) or an unauthenticated (401) request touches nothing of the model: the
  owner's request with that very seq_id then runs.

409 is not answered by any ordered route (the SDK retries a 409 for minutes).
"""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.support.server import ALIAS, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

OWNER, STRANGER = "tml-owner-0123456789abcdef", "tml-stranger-0123456789abcdef"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("ordered")
    keys = tmp / "keys.txt"
    keys.write_text(f"{OWNER}\n{STRANGER}\n")
    srv = start_server(
        tmp,
        "--model",
        str(tiny_model_dir),
        "--api-keys-file",
        str(keys),
        "--max-body-bytes",
        str(MAX_BODY),
        "--poll-timeout",
        "1",
    )
    owner = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": OWNER}, timeout=60)
    stranger = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": STRANGER}, timeout=60)
    anonymous = httpx.Client(base_url=srv.base_url, timeout=60)
    base = owner.get("/healthz").json()["served_models"][0]
    session = owner.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    created = owner.post(
        "/api/v1/create_model",
        json={"session_id": session, "model_seq_id": 0, "base_model": base, "lora_config": {"rank": 4}},
    )
    model = result(owner, created.json()["request_id"])["model_id"]
    model_env = Env(srv.base_url, owner, stranger, anonymous, model)
    saved = owner.post("/api/v1/save_weights", json={"model_id": model, "seq_id": model_env.next(), "path": "base"})
    model_env.checkpoint = result(owner, saved.json()["request_id"])["path"]
    yield model_env
    for client in (owner, stranger, anonymous):
        client.close()
    srv.stop()


class Env:
    def __init__(self, base_url: str, owner, stranger, anonymous, model: str) -> None:
        self.base_url, self.model = base_url, model
        self.owner, self.stranger, self.anonymous = owner, stranger, anonymous
        self.seq = 0
        self.checkpoint = ""

    def next(self) -> int:
        self.seq += 1
        return self.seq


def poll(client: httpx.Client, request_id: str) -> httpx.Response:
    return client.post("/api/v1/retrieve_future", json={"request_id": request_id})


def result(client: httpx.Client, request_id: str, deadline_s: float = 120.0) -> dict:
    """The finished result of a future (JSON), within a deadline: a wedged model fails here."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        r = poll(client, request_id)
        assert r.status_code == 200, r.text
        if "protobuf" in r.headers.get("content-type", ""):
            return {"protobuf": r.content}
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError(f"future {request_id} did not finish in {deadline_s}s: the model is wedged")


def ordered_operations(base_url: str) -> dict[str, str]:
    spec = httpx.get(f"{base_url}/openapi.json", headers={"X-API-Key": OWNER}, timeout=10).json()
    return {path: op["x-ordered"] for path, item in spec["paths"].items() for op in item.values() if "x-ordered" in op}


# ---- bodies per ordered route -------------------------------------------------------------


def fb_body(model: str, seq: int, loss_fn: str = "cross_entropy") -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn=loss_fn)
    return msg.SerializeToString()


def valid(env: Env, kind: str, seq: int) -> dict:
    common = {"model_id": env.model, "seq_id": seq}
    return {
        "optim_step": {**common, "adam_params": {"learning_rate": 1e-4}},
        "save_weights": {**common, "path": f"w{seq}"},
        "save_weights_for_sampler": {**common, "path": f"s{seq}"},
        "save_weights_external": {**common, "path": f"e{seq}"},
        "load_weights": {**common, "path": env.checkpoint, "optimizer": False},
    }[kind]


def bad_value(env: Env, kind: str, seq: int) -> tuple[dict, int]:
    """A body that validates but that the route refuses, and the status it answers."""
    body = valid(env, kind, seq)
    if kind == "optim_step":
        body["adam_params"] = {"learning_rate": -1.0}
    elif kind == "save_weights":
        body["path"] = "../escape"
    elif kind == "save_weights_for_sampler":
        body["kind"] = "inflight"
    elif kind == "save_weights_external":
        body["age_encryption_recipients"] = ["age1xyz"]
    elif kind == "load_weights":
        return {**body, "path": f"tinker://{env.model}/weights/never-saved"}, 404
    return body, 400


def send(env: Env, client: httpx.Client, path: str, kind: str, body) -> httpx.Response:
    if kind == "forward_backward":
        return client.post(path, content=body, headers={"Content-Type": "application/x-protobuf"})
    return client.post(path, json=body)


def good(env: Env, kind: str, seq: int):
    return fb_body(env.model, seq) if kind == "forward_backward" else valid(env, kind, seq)


def runs(env: Env, path: str, kind: str, seq: int) -> dict:
    """The owner's request ``seq`` is accepted and finishes. (A forward_backward's seq_id is
    taken by an optim_step: the model's order is one, whatever the request. So is a
    load_weights', which succeeds only as a model's first request.)"""
    if kind in ("forward_backward", "load_weights"):
        path, kind = "/api/v1/optim_step", "optim_step"
    r = send(env, env.owner, path, kind, good(env, kind, seq))
    assert r.status_code == 200, f"{path} seq {seq}: {r.status_code} {r.text}"
    return result(env.owner, r.json()["request_id"])


def assert_used_up(env: Env, path: str, kind: str, seq: int, refused: httpx.Response) -> None:
    """After the owner's refused ``seq``: the next seq runs, and a resend of ``seq`` gets its
    failed future rather than running now."""
    after = runs(env, path, kind, env.next())
    assert "error" not in after, after
    resend = send(env, env.owner, path, kind, good(env, kind, seq))
    assert resend.status_code == 200, f"{path}: {resend.text}"
    failed = result(env.owner, resend.json()["request_id"])
    assert failed.get("category") == "user" and failed["error"], (refused.text, failed)


# ---- the walk -----------------------------------------------------------------------------


def test_ordered_routes_are_declared(env):
    """Every operation whose JSON body names a model_id and a seq_id is declared ordered, and
    the declared set is what the server serves."""
    spec = httpx.get(f"{env.base_url}/openapi.json", headers={"X-API-Key": OWNER}, timeout=10).json()
    schemas = spec["components"]["schemas"]
    ordered = ordered_operations(env.base_url)
    for path, item in spec["paths"].items():
        for op in item.values():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            props = schemas.get(ref.get("$ref", "").rsplit("/", 1)[-1], {}).get("properties", {})
            if "model_id" in props and "seq_id" in props:
                assert path in ordered, f"{path} takes model_id and seq_id but is not declared ordered"
    assert set(ordered.values()) == {
        "forward_backward",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "save_weights_external",
        "load_weights",
    }
    # And only the routes that carry data take bodies past the control-call limit.
    large = {
        (path, method) for path, item in spec["paths"].items() for method, op in item.items() if op.get("x-large-body")
    }
    assert large == {
        ("/api/v1/forward_backward", "post"),
        ("/api/v1/asample", "post"),
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/anthropic/api/v1/messages", "post"),
        ("/anthropic/api/v1/messages/count_tokens", "post"),
        ("/api/v1/uploads/{upload_id}/{signature}/{file_name}", "put"),  # an adapter's file, streamed to disk
    }


def test_owner_refusals_use_the_seq_id_up(env):
    """422 (schema) and 400 (bad value; a 404 for load_weights' unreadable checkpoint)."""
    for path, kind in ordered_operations(env.base_url).items():
        if kind == "forward_backward":  # protobuf: no schema error reaches a decoded seq_id
            seq = env.next()
            refused = send(env, env.owner, path, kind, fb_body(env.model, seq, loss_fn="no-such-loss"))
            assert refused.status_code == 400, refused.text
            assert_used_up(env, path, kind, seq, refused)
            continue
        seq = env.next()
        refused = env.owner.post(path, json={**valid(env, kind, seq), "no_such_field": 1})
        assert refused.status_code == 422, f"{path}: {refused.text}"
        assert_used_up(env, path, kind, seq, refused)
        seq = env.next()
        body, status = bad_value(env, kind, seq)
        refused = env.owner.post(path, json=body)
        assert refused.status_code == status, f"{path}: {refused.status_code} {refused.text}"
        assert_used_up(env, path, kind, seq, refused)


def test_strangers_and_anonymous_touch_nothing(env):
    """401 (no key, a wrong key) and 404 (another tenant's model), with valid and invalid bodies:
    the owner's request with the same seq_id then runs."""
    for path, kind in ordered_operations(env.base_url).items():
        seq = env.next()
        attempts = [
            (env.anonymous, good(env, kind, seq), 401),
            (httpx.Client(base_url=env.base_url, headers={"X-API-Key": "tml-wrong"}), good(env, kind, seq), 401),
            (env.stranger, good(env, kind, seq), 404),
        ]
        if kind != "forward_backward":
            attempts += [
                (env.anonymous, {**valid(env, kind, seq), "no_such_field": 1}, 401),
                (env.stranger, {**valid(env, kind, seq), "no_such_field": 1}, 422),
                (env.stranger, bad_value(env, kind, seq)[0], 404),
            ]
        for client, body, status in attempts:
            r = send(env, client, path, kind, body)
            assert r.status_code == status, f"{path}: {r.status_code} {r.text}"
        out = runs(env, path, kind, seq)
        assert "error" not in out, f"{path}: the owner's seq {seq} was used up by a stranger: {out}"


def big_fb_body(model: str, seq: int, tokens: int) -> bytes:
    """A forward_backward as the SDK writes it (model_id and seq_id first), of one long datum."""
    msg = pb.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = np.arange(tokens, dtype="<i4").tobytes()
    return msg.SerializeToString()


def test_413_uses_the_seq_id_up(env):
    """A body over the limit, declared by its Content-Length: refused from its head, which
    names the seq_id it uses up; the rest is never read."""
    for path, kind in ordered_operations(env.base_url).items():
        seq = env.next()
        if kind == "forward_backward":
            big = big_fb_body(env.model, seq, MAX_BODY)
        else:
            big = {**valid(env, kind, seq), "user_metadata": {"pad": "x" * (MAX_BODY + 1)}}
        refused = send(env, env.owner, path, kind, big)
        assert refused.status_code == 413 and "exceeds the limit" in refused.json()["detail"], refused.text
        assert_used_up(env, path, kind, seq, refused)


def test_413_without_content_length_uses_the_seq_id_up(env):
    """A chunked body is cut off once it passes the limit; its head names the seq_id."""
    for path, kind in ordered_operations(env.base_url).items():
        seq = env.next()
        if kind == "forward_backward":
            body, content_type = big_fb_body(env.model, seq, MAX_BODY), "application/x-protobuf"
        else:
            padded = {**valid(env, kind, seq), "user_metadata": {"pad": "x" * (MAX_BODY + 1)}}
            body, content_type = json.dumps(padded).encode(), "application/json"
        chunks = iter([body[i : i + 8192] for i in range(0, len(body), 8192)])
        refused = env.owner.post(path, content=chunks, headers={"Content-Type": content_type})
        assert refused.status_code == 413 and "exceeds the limit" in refused.json()["detail"], refused.text
        assert_used_up(env, path, kind, seq, refused)


@pytest.mark.parametrize(
    "spoil, status, says",
    [
        (lambda body: body + b"\xff\xff\xff", 400, "ForwardBackwardRequest"),  # a batch that does not decode
        (lambda body: zstandard.ZstdCompressor().compress(body + b"\0" * (4 * MAX_BODY)), 400, "exceeds"),
    ],
    ids=["not protobuf after the order", "inflates past the limit"],
)
def test_unreadable_forward_backward_uses_the_seq_id_up(env, spoil, status, says):
    """A forward_backward whose body cannot be inflated or decoded, but whose head names the
    owner's model and seq_id: that seq_id is used up."""
    path = "/api/v1/forward_backward"
    seq = env.next()
    body = spoil(big_fb_body(env.model, seq, 2048))
    headers = {"Content-Type": "application/x-protobuf"}
    if body[:4] == b"\x28\xb5\x2f\xfd":
        headers["Content-Encoding"] = "zstd"
    refused = env.owner.post(path, content=body, headers=headers)
    assert refused.status_code == status and says in refused.json()["detail"], refused.text
    assert_used_up(env, path, "forward_backward", seq, refused)


def test_stranger_413_touches_nothing(env):
    """A stranger's or an anonymous oversized body naming the owner's model and seq_id: the
    owner's request with that seq_id then runs. (The anonymous one is a 401 from its headers:
    keys are checked before bodies.)"""
    path = "/api/v1/forward_backward"
    seq = env.next()
    for client, status in ((env.stranger, 413), (env.anonymous, 401)):
        r = send(env, client, path, "forward_backward", big_fb_body(env.model, seq, MAX_BODY))
        assert r.status_code == status, r.text
    out = runs(env, path, "forward_backward", seq)
    assert "error" not in out, out


def test_sdk_training_goes_on_after_a_413(env):
    """Through the SDK: a batch over the limit raises its 413 (the SDK does not resend it), and
    the training client's next requests run, in order, rather than wait for its seq_id."""
    with tinker.ServiceClient(base_url=env.base_url, api_key=OWNER) as service:
        tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=0).result()
        rng = np.random.default_rng(0)
        too_big = datum(rng.integers(0, 200, MAX_BODY // 4).tolist())
        with pytest.raises(tinker.APIStatusError) as refused:
            tc.forward_backward([too_big], "cross_entropy").result(timeout=60)
        assert refused.value.status_code == 413, refused.value
        fits = datum([5, 6, 7, 8])
        before = tc.forward_backward([fits], "cross_entropy").result(timeout=60).metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60)
        after = tc.forward_backward([fits], "cross_entropy").result(timeout=60).metrics["loss:sum"]
        assert after < before


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
