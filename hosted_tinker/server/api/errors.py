"""Error responses, in the shape of the route's family: Tinker's ``{"detail": ...}`` under
``/api/v1``, OpenAI's ``{"error": {...}}`` under ``/v1`` (which its SDK turns into typed
exceptions). Every 4xx has a body that names what was wrong; nothing a user sends is a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from hosted_tinker.core.errors import ApiError, ServerError, bad_request
from hosted_tinker.server.api.state import server_state

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s on %s: %s", type(exc).__name__, request.url.path, exc)
        return error_response(request.url.path, exc.status, str(exc), code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Keep each error's location and message; drop echoed input (it may be large).
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        if (busy := _consume_refused_seq(request, exc.body, errors)) is not None:
            return error_response(request.url.path, busy.status, busy.detail, headers=busy.headers)
        if is_openai(request.url.path):
            first = errors[0]
            if first["type"] == "json_invalid":  # its location is a character offset, not a field
                return openai_error(400, f"body is not valid JSON: {first['msg']}")
            param = ".".join(str(p) for p in first["loc"][1:]) or "body"
            return openai_error(400, f"{param}: {first['msg']}", param=param)
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}")


def is_openai(path: str) -> bool:
    return path.startswith("/v1/")


def error_response(
    path: str, status: int, detail: str, *, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """``detail`` as an error of ``status``, shaped for the family of the route at ``path``."""
    if is_openai(path):
        return openai_error(status, detail, code=code, headers=headers)
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


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


# JSON requests ordered by seq_id within their model (forward_backward is protobuf: its codec
# reports bad datums against the decoded seq_id itself).
_ORDERED_ROUTES = {
    f"/api/v1/{kind}": kind
    for kind in ("optim_step", "save_weights", "save_weights_for_sampler", "save_weights_external", "load_weights")
}


def _consume_refused_seq(request: Request, body: Any, errors: list[dict]) -> ApiError | None:
    """An ordered request whose body fails validation (say, NaN that the SDK sends as null) still
    uses up its seq_id, if the body names a model of the caller's and a seq_id; else every later
    request of that model would wait for it forever. Returns the 429 to answer instead of the
    422 when the model's queue has no room even for the refusal: the SDK sends the request
    again, and then its seq_id is used up."""
    kind = _ORDERED_ROUTES.get(request.url.path)
    tenant = getattr(request.state, "tenant", None)
    if kind is None or tenant is None or not isinstance(body, dict):
        return None
    model_id, seq_id = body.get("model_id"), body.get("seq_id")
    if not isinstance(model_id, str) or type(seq_id) is not int:
        return None
    state = server_state(request)
    if not state.tenancy.owns(tenant, model_id):
        return None
    where = ".".join(str(p) for p in errors[0]["loc"][1:]) or "body"
    try:
        state.training.refuse_ordered(kind, model_id, seq_id, bad_request(f"{where}: {errors[0]['msg']}"))
    except ApiError as e:
        if e.status == 429:
            return e
    return None  # refused as expected (or the model is gone): the caller gets the 422 itself
