"""OpenAI-compatible routes (the OpenAI SDK, curl), a router of them per door (``api.doors.OPENAI``).
HTTP only."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from hosted_tinker.server.api.auth import tenant_of
from hosted_tinker.server.api.errors import large_body
from hosted_tinker.server.api.json_body import OffLoopJson
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol import openai_types as oai
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.openai_types import ChatCompletionRequest, CompletionRequest

# A completion is JSON, or server-sent events with stream=true.
_OR_STREAM = {200: {"content": rsp.SSE}}


async def list_models(request: Request) -> oai.OpenAIModelList:
    return server_state(request).openai.list_models(tenant_of(request))


async def completions(req: CompletionRequest, request: Request) -> Any:
    service = server_state(request).openai
    if req.stream:
        return StreamingResponse(await service.stream(req, tenant_of(request)), media_type="text/event-stream")
    return await service.respond(req, tenant_of(request))


async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    service = server_state(request).openai
    if req.stream:
        return StreamingResponse(await service.stream(req, tenant_of(request)), media_type="text/event-stream")
    return await service.respond(req, tenant_of(request))


def router(prefix: str, *, in_schema: bool = True) -> APIRouter:
    """The routes at ``prefix`` (made per door, not included under one: a route keeps its whole
    path, which the request log, the metrics and ``errors.route_mark`` read)."""
    door = APIRouter(prefix=prefix, responses=rsp.OPENAI_ERRORS, route_class=OffLoopJson, include_in_schema=in_schema)
    door.add_api_route("/models", list_models, methods=["GET"], response_model=oai.OpenAIModelList)
    completion = {"methods": ["POST"], "responses": _OR_STREAM, **large_body("prompt")}
    door.add_api_route("/completions", completions, **completion, response_model=oai.Completion)
    door.add_api_route("/chat/completions", chat_completions, **completion, response_model=oai.ChatCompletion)
    return door
