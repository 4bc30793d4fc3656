"""``/v1`` routes when vLLM is the engine: our model list, everything else forwarded. HTTP only."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hosted_tinker.api.state import ServerState

router = APIRouter(prefix="/v1")


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/models")
async def list_models(request: Request) -> dict:
    return _state(request).openai.list_models()


@router.api_route("/{path:path}", methods=["GET", "POST"], response_model=None)
async def forward(path: str, request: Request) -> Response:
    """Completions, chat completions, and vLLM's other OpenAI-style routes."""
    proxy = _state(request).openai_proxy
    return await proxy.forward(request.method, path, request.url.query, await request.body(), dict(request.headers))
