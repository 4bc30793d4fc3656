"""The Anthropic Messages API routes (the Anthropic SDKs, Claude Code's ``ANTHROPIC_BASE_URL``), a
router of them per door (``api.doors.ANTHROPIC``). HTTP only."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from hosted_tinker.server.api.auth import tenant_of
from hosted_tinker.server.api.errors import large_body
from hosted_tinker.server.api.json_body import OffLoopJson
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol import anthropic_types as ant
from hosted_tinker.server.protocol import responses as rsp


async def messages(req: ant.MessagesRequest, request: Request) -> Any:
    service = server_state(request).anthropic
    if req.stream:
        return StreamingResponse(await service.stream(req, tenant_of(request)), media_type="text/event-stream")
    return await service.respond(req, tenant_of(request))


async def count_tokens(req: ant.CountTokensRequest, request: Request) -> ant.TokenCount:
    return await server_state(request).anthropic.count_tokens(req, tenant_of(request))


def router(prefix: str, *, in_schema: bool = True) -> APIRouter:
    """The routes at ``prefix`` (see ``openai_routes.router``)."""
    door = APIRouter(
        prefix=prefix, responses=ant.ANTHROPIC_ERRORS, route_class=OffLoopJson, include_in_schema=in_schema
    )
    prompt = {"methods": ["POST"], **large_body("prompt")}
    # JSON, or server-sent events with stream=true
    door.add_api_route(
        "/messages", messages, **prompt, responses={200: {"content": rsp.SSE}}, response_model=ant.Message
    )
    door.add_api_route("/messages/count_tokens", count_tokens, **prompt, response_model=ant.TokenCount)
    return door
