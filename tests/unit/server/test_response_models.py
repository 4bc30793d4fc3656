"""Every JSON answer a route declares is a model that names each key it sends and no other
(``protocol.responses``): its schema in the OpenAPI document closes each object it describes, so
that Schemathesis' response checks (tests/e2e/test_fuzz.py) and the models' own ``extra="forbid"``
refuse a key that a service adds without declaring it. No server here: the app's routers, as
``api.app`` includes them, without its state."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

pytestmark = pytest.mark.fast

# Objects whose keys are another part's to choose, typed ``dict[str, Any]`` on purpose: they have
# no ``properties`` of their own, so the walk below leaves them be.


def _routers() -> list[Any]:
    from hosted_tinker.server.api import (
        anthropic_routes,
        openai_proxy_routes,
        openai_routes,
        ops_routes,
        rest_routes,
        tinker_routes,
        upload_routes,
    )

    return [
        tinker_routes.router,
        rest_routes.router,
        rest_routes.downloads,
        upload_routes.router,
        upload_routes.files,
        ops_routes.router,
        anthropic_routes.router("/anthropic/api/v1"),
        openai_routes.router("/v1"),
        openai_proxy_routes.router("/proxy/v1"),  # the vLLM engine's routes (its model list)
    ]


def _routes() -> list[APIRoute]:
    return [route for router in _routers() for route in router.routes if isinstance(route, APIRoute)]


def _open_objects(schema: dict[str, Any], defs: dict[str, Any], where: str, seen: set[str]) -> list[str]:
    """The places in ``schema`` where an object with declared properties takes other keys too."""
    found: list[str] = []
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in seen:
            seen.add(name)
            found += _open_objects(defs[name], defs, name, seen)
        return found
    if "properties" in schema and schema.get("additionalProperties") is not False:
        found.append(where)
    for key, value in schema.items():
        if isinstance(value, dict):
            found += _open_objects(value, defs, f"{where}.{key}", seen)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    found += _open_objects(item, defs, f"{where}.{key}[{i}]", seen)
    return found


def test_every_json_route_declares_its_answer_s_model():
    """A route that answers JSON of its own names the model it returns (the vLLM proxy's
    catch-all passes vLLM's answer through, and says so in its ``responses``)."""
    undeclared = []
    for route in _routes():
        if route.include_in_schema and route.response_model is None and route.path != "/proxy/v1/{path:path}":
            declared = route.responses.get(200, {}) or route.responses.get(204, {})
            if route.status_code != 204 and "content" not in declared and "model" not in declared:
                undeclared.append(route.path)
    assert undeclared == []


def test_every_response_model_sends_every_field_and_no_other_key():
    routes = [route for route in _routes() if route.response_model is not None]
    assert len(routes) >= 40  # the count when this test was written: a drop means routes lost theirs
    for route in routes:
        assert not route.response_model_exclude_unset, f"{route.path}: every declared field is sent"
        assert not route.response_model_exclude_none and not route.response_model_exclude_defaults, route.path
        model = route.response_model
        assert isinstance(model, type) and issubclass(model, BaseModel), route.path
        assert model.model_config.get("extra") == "forbid", f"{route.path}: {model.__name__} takes extra keys"


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")  # the proxy's one route for GET and POST
def test_the_openapi_document_closes_every_answer_s_objects():
    """What ``/openapi.json`` says of each route's JSON answers, errors included: every object
    with properties has ``additionalProperties: false``."""
    app = FastAPI()
    for router in _routers():
        app.include_router(router)
    document = app.openapi()
    defs = document["components"]["schemas"]
    open_ones, answers = set(), 0
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, response in operation.get("responses", {}).items():
                schema = response.get("content", {}).get("application/json", {}).get("schema")
                if schema is not None:
                    answers += 1
                    where = f"{method.upper()} {path} {status}"
                    open_ones |= {f"{where}: {o}" for o in _open_objects(schema, defs, "", set())}
    assert answers > 100 and sorted(open_ones) == []


def test_a_key_a_model_does_not_declare_is_an_error():
    from hosted_tinker.server.protocol import responses as rsp

    with pytest.raises(ValidationError, match="extra_forbidden"):
        rsp.CopyWeightsResponse(tinker_path="tinker://r/weights/a", size_bytes=1)  # type: ignore[call-arg]
    step = {"step": 0, "time": 0.0, "duration_s": 0.0, "tokens": 0, "calls": 0, "metrics": {}}
    rsp.RunMetricsResponse(run_id="r", steps=[{**step, "optim": {}}], open_step=step)  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="extra_forbidden"):  # an open step has no optim yet
        rsp.RunMetricsResponse(run_id="r", steps=[], open_step={**step, "optim": {}})  # type: ignore[arg-type]
