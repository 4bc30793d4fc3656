"""The OpenAI-compatible routes when vLLM is the engine, a router of them per door
(``api.doors.OPENAI``): our model list, everything else forwarded. HTTP only."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hosted_tinker.server.api.auth import tenant_of
from hosted_tinker.server.api.errors import large_body
from hosted_tinker.server.api.openai_routes import list_models
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol import openai_types as oai
from hosted_tinker.server.protocol import responses as rsp

# vLLM's answer, passed through as it sent it: JSON or server-sent events.
_PASSED_THROUGH: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {"schema": {"type": "object"}}, **rsp.SSE}}
}


async def forward(path: str, request: Request) -> Response:
    """Completions, chat completions, and vLLM's other OpenAI-style routes."""
    proxy = server_state(request).openai_proxy
    if proxy is None:  # (these routes are mounted only with vLLM, which comes with its proxy)
        raise RuntimeError("no OpenAI proxy")
    body = await request.body()
    return await proxy.forward(request.method, path, request.url.query, body, dict(request.headers), tenant_of(request))


def router(prefix: str, *, in_schema: bool = True) -> APIRouter:
    """The routes at ``prefix``; our model names, as with the embedded engine."""
    door = APIRouter(prefix=prefix, responses=rsp.OPENAI_ERRORS, include_in_schema=in_schema)
    door.add_api_route("/models", list_models, methods=["GET"], response_model=oai.OpenAIModelList)
    door.add_api_route(
        "/{path:path}",
        forward,
        methods=["GET", "POST"],
        response_model=None,
        responses=_PASSED_THROUGH,
        **large_body("prompt"),
    )
    return door
