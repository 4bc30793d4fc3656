"""Per-key limits: what one API key may hold at once and how fast it may call.

The operator sets the defaults (``serve --key-limit NAME=VALUE``) and may give one key its own
(``keys create --limit``, ``keys limit``; shown by ``keys show``). A request over a limit is
refused before anything is created, with a body that names the limit and its value:

===================  =====================================================  ======
limit                what it bounds                                         refusal
===================  =====================================================  ======
``sessions``         live sessions (active, heard from within ``LIVE_S``)   403
``models``           live training models (loaded, in a live session)       403
``adapter_bytes``    worker memory of those models' LoRA: weights,          403
                     gradients, optimizer state (``core.types.adapter_bytes``)
``lora_rank``        the rank of a new LoRA (default: ``--max-lora-rank``)  400
``metadata_bytes``   a ``user_metadata`` object, as JSON                    400
``checkpoint_bytes`` the key's stored checkpoints (never past it)          403
``requests_per_s``   calls per second, in bursts of ``BURST_S`` seconds'    429
``pending``          requests accepted and unfinished (queued or running)   429
``pending_bytes``    the forward_backward batches those hold, in bytes      429
``sample_tokens``    n * (prompt + max_tokens) of its sampler requests      429
``body_bytes``       request bodies in flight, as received and inflated     429
``custom_loss_bytes``  custom losses stored for its unfinished sessions     403
``record_bytes``     routing kept in its live sampling records (routing     kept without
                     replay: ``server.persistence.sequences``)             routing
===================  =====================================================  ======

A server without keys (open, for one user on loopback) has no per-key limits. Sessions and
models of a client that stopped heartbeating do not count: they are not live.

Counts are checked and taken in one step on the event loop (nothing awaits in between). Stored
checkpoint bytes are known only once a save is written, so a save reserves its likely size when
it is submitted (``reserve_checkpoint``: refused at once if the key's stored and reserved bytes
would pass the limit) and settles the true size when written, recording the checkpoint under the
same lock that checks it (``Reservation.settle`` before it is written: refused if it would
pass; ``commit`` once it is): however many saves run at once, what a key stores never passes
its limit.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hosted_tinker.core.errors import ApiError
from hosted_tinker.core.types import LoraSpec, adapter_bytes, lora_params
from hosted_tinker.server.keys import OPEN
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol.strict import is_text
from hosted_tinker.server.scheduler import QueueLimits

LIVE_S = 120.0  # the SDK heartbeats every 10 s and warns after 2 min without one
BURST_S = 10.0  # a key may spend this many seconds' worth of requests at once
CACHE_S = 5.0  # a key's own limits are re-read this often (``keys limit`` from another process)
MAX_TENANTS = 1 << 16  # remembered at once (limits and rate buckets); past it, all are forgotten
MAX_SESSIONS = 1 << 16  # sessions' owners remembered at once; past it, all are forgotten


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sessions: int = Field(64, ge=0)
    models: int = Field(16, ge=0)
    # A mixture-of-experts LoRA is ~20x a dense one of the same rank (Qwen3-30B-A3B, every group, rank 32:
    # 7.9 GB with AdamW): a count of models alone would let one key take a GPU's memory
    adapter_bytes: int = Field(32 << 30, ge=0)
    lora_rank: int | None = Field(None, ge=1)  # None: the server's --max-lora-rank
    metadata_bytes: int = Field(64 << 10, ge=0)
    checkpoint_bytes: int = Field(1 << 40, ge=0)
    requests_per_s: float = Field(100.0, ge=0)  # 0: unlimited
    pending: int | None = Field(None, ge=1)  # None: --max-pending / PENDING_SHARE
    pending_bytes: int | None = Field(None, ge=1)  # None: --max-pending-bytes / PENDING_SHARE
    # n * (prompt + max_tokens) of the key's requests to the embedded sampler in flight (429 above; one
    # always fits when the key has none: serving.sample_budget); 4 x --max-sample-tokens' default
    sample_tokens: int = Field(1 << 18, ge=1)
    body_bytes: int | None = Field(None, ge=1)  # None: --max-inflight-body-bytes / BODY_SHARE (api.inflight)
    custom_loss_bytes: int = Field(16 << 20, ge=0)  # graphs as stored (serving.custom_losses), of unfinished sessions
    # routing replay's records of the key's live sampling records (a day each): Qwen3-30B-A3B's
    # 768 bytes a token make 8 GiB ~11 M sampled tokens a day; past it, records keep no routing
    record_bytes: int = Field(8 << 30, ge=0)


# Unless told otherwise a key may hold a quarter of the requests (and bytes) the server keeps
# pending: one key cannot fill its bounds (with requests that wait for a seq_id it never sends,
# say) and leave every other key only 429s.
PENDING_SHARE = 4
# A key may hold half the request bodies the server holds at once (with the default bounds, one
# of the largest size as it is read; more while it holds nothing else: api.inflight).
BODY_SHARE = 2
# The limits whose default (None above) the server derives from its own settings.
DERIVED = {
    "lora_rank": "--max-lora-rank",
    "pending": f"--max-pending / {PENDING_SHARE}",
    "pending_bytes": f"--max-pending-bytes / {PENDING_SHARE}",
    "body_bytes": f"--max-inflight-body-bytes / {BODY_SHARE}",
}


def parse_limits(items: list[str], where: str) -> dict[str, Any]:
    """``NAME=VALUE`` settings, checked against ``Limits`` (a ValueError names the bad one)."""
    settings: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in Limits.model_fields:
            raise ValueError(f"{where} {item!r}: expected NAME=VALUE with NAME one of {', '.join(Limits.model_fields)}")
        settings[name.strip()] = value.strip()
    try:
        return Limits(**settings).model_dump(include=set(settings))
    except ValidationError as e:
        raise ValueError(f"{where}: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None


class Quotas:
    """The limits of each key, checked by the services as they admit a request (counts and sizes:
    ``serving``, where a refused ordered request still uses up its seq_id) and by ``KeyCheck``
    (rate). Runs on the event loop; its reads are single-row SQLite queries."""

    def __init__(
        self,
        store: Store,
        defaults: Limits,
        max_lora_rank: int,
        queue: QueueLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        inflight_body_bytes: int = 1 << 30,
        lora_params_per_rank: dict[str, int] | None = None,
    ) -> None:
        """``max_lora_rank``, ``queue`` and ``inflight_body_bytes`` (the server's bounds) give the
        limits ``DERIVED`` names; ``lora_params_per_rank`` (the served model's) sizes adapters."""
        self.store = store
        self.lora_params_per_rank = lora_params_per_rank or {}
        self.defaults = defaults
        self.max_lora_rank = max_lora_rank
        queue = queue or QueueLimits()
        self.pending_shares = (
            max(queue.max_pending // PENDING_SHARE, 1),
            max(queue.max_pending_bytes // PENDING_SHARE, 1),
        )
        self.body_share = max(inflight_body_bytes // BODY_SHARE, 1)
        self._clock = clock
        self._own: dict[str, tuple[float, Limits]] = {}  # tenant -> (read at, limits)
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (tenant, bucket) -> (tokens, at)
        self._owners: dict[str, str] = {}  # session id -> the key that opened it
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}  # tenant -> checkpoint bytes of saves not yet written
        self._checkpoints = threading.Lock()  # checks and records of stored checkpoint bytes

    def of(self, tenant: str) -> Limits | None:
        """The limits ``tenant`` is held to (None on an open server)."""
        if tenant == OPEN:
            return None
        now = self._clock()
        cached = self._own.get(tenant)
        if cached is None or now - cached[0] > CACHE_S:
            own = self.store.api_key_limits(tenant)  # {} for keys from a file or --dev-any-key
            cached = (now, self.defaults.model_copy(update=own) if own else self.defaults)
            if len(self._own) >= MAX_TENANTS:  # --dev-any-key makes a tenant of every key: bound both maps
                with self._lock:
                    self._own.clear()
                    self._buckets.clear()
            self._own[tenant] = cached
        return cached[1]

    # ---- pending requests (the scheduler's ``KeyBounds``) -------------------------------------

    def owner(self, subject: str) -> str | None:
        """The key that opened the session a model or sampler id starts with (asked for twice
        per request, by the scheduler's bounds and its bookkeeping: a session's owner never
        changes, so it is remembered)."""
        if not is_text(subject):
            return None
        session_id = subject.partition(":")[0]
        owner = self._owners.get(session_id)
        if owner is None and (owner := self.store.session_owner(session_id)) is not None:
            if len(self._owners) >= MAX_SESSIONS:
                self._owners.clear()
            self._owners[session_id] = owner
        return owner

    def pending(self, owner: str) -> tuple[int, int] | None:
        limits = self.of(owner)
        if limits is None:
            return None
        count, held = self.pending_shares
        return (limits.pending or count, limits.pending_bytes or held)

    def body_bytes(self, tenant: str) -> int | None:
        """The bytes of request bodies ``tenant`` may have in flight (``api.inflight``)."""
        limits = self.of(tenant)
        if limits is None:
            return None
        return limits.body_bytes or self.body_share

    # ---- rate (KeyCheck) --------------------------------------------------------------------

    def admit(self, tenant: str, bucket: str = "requests") -> ApiError | None:
        """Take one request from ``tenant``'s ``bucket`` (each holds ``requests_per_s``); a 429
        (with Retry-After) when it is empty."""
        limits = self.of(tenant)
        if limits is None or limits.requests_per_s == 0:
            return None
        rate, now = limits.requests_per_s, self._clock()
        with self._lock:
            burst = max(rate * BURST_S, 1.0)  # below 0.1/s a bucket of less than one would refuse all
            tokens, at = self._buckets.get((tenant, bucket), (burst, now))
            tokens = min(burst, tokens + (now - at) * rate)
            if tokens < 1:
                self._buckets[(tenant, bucket)] = (tokens, now)
                wait = (1 - tokens) / rate
                over = _over("requests_per_s", rate, f"requests per second for this key; retry in {wait:.2f} s", 429)
                over.headers["Retry-After"] = str(max(1, round(wait)))
                return over
            self._buckets[(tenant, bucket)] = (tokens - 1, now)
        return None

    # ---- counts and sizes (services) --------------------------------------------------------

    def new_session(self, tenant: str, user_metadata: dict | None) -> None:
        limits = self.of(tenant)
        if limits is None:
            return
        self._metadata(limits, user_metadata, "user_metadata")
        live = self.store.usage(tenant, live_since=time.time() - LIVE_S)["sessions"]
        if live >= limits.sessions:
            raise _over("sessions", limits.sessions, f"live sessions for this key ({live} open)", 403)

    def new_model(self, tenant: str, lora: LoraSpec, user_metadata: dict | None) -> None:
        limits = self.of(tenant)
        if limits is None:
            return
        self._rank(limits, lora.rank)
        self._metadata(limits, user_metadata, "user_metadata")
        live = self.store.usage(tenant, live_since=time.time() - LIVE_S)["models"]
        if live >= limits.models:
            detail = f"live training models for this key ({live} loaded; unload one or close its client)"
            raise _over("models", limits.models, detail, 403)
        need = adapter_bytes(lora, self.lora_params_per_rank)
        held = sum(adapter_bytes(LoraSpec(**spec), self.lora_params_per_rank) for spec in self.store.live_loras(tenant))
        if held + need > limits.adapter_bytes:
            detail = (
                f"bytes of worker memory for this key's LoRA adapters: this one takes {need} (weights, gradients "
                f"and optimizer state at rank {lora.rank}), its {live} live models {held}"
            )
            raise _over("adapter_bytes", limits.adapter_bytes, detail, 403)

    def _rank(self, limits: Limits, rank: int) -> None:
        max_rank = limits.lora_rank if limits.lora_rank is not None else self.max_lora_rank
        if rank > max_rank:
            raise _over("lora_rank", max_rank, "for this key's LoRA (lora_config.rank)", 400)

    def reserve_upload(self, tenant: str, lora: LoraSpec) -> Reservation:
        """An adapter upload's hold on the key's checkpoint bytes: an export of ``lora``'s shape
        (float32), within the key's LoRA rank; taken before its layout is made on the worker."""
        limits = self.of(tenant)
        if limits is not None:
            self._rank(limits, lora.rank)
        held = self.reserve_checkpoint(tenant, None, 4 * lora_params(lora, self.lora_params_per_rank))
        if isinstance(held, ApiError):
            raise held
        return held

    def reserve_checkpoint(self, tenant: str, user_metadata: dict | None, estimate: int = 0) -> Reservation | ApiError:
        """A save's hold on the key's checkpoint bytes, ``estimate`` of them taken now; or its
        refusal (returned: an ordered save still uses up its seq_id)."""
        limits = self.of(tenant)
        if limits is None:
            return Reservation(self, tenant, None, 0)
        try:
            self._metadata(limits, user_metadata, "user_metadata")
        except ApiError as e:
            return e
        with self._checkpoints:
            stored = self._stored(tenant)
            reserved = self._reserved.get(tenant, 0)
            if stored >= limits.checkpoint_bytes or stored + reserved + estimate > limits.checkpoint_bytes:
                return _over_checkpoints(limits.checkpoint_bytes, stored, reserved)
            held = Reservation(self, tenant, limits.checkpoint_bytes, 0)
            held._take(estimate)
        return held

    def _stored(self, tenant: str) -> int:
        return self.store.usage(tenant, live_since=time.time() - LIVE_S)["checkpoint_bytes"]

    def new_custom_loss(self, tenant: str, size: int, stored: Callable[[], int]) -> None:
        """A 403 if a custom loss of ``size`` bytes would take what the key stores (``stored()``)
        past ``custom_loss_bytes``; checked and stored in one step on the event loop."""
        limits = self.of(tenant)
        if limits is not None and (held := stored()) + size > limits.custom_loss_bytes:
            detail = f"bytes of custom losses stored for this key's unfinished sessions ({held} stored, {size} sent)"
            raise _over("custom_loss_bytes", limits.custom_loss_bytes, detail, 403)

    @staticmethod
    def _metadata(limits: Limits, user_metadata: dict | None, field: str) -> None:
        size = len(json.dumps(user_metadata or {}, separators=(",", ":")).encode())
        if size > limits.metadata_bytes:
            raise _over("metadata_bytes", limits.metadata_bytes, f"bytes of {field} as JSON ({size} sent)", 400)


class Reservation:
    """Checkpoint bytes one save holds from its submission until it is written (``settle``) or
    gives up (``release``); thread-safe: saves are written on the dispatch thread."""

    def __init__(self, quotas: Quotas, tenant: str, limit: int | None, held: int) -> None:
        self.quotas = quotas
        self.tenant = tenant
        self.limit = limit  # None: the key has no limits (an open server)
        self.held = held  # bytes in ``quotas._reserved``

    def settle(self, size: int, replaces: int = 0) -> None:
        """The save's true size is known (before it is written): hold exactly ``size`` bytes in
        place of ``replaces`` (an overwritten checkpoint's), or raise the refusal (released) if the
        key's stored bytes, what its other saves hold and this one would pass the limit."""
        with self.quotas._checkpoints:
            self._release()
            if self.limit is not None:
                stored, others = self.quotas._stored(self.tenant), self.quotas._reserved.get(self.tenant, 0)
                if stored - replaces + size + others > self.limit:
                    raise _over_checkpoints(self.limit, stored, others, size)
            self._take(max(size - replaces, 0))

    def commit(self, record: Callable[[], None]) -> None:
        """The save is written: ``record`` its row (from which it counts as stored) and release
        what it held, in one step for whoever checks next."""
        with self.quotas._checkpoints:
            try:
                record()
            finally:
                self._release()

    def release(self) -> None:
        with self.quotas._checkpoints:
            self._release()

    def _take(self, size: int) -> None:
        if self.limit is not None and size:
            self.quotas._reserved[self.tenant] = self.quotas._reserved.get(self.tenant, 0) + size
            self.held = size

    def _release(self) -> None:
        if self.held:
            reserved = self.quotas._reserved
            reserved[self.tenant] = reserved.get(self.tenant, 0) - self.held
            if reserved[self.tenant] <= 0:
                del reserved[self.tenant]
            self.held = 0


def store_checkpoint(
    held: Reservation | None,
    size: int,
    write: Callable[[], object],  # (what it returns is not used)
    record: Callable[[], None],
    *,
    replaces: int = 0,
    undo: Callable[[], None] | None = None,
) -> None:
    """Write a checkpoint of ``size`` bytes and ``record`` its row under ``held``, the key's
    reservation (None: no limits): over the key's checkpoint bytes it is refused before anything
    is written; whatever fails, the reservation is let go. ``undo`` removes a written checkpoint
    whose row could not be recorded (a write is atomic: one that fails leaves nothing, and must
    not take an existing checkpoint of that name with it). ``replaces``: the bytes of the
    checkpoint it overwrites."""
    written = False
    try:
        if held is not None:
            held.settle(size, replaces=replaces)
        write()
        written = True
        if held is not None:
            held.commit(record)
        else:
            record()
    except BaseException:
        if held is not None:
            held.release()
        if written and undo is not None:
            undo()
        raise


def _over_checkpoints(limit: int, stored: int, reserved: int, size: int | None = None) -> ApiError:
    this = f"; this one is {size}" if size is not None else ""
    detail = (
        f"bytes of stored checkpoints for this key ({stored} stored, {reserved} being saved{this}; "
        "delete some to save more)"
    )
    return _over("checkpoint_bytes", limit, detail, 403)


def _over(limit: str, value: float, what: str, status: int) -> ApiError:
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return ApiError(status, f"limit {limit} reached: at most {shown} {what}", code="quota_exceeded")
