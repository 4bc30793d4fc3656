"""API keys at the edge: every router but health and signed downloads requires one (see app.py).

The Tinker SDK sends its key as ``X-API-Key``; the OpenAI SDK as ``Authorization: Bearer``. Both
are accepted everywhere. The tenant the key stands for is kept on the request for the routes.
"""

from __future__ import annotations

from fastapi import Request

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.api.state import server_state

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="hosted-tinker"'}


def presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


def authenticate(request: Request) -> None:
    """A router dependency: 401 unless the request carries a key valid here."""
    key = presented_key(request)
    tenant = server_state(request).keys.tenant_of(key)
    if tenant is None:
        detail = (
            "missing API key: send it as X-API-Key (the Tinker SDK's TINKER_API_KEY) or Authorization: Bearer"
            if key is None
            else "invalid or revoked API key"
        )
        raise ApiError(401, detail, headers=CHALLENGE, code="invalid_api_key")
    request.state.tenant = tenant


def tenant_of(request: Request) -> str:
    """The tenant of an authenticated request (set by :func:`authenticate`)."""
    return request.state.tenant
