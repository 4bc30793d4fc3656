"""API keys at the edge: every route but health and signed downloads requires one.

The Tinker SDK sends its key as ``X-API-Key``; the OpenAI SDK as ``Authorization: Bearer``. Both
are accepted everywhere. ``key_check.KeyCheck`` decides from the headers alone, before anything
reads the body. The tenant the key stands for is kept on the request for the routes.
"""

from __future__ import annotations

from fastapi import Request

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.api.state import server_state

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="hosted-tinker"'}


def refusal(key: str | None) -> str:
    if key is None:
        return "missing API key: send it as X-API-Key (the Tinker SDK's TINKER_API_KEY) or Authorization: Bearer"
    return "invalid or revoked API key"


def presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


async def authenticate(request: Request) -> None:
    """A router dependency, behind ``KeyCheck``: 401 unless the request carries a key valid here
    (it declares the routes' security in /openapi.json, and guards a route ``needs_key`` missed).
    ``async`` so that FastAPI runs it on the event loop: a plain ``def`` dependency costs every
    request a hop to the thread pool and back."""
    if getattr(request.state, "tenant", None) is not None:
        return
    key = presented_key(request)
    tenant = server_state(request).keys.tenant_of(key)
    if tenant is None:
        raise ApiError(401, refusal(key), headers=CHALLENGE, code="invalid_api_key")
    request.state.tenant = tenant


def tenant_of(request: Request) -> str:
    """The tenant of an authenticated request (set by :func:`authenticate`)."""
    return request.state.tenant
