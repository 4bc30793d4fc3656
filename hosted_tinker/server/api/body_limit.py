"""``BodyLimit``: the bound on a request body's size, enforced before any route buffers it: the
large one for routes declared ``large_body`` (batches), a middle one for prompts, a small one
for control calls."""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.api.auth import presented_key
from hosted_tinker.server.api.errors import LARGE_BODY, error_response, ordered_kind, refuse_unparsed, route_mark
from hosted_tinker.server.api.inflight import RECEIVED_COPIES, BodyBytes, Hold
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol.ordering import head_limit, order_of

HEAD_WAIT_S = 2.0  # how long a refused ordered body's head is waited for


class _BodyTooLarge(Exception):
    """Raised into a route's body read once the bytes received pass the limit."""


class BodyLimit:
    """Every route buffers its whole body, so its size is bounded before that happens. The bound
    is ``max_bytes`` on a route declared ``large_body``, ``max_prompt_bytes`` on one declared
    ``large_body("prompt")`` (JSON: ``json.loads`` holds the event loop even on the body thread,
    so the bound is also what a request may hold up every other for, see ``api.json_body``) and
    ``max_control_bytes`` on every other, so that a session, a
    heartbeat or a save cannot make the server buffer hundreds of MiB (both at most
    ``max_bytes``). A declared Content-Length over it is a 413 at once, without reading the
    body; a body without one (chunked) is cut off with a 413 as soon as it passes the limit. A
    Content-Encoding other than zstd (which forward_backward inflates itself, under the same
    limit) is a 415: nothing here could decode it, and a JSON parser would only report garbage.

    A request ordered by ``seq_id``, sent with a valid key, is the one exception to "without
    reading": the head of its body (until it names the seq_id; a few hundred KiB and
    ``HEAD_WAIT_S`` at most) is read for the seq_id it uses up (``refuse_unparsed``), so that
    the model's later requests do not wait for it.

    A keyed request's body is also held in ``body_bytes`` (``api.inflight``) while it is read:
    each piece as it comes (a declared Content-Length that would not fit now is refused unread),
    let go once it is in, or for ``forward_backward`` once it is decoded; a body past its key's
    share or the server's bound is a 429 / 503 the SDK resends (its seq_id not used up). The
    route finds the hold in ``scope["state"]["body_hold"]``, to add what it inflates and to let
    go."""

    ENCODINGS = ("identity", "zstd")

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_control_bytes: int | None = None,
        max_prompt_bytes: int | None = None,
        body_bytes: BodyBytes | None = None,
    ) -> None:
        self.app = app
        self.body_bytes = body_bytes
        self.max_bytes = max_bytes
        self.max_control_bytes = min(max_bytes, max_control_bytes or max_bytes)
        self.max_prompt_bytes = min(max_bytes, max_prompt_bytes or max_bytes)

    def limit_of(self, scope: Scope) -> tuple[int, str]:
        """The bound on this request's body, and the setting that gives it."""
        declared = route_mark(Request(scope), LARGE_BODY)
        if declared == "prompt":
            return self.max_prompt_bytes, "--max-prompt-body-bytes, for a prompt"
        if declared:
            return self.max_bytes, "--max-body-bytes"
        return self.max_control_bytes, "--max-control-body-bytes, for a control call"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if route_mark(Request(scope), LARGE_BODY) == "upload":  # streamed to disk, bounded by its upload
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        encoding = headers.get("content-encoding", "").strip().lower() or "identity"
        if encoding not in self.ENCODINGS:
            detail = f"Content-Encoding {encoding!r} is not supported; send zstd or an unencoded body"
            await error_response(scope["path"], 415, detail)(scope, receive, send)
            return
        keep = head_limit(encoding)
        max_bytes, setting = self.limit_of(scope)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            head = await _read_head(scope, receive, keep) if _names_an_order(scope) else b""
            detail = f"body of {declared} bytes exceeds the limit of {max_bytes} bytes ({setting}; Content-Length)"
            await self._too_large(scope, head, detail)(scope, receive, send)
            return
        # Keyed requests only: a keyless route reads no body worth holding (a console form, 8 KiB).
        tenant = scope.get("state", {}).get("tenant")
        hold = self.body_bytes.hold(tenant) if self.body_bytes is not None and tenant is not None else None
        if hold is not None and declared.isdigit():
            try:  # what it declares must fit now, else it is refused unread, to be sent again
                hold.check(RECEIVED_COPIES * int(declared))
            except ApiError as busy:
                await _busy(scope, busy)(scope, receive, send)
                return
        try:
            # The protobuf route lets go once it has inflated and decoded the body; the others
            # once the body is in (a long poll holds nothing while it waits).
            until_read = route_mark(Request(scope), LARGE_BODY) is not True
            await self._limited(scope, receive, send, max_bytes, setting, keep, hold, until_read)
        finally:
            if hold is not None:
                hold.release()

    async def _limited(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        max_bytes: int,
        setting: str,
        keep: int,
        hold: Hold | None,
        until_read: bool,
    ) -> None:
        """The app, its body cut off past ``max_bytes``; each piece taken into ``hold`` as it
        comes (its refusal answered in place of the app's), let go once the body is in if
        ``until_read``."""
        if hold is not None:
            scope.setdefault("state", {})["body_hold"] = hold
        head, received, over, answered = bytearray(), 0, False, False
        busy: ApiError | None = None

        async def counting_receive() -> Message:
            nonlocal received, over, busy
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if len(head) < keep:
                    head.extend(chunk[: keep - len(head)])
                if received > max_bytes:
                    over = True
                    raise _BodyTooLarge
                if hold is not None and chunk:
                    try:
                        hold.receive(len(chunk))
                    except ApiError as e:
                        over, busy = True, e
                        raise _BodyTooLarge from None
                if hold is not None and until_read and not message.get("more_body", False):
                    hold.release()
            return message

        async def refuse() -> None:
            nonlocal answered
            if not answered:
                answered = True
                if busy is not None:
                    await _busy(scope, busy)(scope, receive, send)
                    return
                detail = f"body exceeds the limit of {max_bytes} bytes ({setting})"
                await self._too_large(scope, bytes(head), detail)(scope, receive, send)

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

    def _too_large(self, scope: Scope, head: bytes, detail: str):
        error = refuse_unparsed(Request(scope), head, ApiError(413, detail))
        return error_response(scope["path"], error.status, error.detail, headers=error.headers)


