"""Error responses, in the shape of the route's family: Tinker's ``{"detail": ...}`` under
``/api/v1``, OpenAI's ``{"error": {...}}`` and Anthropic's ``{"type": "error", "error": {...}}``
under their doors (``api.doors``), which their SDKs turn into typed exceptions. Every 4xx has a
body that names what was wrong; nothing a user sends is a 500.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from hosted_tinker.core.errors import ApiError, ServerError, bad_request
from hosted_tinker.server.api.auth import presented_key
from hosted_tinker.server.api.doors import is_anthropic, is_openai
from hosted_tinker.server.api.state import server_state
from hosted_tinker.server.protocol.anthropic_types import error_type
from hosted_tinker.server.protocol.ordering import order_of
from hosted_tinker.server.protocol.strict import is_text

log = logging.getLogger(__name__)

MAX_REPORTED = 20  # validation errors listed in a 422


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s on %s: %s", type(exc).__name__, request.url.path, exc)
        return error_response(request.url.path, exc.status, str(exc), code=exc.code, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse, 405): in the route family's shape.
        return error_response(
            request.url.path,
            exc.status_code,
            str(exc.detail),
            headers=dict(exc.headers) if exc.headers is not None else None,
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Keep each error's location and message; drop echoed input (it may be large). The first
        # few errors say what is wrong; all of them could be megabytes (see protocol.strict).
        found = exc.errors()
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in found[:MAX_REPORTED]]
        if len(found) > MAX_REPORTED:
            more = f"{len(found) - MAX_REPORTED} more errors not shown"
            errors.append({"loc": ["body"], "msg": more, "type": "more_errors"})
        if (busy := _consume_refused_seq(request, exc.body, errors)) is not None:
            return error_response(request.url.path, busy.status, busy.detail, headers=busy.headers)
        path = request.url.path
        if is_openai(path) or is_anthropic(path):  # their SDKs know a 400 naming the field, not a 422
            first = errors[0]
            if first["type"] == "json_invalid":  # its location is a character offset, not a field
                return error_response(path, 400, f"body is not valid JSON: {first['msg']}")
            param = ".".join(str(p) for p in first["loc"][1:]) or "body"
            if is_anthropic(path):
                return anthropic_error(400, f"{param}: {first['msg']}")
            return openai_error(400, f"{param}: {first['msg']}", param=param)
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}")


def error_response(
    path: str, status: int, detail: str, *, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """``detail`` as an error of ``status``, shaped for the family of the route at ``path``."""
    if is_openai(path):
        return openai_error(status, detail, code=code, headers=headers)
    if is_anthropic(path):
        return anthropic_error(status, detail, headers=headers)
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def anthropic_error(status: int, message: str, *, headers: dict[str, str] | None = None) -> JSONResponse:
    """Anthropic's error shape (its SDKs raise by status, and show ``error.message``)."""
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def openai_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


ORDERED = "x-ordered"
LARGE_BODY = "x-large-body"


def ordered(kind: str, *, large_body: bool = False) -> dict[str, Any]:
    """Route options that declare a request ordered by ``seq_id`` within its model, as the
    training service's request ``kind``. A body that names the caller's model and a seq_id uses
    it up even when it is refused before it runs: it fails validation (``_consume_refused_seq``)
    or is too large or unreadable (``refuse_unparsed``). The mark is on the route itself, and
    shows in ``/openapi.json`` as the operation's ``x-ordered``."""
    extra: dict[str, Any] = {ORDERED: kind}
    if large_body:
        extra[LARGE_BODY] = "batch"
    return {"openapi_extra": extra}


