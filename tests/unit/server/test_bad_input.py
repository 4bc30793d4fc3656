"""The unit tests of what tests/e2e/test_bad_input.py tests end to end (no server here)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.requests import Request

pytestmark = pytest.mark.fast


def test_body_limit_cuts_off_a_body_without_content_length():
    """A chunked body has no Content-Length to refuse up front: it is cut off with a 413 as soon
    as it passes the limit (here a unit test with 100- and 1000-byte limits, not MiBs over
    loopback). A route declared ``large_body`` gets the large limit, every other the small one."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from hosted_tinker.server.api.body_limit import BodyLimit
    from hosted_tinker.server.api.errors import large_body

    app = FastAPI()

    @app.post("/api/v1/echo")
    async def echo(payload: dict) -> dict:
        return payload

    @app.post("/api/v1/raw")
    async def raw(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.post("/api/v1/batch/{name}", **large_body())
    async def batch(name: str, request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.post("/api/v1/prompt", **large_body("prompt"))
    async def prompt(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    app.add_middleware(BodyLimit, max_bytes=1000, max_control_bytes=100, max_prompt_bytes=300)
    client = TestClient(app)
    headers = {"Content-Type": "application/json"}
    for path in ("echo", "raw"):
        r = client.post(f"/api/v1/{path}", content=iter([b'{"a": "', b"x" * 200, b'"}']), headers=headers)
        assert r.status_code == 413 and "exceeds the limit of 100 bytes" in r.json()["detail"], r.text
        assert "--max-control-body-bytes" in r.json()["detail"]
    assert client.post("/api/v1/echo", content=iter([b'{"a": ', b"1}"]), headers=headers).json() == {"a": 1}
    assert client.post("/api/v1/raw", content=b"x" * 101).status_code == 413  # declared
    assert client.post("/api/v1/batch/b", content=iter([b"x" * 500, b"x" * 500])).json() == {"bytes": 1000}
    over = client.post("/api/v1/batch/b", content=iter([b"x" * 600, b"x" * 600]))
    assert over.status_code == 413 and "1000 bytes (--max-body-bytes)" in over.json()["detail"], over.text
    assert client.post("/api/v1/batch/b", content=b"x" * 1001).status_code == 413  # declared
    assert client.post("/api/v1/prompt", content=iter([b"x" * 150, b"x" * 150])).json() == {"bytes": 300}
    over = client.post("/api/v1/prompt", content=iter([b"x" * 200, b"x" * 200]))
    assert over.status_code == 413 and "300 bytes (--max-prompt-body-bytes" in over.json()["detail"], over.text


def test_every_list_of_a_request_type_stops_at_its_first_bad_item():
    """Each list field of every request type is ``strict.ListOf``: pydantic stops validating it
    at its first bad item, so that no body costs an error per item."""
    from hosted_tinker.server.protocol import json_types, openai_types
    from hosted_tinker.server.protocol.strict import StrictRequest

    def lists(schema: Any) -> Iterator[dict]:
        if isinstance(schema, dict):
            if schema.get("type") == "list":
                yield schema
            for value in schema.values():
                yield from lists(value)
        elif isinstance(schema, list):
            for value in schema:
                yield from lists(value)

    models = [m for module in (json_types, openai_types) for m in vars(module).values()]
    models = [m for m in models if isinstance(m, type) and issubclass(m, StrictRequest) and m is not StrictRequest]
    assert len(models) > 40
    found = [(m.__name__, s) for m in models for s in lists(m.__pydantic_core_schema__)]
    assert len(found) > 20
    assert all(s.get("fail_fast") for _, s in found), [name for name, s in found if not s.get("fail_fast")]
