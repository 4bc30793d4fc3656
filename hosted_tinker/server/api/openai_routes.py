"""OpenAI-compatible routes (the OpenAI SDK, curl), mounted at each of ``api.doors.OPENAI``. HTTP only."""

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

router = APIRouter(responses=rsp.OPENAI_ERRORS, route_class=OffLoopJson)
# A completion is JSON, or server-sent events with stream=true.
_OR_STREAM = {200: {"content": rsp.SSE}}


@router.get("/models", **rsp.as_built(oai.OpenAIModelList))
async def list_models(request: Request) -> dict:
    return server_state(request).openai.list_models(tenant_of(request))


@router.post("/completions", **rsp.as_built(oai.Completion), responses=_OR_STREAM, **large_body("prompt"))
async def completions(req: CompletionRequest, request: Request) -> Any:
    service = server_state(request).openai
    if req.stream:
        return StreamingResponse(await service.stream(req, tenant_of(request)), media_type="text/event-stream")
    return await service.respond(req, tenant_of(request))


@router.post("/chat/completions", **rsp.as_built(oai.ChatCompletion), responses=_OR_STREAM, **large_body("prompt"))
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    service = server_state(request).openai
    if req.stream:
        return StreamingResponse(await service.stream(req, tenant_of(request)), media_type="text/event-stream")
    return await service.respond(req, tenant_of(request))
