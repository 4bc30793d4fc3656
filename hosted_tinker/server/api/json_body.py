"""Large JSON bodies are decoded and validated on a thread of their own, not on the event loop.

A prompt body may be tens of MiB (a 40K-token prompt with dense top-64 target logprobs). On the
loop, ``json.loads`` and pydantic's validation of it would hold up every other request
(heartbeats, long polls, other tenants' streams) for ~35 ms per MiB on a 2-core machine. On a
thread, validation (which runs our Python validators) lets the loop in every few ms; only
``json.loads``, one C call that keeps the GIL, still stalls it (~12 ms per MiB of numbers, ~50
of object keys; the body limit bounds it). The thread is ``core.body_thread``'s.

``OffLoopJson`` is the route class of the routers whose routes are declared
``large_body("prompt")`` (the ``/v1`` proxy, which forwards JSON it only edits, uses the
thread itself).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from hosted_tinker.core.body_thread import OFF_LOOP_BYTES, off_loop, too_many_containers
from hosted_tinker.server.api.errors import LARGE_BODY

PARSE_ERROR = "There was an error parsing the body"  # FastAPI's words for a body it cannot read


def parse(model: type[BaseModel], body: bytes) -> BaseModel | RequestValidationError | HTTPException:
    """``body`` as a ``model``, or the error FastAPI itself would have raised for it (or a 400
    for a body of more arrays and objects than it may hold)."""
    if (why := too_many_containers(body)) is not None:
        return HTTPException(400, why)
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "ctx": {"error": e.msg}}
        return RequestValidationError([error], body=e.doc)
    except (ValueError, RecursionError):  # not UTF-8, or nested past the parser's depth
        return HTTPException(400, PARSE_ERROR)
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False, include_input=False)]
        return RequestValidationError(errors, body=doc)


class _Parsed(Request):
    """The request, its body already read and validated: FastAPI's handler takes the model
    instance as the JSON it would parse (and, pydantic finding an instance of the very model,
    keeps it as it is)."""

    def __init__(self, scope: Scope, receive: Receive, body: bytes, parsed: BaseModel) -> None:
        super().__init__(scope, receive)
        self._read, self._parsed = body, parsed

    async def body(self) -> bytes:
        return self._read

    async def json(self) -> Any:
        return self._parsed


class OffLoopJson(APIRoute):
    """A route declared ``large_body("prompt")`` with a JSON body model: a body of
    ``OFF_LOOP_BYTES`` or more is parsed by ``parse`` on the body thread; every other request
    goes to FastAPI's handler as usual."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = self._body_model()
        if model is None:
            return handler

        async def parse_off_loop(request: Request) -> Response:
            try:
                body = await request.body()
            except ClientDisconnect:  # as FastAPI's handler says it
                raise HTTPException(400, PARSE_ERROR) from None
            if len(body) < OFF_LOOP_BYTES or not _is_json(request.headers.get("content-type")):
                return await handler(request)
            parsed = await off_loop(parse, model, body)
            if isinstance(parsed, Exception):
                raise parsed  # answered by the app's handler, as FastAPI's own would be
            return await handler(_Parsed(request.scope, request.receive, body, parsed))

        return parse_off_loop

    def _body_model(self) -> type[BaseModel] | None:
        if (self.openapi_extra or {}).get(LARGE_BODY) != "prompt" or len(self.dependant.body_params) != 1:
            return None
        annotation = self.dependant.body_params[0].field_info.annotation
        return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would parse a body of this type as JSON (one without a type is left to it)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
