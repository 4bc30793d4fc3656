"""The request log: one JSON line per HTTP request, what an operator needs to answer "what did
this tenant do before it broke".

Each line holds the time the request arrived, the key id of its tenant (never the key; ``""``
on an open server, absent when unauthenticated), method, route (the path template) and path,
status, duration, bytes received and sent, the client's address, and what the routes noted
about it (``note``): the model or sampling session, ``seq_id``, the future's ``request_id``,
and for training calls the loss and the optimizer. Lines go to ``--request-log`` (by default
``requests.jsonl`` in the data directory, rotated at 64 MiB, four old files kept; ``-``: stderr).

What anyone can send without a key must not be able to rotate away what keys did (240 s of
keyless 404s at 510/s once erased every keyed line): lines of requests without a valid key, and
a key's 429s for its rate, take at most ``--request-log-anonymous-per-s`` lines a second (bursts
of ``BURST_S`` seconds' worth); the others are counted by status, method, route, client and key,
and the counts are one summary line a minute (``RequestLines``). No secret is written: a link's
signature and a query string's keys and tokens are left out of every path (``redacted``), here
and in uvicorn's access log where it is turned on (``SecretsRedacted``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hosted_tinker.server.metrics import ServerMetrics

LOGGER = "hosted_tinker.requests"
ROTATE_BYTES = 64 << 20
ROTATED_FILES = 4
BURST_S = 60.0  # the limited lines' allowance holds this many seconds' worth
SUMMARY_EVERY_S = 60.0  # what was held back is written as one line this often (and at shutdown)
MAX_GROUPS = 1000  # distinct groups counted between summaries; requests of any further one count as "others"
GROUPS_SHOWN = 20  # the largest groups, in a summary line
# Query parameters whose values may be credentials (a key sent as ?api_key=, a token, a
# signature): any whose name, unquoted, holds one of these (x-api-key, api%5Fkey, authorization).
_SECRET_NAME = re.compile(r"key|token|sig|secret|auth|pass|cred", re.IGNORECASE)
# A signed link's signature is its credential: /api/v1/{files,traces}/<payload>/<signature>/<name>.
_LINK_SIGNATURE = re.compile(r"^(/api/v1/(?:files|traces)/[^/?]*/)[^/?]+")
_QUERY_SECRET = re.compile(r"(^|[&;])([^=&;]+)=([^&;]*)")
HIDDEN = "..."


def redacted(path: str) -> str:
    """``path`` (and its query string, if any) with every secret in it replaced by ``...``."""
    path, mark, query = path.partition("?")
    path = _LINK_SIGNATURE.sub(rf"\g<1>{HIDDEN}", path)
    if not mark:
        return path

    def hide(m: re.Match[str]) -> str:
        secret = _SECRET_NAME.search(unquote_plus(m.group(2))) is not None
        return f"{m.group(1)}{m.group(2)}={HIDDEN if secret else m.group(3)}"

    return f"{path}?{_QUERY_SECRET.sub(hide, query)}"


class SecretsRedacted(logging.Filter):
    """For uvicorn's access log (``--access-log``): its request paths, query strings included,
    with their secrets left out (``redacted``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redacted(a) if isinstance(a, str) and a.startswith("/") else a for a in record.args)
        return True


def note(request: Request, **fields: Any) -> None:
    """Add fields to this request's log line (None values are left out)."""
    noted = request.scope.setdefault("state", {}).setdefault("log", {})
    noted.update({k: v for k, v in fields.items() if v is not None})


def open_request_log(target: str) -> logging.Logger:
    """The request logger, writing to ``target`` (a file path, or ``-`` for stderr)."""
    logger = logging.getLogger(LOGGER)
    logger.propagate = False  # its lines are JSON, not the server log's format
    logger.setLevel(logging.INFO)
    for old in list(logger.handlers):
        logger.removeHandler(old)
        old.close()
    path = Path(target)
    handler: logging.Handler
    if target == "-":
        handler = logging.StreamHandler(sys.stderr)
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


