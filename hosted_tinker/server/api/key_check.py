"""``KeyCheck``: a request to a keyed route without a valid key is refused from its headers alone.

It runs outside everything that reads a body (``BodyLimit``, the routes), so an anonymous
request costs no more than its headers: a 401, its body never read, its connection closed. A
key past its ``requests_per_s`` (``server.quotas``) is answered 429 here too, as cheaply.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from hosted_tinker.server.api.auth import CHALLENGE, presented_key, refusal
from hosted_tinker.server.api.doors import is_inference
from hosted_tinker.server.api.errors import error_response
from hosted_tinker.server.keys import KeyRing
from hosted_tinker.server.quotas import Quotas

KEYLESS = frozenset({"/api/v1/healthz"})  # besides everything outside /api/v1, the inference doors and the docs
# signed download links and upload URLs: the signature is the key
KEYLESS_PREFIXES = ("/api/v1/files/", "/api/v1/traces/", "/api/v1/uploads/")
# Heartbeats have a bucket of their own: a busy key's sessions must not lapse, and a flood of
# them (each a database write) is still held to the key's rate.
OWN_BUCKET = {"/api/v1/session_heartbeat": "heartbeats"}
# The API's description: on a server with keys, for key holders only, unless --public-docs.
DOCS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


METRICS = "/metrics"  # names every tenant's model ids: for key holders only, unless --public-metrics


def needs_key(path: str, *, public_docs: bool = False, public_metrics: bool = False) -> bool:
    if path in DOCS:
        return not public_docs
    if path == METRICS:
        return not public_metrics
    keyed = path.startswith("/api/v1/") or is_inference(path)
    return keyed and path not in KEYLESS and not path.startswith(KEYLESS_PREFIXES)


class KeyCheck:
    """ASGI middleware, outside everything that reads a body: a keyed route's request without a
    valid key is a 401 from its headers alone; its body is never read and its connection is
    closed, so an anonymous 200 MiB upload costs what its headers do."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        quotas: Quotas | None = None,
        public_docs: bool = False,
        public_metrics: bool = False,
    ) -> None:
        self.app = app
        self.keys = keys
        self.quotas = quotas
        self.public_docs = public_docs
        self.public_metrics = public_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        public = {"public_docs": self.public_docs, "public_metrics": self.public_metrics}
        if scope["type"] == "http" and needs_key(scope["path"], **public):
            key = presented_key(Request(scope))
            tenant = self.keys.tenant_of(key)
            if tenant is None:
                headers = {**CHALLENGE, "Connection": "close"}
                response = error_response(scope["path"], 401, refusal(key), code="invalid_api_key", headers=headers)
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant  # the request log names it, a 429 too
            if self.quotas is not None:
                over = self.quotas.admit(tenant, OWN_BUCKET.get(scope["path"], "requests"))
                if over is not None:
                    headers = {**over.headers, "Connection": "close"}  # its body is not read either
                    response = error_response(scope["path"], 429, over.detail, headers=headers)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
