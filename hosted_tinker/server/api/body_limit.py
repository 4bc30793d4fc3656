"""``BodyLimit``: the bound on a request body's size, enforced before any route buffers it."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hosted_tinker.server.api.errors import error_response


class _BodyTooLarge(Exception):
    """Raised into a route's body read once the bytes received pass the limit."""


class BodyLimit:
    """Every route buffers its whole body, so its size is bounded before that happens: a declared
    Content-Length over ``max_bytes`` is a 413 at once, without reading the body; a body without
    one (chunked) is cut off with a 413 as soon as it passes the limit. A Content-Encoding other
    than zstd (which forward_backward inflates itself, under the same limit) is a 415: nothing
    here could decode it, and a JSON parser would only report garbage."""

    ENCODINGS = ("identity", "zstd")

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        encoding = headers.get("content-encoding", "").strip().lower() or "identity"
        if encoding not in self.ENCODINGS:
            detail = f"Content-Encoding {encoding!r} is not supported; send zstd or an unencoded body"
            await _refusal(scope, 415, detail)(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            detail = f"body of {declared} bytes exceeds the limit of {self.max_bytes} bytes (Content-Length)"
            await _refusal(scope, 413, detail)(scope, receive, send)
            return
        received, over, answered = 0, False, False

        async def counting_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise _BodyTooLarge
            return message

        async def refuse() -> None:
            nonlocal answered
            if not answered:
                answered = True
                await _refusal(scope, 413, f"body exceeds the limit of {self.max_bytes} bytes")(scope, receive, send)

        async def guarded_send(message: Message) -> None:
            nonlocal answered
            if not over:
                answered = answered or message["type"] == "http.response.start"
                await send(message)
            elif message["type"] == "http.response.start":  # the route's answer to the cut-off read
                await refuse()

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if over:
            await refuse()


def _refusal(scope: Scope, status: int, detail: str) -> JSONResponse:
    return error_response(scope["path"], status, detail)