def large_body(what: Literal["batch", "prompt", "upload"] = "batch") -> dict[str, Any]:
    """Route options that declare a route carrying data, whose body may be as large as
    ``--max-body-bytes`` (a batch) or ``--max-prompt-body-bytes`` (a prompt: JSON, parsed on
    the body thread, ``api.json_body``); every other route is a control call, held to the much smaller
    ``--max-control-body-bytes`` (``BodyLimit``); an ``upload`` streams to disk and bounds
    itself (an adapter file, as large as its upload says; its body is documented as bytes). Shows
    as ``x-large-body``."""
    if what == "upload":
        binary = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
        return {"openapi_extra": {LARGE_BODY: what, "requestBody": {"content": binary, "required": True}}}
    return {"openapi_extra": {LARGE_BODY: what}}


def route_mark(request: Request, mark: str) -> Any:
    """What the route serving ``request`` declared as ``mark`` in its ``openapi_extra``, else None.
    Before routing (in a middleware) the route is found among ``app.state.declared_routes`` (the
    routers' own routes, which ``create_app`` lists) as the router will find it."""
    route = request.scope.get("route")
    if route is None:
        declared = getattr(request.app.state, "declared_routes", request.app.routes)
        route = next((r for r in declared if r.matches(request.scope)[0] is Match.FULL), None)
    return (getattr(route, "openapi_extra", None) or {}).get(mark)


def ordered_kind(request: Request) -> str | None:
    """The request kind the route serving ``request`` was declared ``ordered`` as, else None."""
    return route_mark(request, ORDERED)


def refuse_unparsed(request: Request, head: bytes, error: ApiError) -> ApiError:
    """The answer to an ordered request refused before its body was parsed (too large, not
    inflatable, not protobuf): ``error``, once the seq_id that the body's ``head`` names (see
    ``protocol.ordering``) is used up, if it names one of the caller's models; or a 429 when
    the model's queue has no room even for the refusal."""
    kind = ordered_kind(request)
    if kind is None:
        return error
    state = server_state(request)
    tenant = getattr(request.state, "tenant", None) or state.keys.tenant_of(presented_key(request))
    order = order_of(head, request.headers.get("content-type", ""), request.headers.get("content-encoding"))
    return _use_up(request, kind, tenant, order, error) or error


def _use_up(
    request: Request, kind: str, tenant: str | None, order: tuple[str, int] | None, error: ApiError
) -> ApiError | None:
    """Use up the seq_id of the caller's refused request ``order`` as a failed future holding
    ``error``. A stranger's or an anonymous request touches nothing. Returns the 429 to answer
    instead when the model's queue has no room even for the refusal (the SDK sends the request
    again, and then its seq_id is used up)."""
    if tenant is None or order is None:
        return None
    model_id, seq_id = order
    state = server_state(request)
    if not state.tenancy.owns(tenant, model_id):
        return None
    try:
        state.training.refuse_ordered(kind, model_id, seq_id, error)
    except ApiError as e:
        if e.status == 429:
            return e
    return None  # refused as expected (or the model is gone): the caller gets ``error`` itself


def _consume_refused_seq(request: Request, body: Any, errors: list[dict]) -> ApiError | None:
    """An ordered request whose body fails validation (say, NaN that the SDK sends as null, or
    JSON that does not parse) still uses up its seq_id, if the body names a model of the
    caller's and a seq_id; else every later request of that model would wait for it forever."""
    # forward_backward is protobuf: no validation error reaches here (see refuse_unparsed).
    kind = ordered_kind(request)
    if kind is None:
        return None
    order = None
    if isinstance(body, dict):
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if isinstance(model_id, str) and is_text(model_id) and type(seq_id) is int:
            order = model_id, seq_id
    elif isinstance(body, bytes | str):  # not JSON: its leading members may still be readable
        raw = body.encode(errors="surrogatepass") if isinstance(body, str) else body  # a lone surrogate may be in it
        order = order_of(raw, "application/json")
    where = ".".join(str(p) for p in errors[0]["loc"][1:]) or "body"
    tenant = getattr(request.state, "tenant", None)
    return _use_up(request, kind, tenant, order, bad_request(f"{where}: {errors[0]['msg']}"))
