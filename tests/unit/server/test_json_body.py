"""``api.json_body``: a big prompt body is parsed on the body thread and answered exactly as
FastAPI answers the same body small: the same model, the same refusals, a client that hangs up
mid-body a 400 (never a 500). On a bare app with the server's error handlers and body limit."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.testclient import TestClient

from hosted_tinker.core.body_thread import OFF_LOOP_BYTES
from hosted_tinker.server.api.body_limit import BodyLimit
from hosted_tinker.server.api.errors import install_error_handlers, large_body
from hosted_tinker.server.api.json_body import OffLoopJson
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import openai_types as oai

pytestmark = pytest.mark.fast

PAD = b" " * OFF_LOOP_BYTES  # JSON whitespace: the same body, big
JSON = {"Content-Type": "application/json"}
SAMPLE = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]}, "sampling_params": {}}


def make_app() -> FastAPI:
    router = APIRouter(route_class=OffLoopJson)

    @router.post("/api/v1/asample", **large_body("prompt"))
    async def asample(req: wire.SampleRequest, request: Request) -> dict:
        return {"tokens": req.prompt.chunks[0]["tokens"]}

    @router.post("/v1/completions", **large_body("prompt"))
    async def completions(req: oai.CompletionRequest) -> dict:
        return {"prompt": req.prompt}

    app = FastAPI()
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=64 << 20, max_control_bytes=1 << 20, max_prompt_bytes=32 << 20)
    install_error_handlers(app)
    return app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(make_app(), raise_server_exceptions=False)


CASES: list[tuple[str, str, bytes]] = [
    ("valid", "/api/v1/asample", json.dumps(SAMPLE).encode()),
    ("valid /v1", "/v1/completions", json.dumps({"model": "m", "prompt": [1, 2]}).encode()),
    ("not JSON", "/api/v1/asample", json.dumps(SAMPLE).encode() + b"x"),
    ("not UTF-8", "/api/v1/asample", b'{"base_model": "\xe9"}'),
    ("nested too deep", "/api/v1/asample", b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("unknown field", "/api/v1/asample", json.dumps({**SAMPLE, "temprature": 1}).encode()),
    ("bad item", "/v1/completions", json.dumps({"model": "m", "prompt": [1, "a", 3]}).encode()),
    ("surrogate", "/api/v1/asample", json.dumps({**SAMPLE, "base_model": "\ud800"}).encode()),
    ("not JSON /v1", "/v1/completions", b"{'model': 1}"),
]


@pytest.mark.parametrize(("path", "body"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_big_body_is_answered_as_the_same_small_one(client: TestClient, path: str, body: bytes):
    small, big = (client.post(path, content=b, headers=JSON) for b in (body, body + PAD))
    assert small.status_code < 500 and (big.status_code, big.json()) == (small.status_code, small.json())


def test_the_big_body_is_parsed_off_the_event_loop(client: TestClient, monkeypatch: pytest.MonkeyPatch):
    from hosted_tinker.server.api import json_body

    threads: list[str] = []
    real: Callable = json_body.parse
    monkeypatch.setattr(json_body, "parse", lambda *a: threads.append(threading.current_thread().name) or real(*a))
    body = json.dumps(SAMPLE).encode()
    assert client.post("/api/v1/asample", content=body + PAD, headers=JSON).json() == {"tokens": [1]}
    assert client.post("/api/v1/asample", content=body, headers=JSON).json() == {"tokens": [1]}
    assert threads == ["json-body_0"]  # the big one only, on the body thread


def test_a_client_that_hangs_up_mid_body_is_a_400_not_a_500():
    app = make_app()
    messages = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/v1/asample",
        "raw_path": b"/api/v1/asample",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
        "client": ("127.0.0.1", 1),
        "server": ("x", 80),
    }
    asyncio.run(app(scope, receive, send))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400]


def test_a_body_of_millions_of_containers_is_refused_before_it_is_parsed(client: TestClient, monkeypatch):
    """From a review: 32 MiB of "[]" took the API process from 323 to 1,158 MiB in json.loads
    (and a 422 after). Arrays and objects are counted before anything is parsed."""
    from hosted_tinker.core import body_thread
    from hosted_tinker.server.api import json_body

    monkeypatch.setattr(body_thread, "MAX_JSON_CONTAINERS", 30_000)  # the app here takes 1 MiB
    parsed: list[int] = []
    real_loads = json.loads
    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: parsed.append(1) or real_loads(*a, **k))
    body = b'{"prompt": [' + b"[]," * 30_000 + b"[]]}"
    r = client.post("/api/v1/asample", content=body, headers=JSON)
    assert not parsed  # (json.loads is everyone's: the answer is read after this)
    assert r.status_code == 400 and "30003 arrays and objects" in r.json()["detail"]
