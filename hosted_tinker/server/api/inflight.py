"""``BodyBytes``: the request bodies the API process holds at once, as received and as inflated,
bounded per key and in all.

The body limits bound one request; this bounds how many a key may have in flight together (an
attacker's eight concurrent 120 MiB uploads took 2.1 GB of the gateway). A keyed request's body
takes its bytes as they arrive (``RECEIVED_COPIES`` of each; a declared Content-Length that would
not fit now is refused before any is read) and as ``forward_backward`` inflates them, and gives
them back once it is read (``forward_backward``: decoded), so a request that then waits (a long
poll) or sends a large answer holds nothing. Past its key's bound
(``Limits.body_bytes``) it is a 429, past the server's (``--max-inflight-body-bytes``) a 503,
both with Retry-After, which the SDK waits out and resends (the ``seq_id`` is not used up).
A body is never refused while nothing else is held (its key's, for the key's bound; anyone's,
for the server's): one body alone is bounded by the body limits, and a bound it could never fit
would make the SDK resend it forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hosted_tinker.core.errors import ApiError

RETRY_AFTER_S = 1
# A body is in memory twice while it is read: Starlette keeps the pieces as they come, then joins
# them (``Request.body``). A received byte is held as this many.
RECEIVED_COPIES = 2


class BodyBytes:
    """Thread-safe (``forward_backward`` inflates on a worker thread)."""

    def __init__(self, total: int, per_key: Callable[[str], int | None]) -> None:
        """``per_key(tenant)``: that key's bound (None: none, as on an open server)."""
        self.total = total
        self.per_key = per_key
        self.held = 0
        self._by_key: dict[str, int] = {}
        self._lock = threading.Lock()

    def hold(self, tenant: str | None) -> Hold:
        """An empty hold for one request (``tenant`` None: a request without a key)."""
        return Hold(self, tenant)

    def status(self) -> dict:
        """For /healthz: the server's bound and what is held now, by how many keys."""
        with self._lock:
            return {"max_bytes": self.total, "held_bytes": self.held, "keys_holding": len(self._by_key)}

    def _take(self, hold: Hold, size: int, only_check: bool = False) -> None:
        key_bound = self.per_key(hold.tenant) if hold.tenant is not None else None
        with self._lock:
            key_held = self._by_key.get(hold.tenant, 0) if hold.tenant is not None else 0
            if key_bound is not None and key_held > hold.bytes and key_held + size > key_bound:
                raise _refusal(
                    429,
                    f"limit body_bytes reached: at most {key_bound} bytes of request bodies in flight for this key "
                    f"({key_held} held by its other requests); retry when they are answered",
                )
            if self.held > hold.bytes and self.held + size > self.total:
                raise _refusal(
                    503,
                    f"the server holds {self.held} bytes of request bodies, its bound is {self.total} "
                    "(--max-inflight-body-bytes); retry shortly",
                )
            if only_check:
                return
            self.held += size
            hold.bytes += size
            if hold.tenant is not None:
                self._by_key[hold.tenant] = key_held + size

    def _release(self, hold: Hold) -> None:
        with self._lock:
            self.held -= hold.bytes
            if hold.tenant is not None:
                left = self._by_key.get(hold.tenant, 0) - hold.bytes
                if left > 0:
                    self._by_key[hold.tenant] = left
                else:
                    self._by_key.pop(hold.tenant, None)
            hold.bytes = 0


class Hold:
    """One request's bytes in ``BodyBytes``: ``take`` as they come, ``release`` once read (idempotent)."""

    def __init__(self, ledger: BodyBytes, tenant: str | None) -> None:
        self.ledger = ledger
        self.tenant = tenant
        self.bytes = 0

    def take(self, size: int) -> None:
        """Hold ``size`` more bytes, or raise the 429/503 that refuses them."""
        self.ledger._take(self, size)

    def check(self, size: int) -> None:
        """Raise the 429/503 that ``take(size)`` would, taking nothing."""
        self.ledger._take(self, size, only_check=True)

    def receive(self, size: int) -> None:
        """Hold ``size`` bytes of body, as read (``RECEIVED_COPIES`` of each)."""
        self.take(RECEIVED_COPIES * size)

    def release(self) -> None:
        self.ledger._release(self)


def _refusal(status: int, detail: str) -> ApiError:
    code = "quota_exceeded" if status == 429 else "server_busy"
    return ApiError(status, detail, headers={"Retry-After": str(RETRY_AFTER_S)}, code=code)