def _busy(scope: Scope, refusal: ApiError):
    """A body refused for the bytes held (``api.inflight``): its connection closed, the rest of
    it unread."""
    headers = {**refusal.headers, "Connection": "close"}
    return error_response(scope["path"], refusal.status, refusal.detail, headers=headers, code=refusal.code)


def _names_an_order(scope: Scope) -> bool:
    """Whether the head of this refused body may use up a seq_id: an ordered route's, sent with
    a valid key (a stranger's or an anonymous body is not read at all)."""
    request = Request(scope)
    if ordered_kind(request) is None:
        return False
    return server_state(request).keys.tenant_of(presented_key(request)) is not None


async def _read_head(scope: Scope, receive: Receive, size: int) -> bytes:
    """The start of the body, until it names its model and seq_id, ``size`` bytes have come, or
    ``HEAD_WAIT_S`` has passed (a client that stalls is answered with what it sent); the rest
    is never read."""
    headers = Headers(scope=scope)
    content_type, encoding = headers.get("content-type", ""), headers.get("content-encoding")
    head = bytearray()
    deadline = asyncio.get_running_loop().time() + HEAD_WAIT_S
    try:
        while len(head) < size and order_of(bytes(head), content_type, encoding) is None:
            timeout = deadline - asyncio.get_running_loop().time()
            message = await asyncio.wait_for(receive(), timeout=max(timeout, 0.0))
            if message["type"] != "http.request":
                break
            head.extend(message.get("body", b""))
            if not message.get("more_body", False):
                break
    except TimeoutError:
        pass
    return bytes(head[:size])
