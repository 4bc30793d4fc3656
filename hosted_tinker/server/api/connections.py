"""Deadlines and a size bound for a request's head and body, kept in uvicorn's HTTP protocol.

uvicorn (httptools) arms one timer per connection, the keep-alive one after a response, and any
byte received cancels it. A client that sends its headers a byte at a time, or starts a body and
stalls, holds its connection (and, once the headers are in, a running request) for as long as it
likes, and httptools buffers whatever headers it sends. ``http_protocol`` gives ``uvicorn.run``
a protocol class that closes such connections:

- the request line and headers must arrive within ``header_timeout_s`` of the connection being
  made, or on a kept-alive connection of the next request's first byte (the idle time between
  requests is uvicorn's keep-alive), and within ``max_header_bytes``: else a 408 or a 431;
- a body must keep coming: it must be complete ``body_timeout_s`` after its headers, plus a
  second for every ``min_body_rate`` bytes received (mod_reqtimeout's rule), else a 408 if the
  app has not answered yet.

Time the server itself is not reading (a pipelined request queued behind another, a body the app
has not consumed yet, a client waiting for ``100 Continue``) does not count against the client.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from hosted_tinker.core.config import ServerConfig


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # request line and headers, from the request's first byte
    body_timeout_s: float = 30.0  # a body, from the end of its headers ...
    min_body_rate: int = 16 << 10  # ... plus 1 s per this many bytes received; 0: no extension
    max_header_bytes: int = 64 << 10  # request line and headers (431 above)

    @classmethod
    def from_config(cls, config: ServerConfig) -> ConnectionLimits:
        return cls(config.header_timeout_s, config.body_timeout_s, config.min_body_rate, config.max_header_bytes)


def http_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol holding its connections to ``limits``, for ``uvicorn.run(http=...)``
    (which takes a class, so the limits are its class attribute)."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """One timer per connection, for the phase under way (a head, a body, or none while a request
    runs or the connection idles). It is moved only when a deadline comes nearer; a body's deadline
    grows as bytes arrive, so when the timer fires early it is re-armed for the deadline as it is
    then, instead of being moved for every chunk."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: Literal["head", "body"] | None = None
        self._since = 0.0  # when the phase began, or when the server last held the client up
        self._bytes = 0  # head: bytes received for it; body: body bytes received
        self._parsed = 0  # bytes of request line and headers the parser has handed over
        self._heads = 0  # counts heads, to tell whether a chunk lay wholly inside one
        self._began = False  # the head has a request's first byte (else the connection is idle)
        self._refused = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase is None:  # a request's first bytes (or bare CRLFs, which begin none)
            self._expect("head")
        head = self._heads if self._phase == "head" else -1
        super().data_received(data)
        if self._phase == "head" and self._heads == head and not self.transport.is_closing():
            # The whole chunk belongs to a head still unfinished. (A head begun mid-chunk is
            # measured once parsed, in on_headers_complete: at most one chunk more is buffered.)
            self._bytes += len(data)
            if self._bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        if self._refused:
            return
        if self._phase is None:  # pipelined: begun in the chunk that ended the request before
            self._expect("head")
        self._began, self._parsed = True, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._parsed += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        if self._parsed > self.limits.max_header_bytes:
            self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes")
            return
        self._expect("body")
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._stop()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._stop()  # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade()

    def _expect(self, phase: Literal["head", "body"]) -> None:
        self._phase, self._since, self._bytes = phase, self.loop.time(), 0
        if phase == "head":
            self._heads += 1
            self._began = False
        self._arm(self._deadline())

    def _stop(self) -> None:
        self._phase = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            if self._timer_at <= at:
                return  # it fires first, and re-arms
            self._timer.cancel()
        self._timer, self._timer_at = self.loop.call_at(at, self._fired), at

    def _deadline(self) -> float:
        if self._phase == "head":
            return self._since + self.limits.header_timeout_s
        rate = self.limits.min_body_rate
        return self._since + self.limits.body_timeout_s + (self._bytes / rate if rate else 0.0)

    def _fired(self) -> None:
        self._timer = None
        if self._phase is None or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused or (self._phase == "body" and self.cycle.waiting_for_100_continue):
            self._since = now  # the server holds the client up, not the other way round: start again
        deadline = self._deadline()
        if now < deadline:
            self._arm(deadline)
        elif self._phase == "head":
            self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s")
        else:
            rate = self.limits.min_body_rate
            within = f"{self.limits.body_timeout_s:g} s" + (f" plus 1 s per {rate} bytes" if rate else "")
            self._refuse(408, f"request body not received within {within}")

    def _refuse(self, status: int, detail: str) -> None:
        """Answer ``status`` with ``connection: close``, and close. The answer is left out where the
        client could take it for another request's: on a connection idle between requests, behind
        a response under way, or after the app has begun answering this request itself."""
        phase, cycle = self._phase, self.cycle
        self._stop()
        self._refused = True
        if phase == "head":
            answer = self._began and (cycle is None or cycle.response_complete)
        else:
            answer = not cycle.response_started
        if answer and not self.pipeline:
            if phase == "body":  # as connection_lost would, now: the app must not write after this
                cycle.disconnected = True
                cycle.message_event.set()
            body = json.dumps({"detail": detail}).encode()
            head = [STATUS_LINE[status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
        self.logger.info("%s: %s; closing the connection", self.client, detail)
        self.transport.close()
