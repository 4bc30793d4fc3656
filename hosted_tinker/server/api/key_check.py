"""``KeyCheck``: a request to a keyed route without a valid key is refused from its headers alone.

It runs outside everything that reads a body (``BodyLimit``, the routes), so an anonymous
request costs no more than its headers: a 401, its body never read, its connection closed.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from hosted_tinker.server.api.auth import CHALLENGE, presented_key, refusal
from hosted_tinker.server.api.errors import error_response
from hosted_tinker.server.keys import KeyRing

KEYLESS = frozenset({"/api/v1/healthz"})  # besides everything outside /api/v1 and /v1
KEYLESS_PREFIXES = ("/api/v1/files/",)  # signed download links: the signature is the key


def needs_key(path: str) -> bool:
    keyed = path.startswith("/api/v1/") or path == "/v1" or path.startswith("/v1/")
    return keyed and path not in KEYLESS and not path.startswith(KEYLESS_PREFIXES)


class KeyCheck:
    """ASGI middleware, outside everything that reads a body: a keyed route's request without a
    valid key is a 401 from its headers alone; its body is never read and its connection is
    closed, so an anonymous 200 MiB upload costs what its headers do."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]):
            key = presented_key(Request(scope))
            tenant = self.keys.tenant_of(key)
            if tenant is None:
                headers = {**CHALLENGE, "Connection": "close"}
                response = error_response(scope["path"], 401, refusal(key), code="invalid_api_key", headers=headers)
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
