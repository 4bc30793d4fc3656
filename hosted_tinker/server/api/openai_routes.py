"""OpenAI-compatible ``/v1`` routes (the OpenAI SDK, curl). HTTP only."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from hosted_tinker.server.api.auth import tenant_of
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol.openai_types import ChatCompletionRequest, CompletionRequest

router = APIRouter(prefix="/v1")


@router.get("/models")
async def list_models(request: Request) -> dict:
    return server_state(request).openai.list_models(tenant_of(request))


@router.post("/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> dict | StreamingResponse:
    service = server_state(request).openai
    if req.stream:
        return StreamingResponse(await service.stream(req, tenant_of(request)), media_type="text/event-stream")
    return await service.respond(req, tenant_of(request))


@router.post("/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> dict | StreamingResponse:
    service = server_state(request).openai
    if req.stream:
        return StreamingResponse(await service.stream(req, tenant_of(request)), media_type="text/event-stream")
    return await service.respond(req, tenant_of(request))