def limited(line: dict[str, Any]) -> bool:
    """Whether a line is one anyone could make many of: no valid key, or a key refused for its rate."""
    return line.get("key_id") is None or line.get("status") == 429


class RequestLines:
    """Writes request lines to ``logger``: every keyed one, and of the ``limited`` ones as many
    as ``per_s`` a second allows (bursts of ``BURST_S`` seconds' worth); the rest are counted
    and summarised in one line every ``SUMMARY_EVERY_S`` (and at ``flush``). Used on the event
    loop only."""

    def __init__(self, logger: logging.Logger, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.per_s = per_s
        self.clock = clock
        self._allowance = per_s * BURST_S
        self._refilled = clock()
        self._held: Counter[tuple[Any, ...]] = Counter()  # (status, method, route, client, key_id) -> requests
        self._others = 0  # requests of groups past MAX_GROUPS
        self._held_since: tuple[float, float] | None = None  # (monotonic, wall) of the first held back
        self._timer: asyncio.TimerHandle | None = None

    def write(self, line: dict[str, Any]) -> None:
        if limited(line) and not self._admit():
            self._hold(line)
        else:
            self._emit(line)
        if self._held_since is not None and self.clock() - self._held_since[0] >= SUMMARY_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Write the summary of the lines held back since the last one, if any."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held_since is None:
            return
        names = ("status", "method", "route", "client", "key_id")
        shown = self._held.most_common(GROUPS_SHOWN)
        groups = [
            {**{k: v for k, v in zip(names, group, strict=True) if v is not None}, "count": n} for group, n in shown
        ]
        total = sum(self._held.values()) + self._others
        self._emit({
            "time": round(time.time(), 3),
            "since": round(self._held_since[1], 3),
            "suppressed": total,
            "groups": groups,
            "others": total - sum(n for _, n in shown),  # requests of the groups not shown
        })  # fmt: skip
        self._held.clear()
        self._others = 0
        self._held_since = None

    def _admit(self) -> bool:
        now = self.clock()
        self._allowance = min(self.per_s * BURST_S, self._allowance + (now - self._refilled) * self.per_s)
        self._refilled = now
        if self._allowance >= 1.0:
            self._allowance -= 1.0
            return True
        return False

    def _hold(self, line: dict[str, Any]) -> None:
        group = (line.get("status"), line.get("method"), line.get("route"), line.get("client"), line.get("key_id"))
        if group in self._held or len(self._held) < MAX_GROUPS:
            self._held[group] += 1
        else:
            self._others += 1
        if self._held_since is None:
            self._held_since = (self.clock(), time.time())
            try:  # a summary within the minute, even if no other request comes
                self._timer = asyncio.get_running_loop().call_later(SUMMARY_EVERY_S, self.flush)
            except RuntimeError:  # no loop (a test): at the next write past the minute, or at flush
                pass

    def _emit(self, line: dict[str, Any]) -> None:
        try:
            self.logger.info(json.dumps({k: v for k, v in line.items() if v is not None}))
        except Exception:  # a full disk must not fail the request that was served
            logging.getLogger(__name__).exception("could not write the request log")


class RequestLog:
    """ASGI middleware: counts a request's bytes both ways and writes its line when it ends."""

    def __init__(self, app: ASGIApp, lines: RequestLines, metrics: ServerMetrics | None = None) -> None:
        self.app = app
        self.lines = lines
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
            "path": redacted(scope.get("path", "")),
            "status": counts["status"] or 500,  # none sent: the connection ended first
            "ms": round(seconds * 1000, 2),
            "bytes_in": counts["in"],
            "bytes_out": counts["out"],
            "client": (scope.get("client") or (None,))[0],
            **state.get("log", {}),
        }
        if self.metrics is not None:
            self.metrics.observe_request(line["route"], line["method"], line["status"], seconds)
        self.lines.write(line)
