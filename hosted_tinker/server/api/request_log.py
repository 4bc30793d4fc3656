"""The request log: one JSON line per HTTP request, what an operator needs to answer "what did
this tenant do before it broke".

Each line holds the time the request arrived, the key id of its tenant (never the key; ``""``
on an open server, absent when unauthenticated), method, route (the path template) and path,
status, duration, bytes received and sent, the client's address, and what the routes noted
about it (``note``): the model or sampling session, ``seq_id``, the future's ``request_id``,
and for training calls the loss and the optimizer. Lines go to ``--request-log`` (by default
``requests.jsonl`` in the data directory, rotated at 64 MiB, four old files kept; ``-``: stderr).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hosted_tinker.server.metrics import ServerMetrics

LOGGER = "hosted_tinker.requests"
ROTATE_BYTES = 64 << 20
ROTATED_FILES = 4


def note(request: Request, **fields: Any) -> None:
    """Add fields to this request's log line (None values are left out)."""
    noted = request.scope.setdefault("state", {}).setdefault("log", {})
    noted.update({k: v for k, v in fields.items() if v is not None})


def open_request_log(target: str) -> logging.Logger:
    """The request logger, writing to ``target`` (a file path, or ``-`` for stderr)."""
    logger = logging.getLogger(LOGGER)
    logger.propagate = False  # its lines are JSON, not the server log's format
    logger.setLevel(logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    path = Path(target)
    if target == "-":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    elif path.exists() and not path.is_file():  # a fifo or /dev/null: written to, never rotated
        handler = logging.FileHandler(target)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _RotatingLog(target, maxBytes=ROTATE_BYTES, backupCount=ROTATED_FILES)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    return logger


class _RotatingLog(logging.handlers.RotatingFileHandler):
    """The stdlib's rotating handler, less its per-record ``stat`` of the file (whether it is
    still a regular file, bpo-45401): :func:`open_request_log` checks that once. On the event
    loop that stat was a tenth of a millisecond of every request."""

    def shouldRollover(self, record: logging.LogRecord) -> bool:
        if self.stream is None:
            self.stream = self._open()
        return self.stream.tell() + len(self.format(record)) + 1 >= self.maxBytes


class RequestLog:
    """ASGI middleware: counts a request's bytes both ways and writes its line when it ends."""

    def __init__(self, app: ASGIApp, logger: logging.Logger, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.logger = logger
        self.metrics = metrics  # the same facts, counted for /metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, wall = time.perf_counter(), time.time()
        counts = {"in": 0, "out": 0, "status": 0}

        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                counts["in"] += len(message.get("body", b""))
            return message

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                counts["status"] = message["status"]
            elif message["type"] == "http.response.body":
                counts["out"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counted_receive, counted_send)
        finally:
            self._write(scope, wall, time.perf_counter() - started, counts)

    def _write(self, scope: Scope, wall: float, seconds: float, counts: dict[str, int]) -> None:
        state = scope.get("state", {})
        route = scope.get("route")
        line = {
            "time": round(wall, 3),
            "key_id": state.get("tenant"),
            "method": scope.get("method"),
            "route": getattr(route, "path", None),
            "path": scope.get("path"),
            "status": counts["status"] or 500,  # none sent: the connection ended first
            "ms": round(seconds * 1000, 2),
            "bytes_in": counts["in"],
            "bytes_out": counts["out"],
            "client": (scope.get("client") or (None,))[0],
            **state.get("log", {}),
        }
        if self.metrics is not None:
            self.metrics.observe_request(line["route"], line["method"], line["status"], seconds)
        try:
            self.logger.info(json.dumps({k: v for k, v in line.items() if v is not None}))
        except Exception:  # a full disk must not fail the request that was served
            logging.getLogger(__name__).exception("could not write the request log")
