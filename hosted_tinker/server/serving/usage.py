"""What each key used, hour by hour (``AdminClient.get_billing_usage``), and what its checkpoints
hold now (``get_current_checkpoint_storage_usage``): for an operator who charges tenants back,
or a tenant who watches its own use.

Recorded as it happens, in the store's ``usage`` table (kept for good, unlike results), per UTC
hour, key, session and base model:

- ``training``: the tokens of every ``forward_backward`` and ``forward`` call that succeeded;
- ``sampling_prefill``: a sampling request's prompt tokens, once however many samples it asks
  (never ``cached``: which prompt positions an engine found in a prefix cache is not reported);
- ``sampling_sample``: the tokens it sampled, over all its samples;
- ``checkpoint``: each ``save_state``, ``save_weights_for_sampler`` and ``save_weights_external``;
- ``storage``: gigabyte-hours of the key's unexpired checkpoints, accrued at each retention
  sweep (at most 10 minutes apart) for the time since the last one, while the server runs.

OpenAI ``/v1`` requests count with no session (``session_id`` None); those the ``/v1`` proxy
forwards to vLLM count as vLLM reports them (``openai_proxy.Meter``). No prices: this server
bills nobody, so costs and rates are None.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from hosted_tinker.core.errors import bad_request
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.persistence.store_rows import DEFAULT_PROJECT
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.responses import iso_time

log = logging.getLogger(__name__)

HOUR = 3600
GIGABYTE = 10**9  # decimal, as storage is billed
MAX_WINDOW_S = 14 * 24 * HOUR  # the service's bound on one query


@dataclass(frozen=True)
class Charge:
    """Whom a use is counted against: a key, one of its sessions ('' for none), a base model."""

    owner: str
    session_id: str
    base_model: str


class UsageLedger:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock
        self._runs: dict[str, Charge] = {}  # a training run's charge, fixed when it was made
        self._accrued_at: float | None = None  # the last storage accrual

    # ---- recording (never fails the call it counts) -------------------------------------------

    def trained(self, model_id: str, tokens: int) -> None:
        """On the dispatch thread, as a forward_backward or forward call succeeds."""
        self._add(self._run(model_id), "training", tokens)

    def checkpoint_saved(self, model_id: str) -> None:
        self._add(self._run(model_id), "checkpoint", 1)

    def sampled(self, charge: Charge, prompt_tokens: int, sampled_tokens: int) -> None:
        self._add(charge, "sampling_prefill", prompt_tokens)
        self._add(charge, "sampling_sample", sampled_tokens)

    def accrue_storage(self) -> None:
        """At each retention sweep: every key's stored bytes for the time since the last one."""
        now, since = self._clock(), self._accrued_at
        self._accrued_at = now
        if since is None:
            return
        hours = (now - since) / HOUR
        for owner, session_id, base_model, size in self.store.stored_bytes():
            self._add(Charge(owner, session_id, base_model), "storage", size / GIGABYTE * hours)

    def _run(self, model_id: str) -> Charge | None:
        charge = self._runs.get(model_id)
        if charge is None:
            model = self.store.get_model(model_id)
            if model is None:
                return None
            owner = self.store.session_owner(model.session_id) or ""
            charge = self._runs[model_id] = Charge(owner, model.session_id, model.base_model)
        return charge

    def _add(self, charge: Charge | None, kind: str, quantity: float) -> None:
        if charge is None or quantity <= 0:
            return
        bucket = int(self._clock() // HOUR * HOUR)
        try:
            self.store.add_usage(bucket, charge.owner, charge.session_id, charge.base_model, kind, quantity)
        except Exception:  # the call succeeded; its count is what is lost, and said so
            log.exception("could not record %s %s of %s", quantity, kind, charge)

    # ---- reading --------------------------------------------------------------------------

    def report(
        self, owner: str, owner_name: str | None, starting_on: datetime, ending_before: datetime
    ) -> rsp.BillingUsageResponse:
        """``owner``'s usage in the UTC hours [starting_on, ending_before), as ``BillingUsageResponse``."""
        start, end = _hour(starting_on, "starting_on"), _hour(ending_before, "ending_before")
        if start > self._clock():
            raise bad_request("starting_on must not be in the future")
        if not start < end <= start + MAX_WINDOW_S:
            raise bad_request("ending_before must be after starting_on and at most 14 days after it")
        rows = self.store.usage_of(owner, start, end)
        known = {row.session_id: row for row in self.store.sessions_of(owner)} if rows else {}
        events: list[rsp.BillingUsageEvent] = []
        sessions: dict[str, rsp.BillingUsageSession] = {}
        for bucket, session_id, base_model, kind, quantity in rows:
            session = known.get(session_id)
            if session is not None:
                metadata = {k: str(v) for k, v in session.user_metadata.items()} or None
                sessions[session_id] = rsp.BillingUsageSession(user_metadata=metadata)
            events.append(
                rsp.BillingUsageEvent(
                    bucket_start=iso_time(bucket).isoformat(),
                    bucket_end=iso_time(bucket + HOUR).isoformat(),
                    base_model=base_model,
                    user_id=owner or "local",
                    user_name=owner_name,
                    session_id=session_id or None,
                    project_id=(session.project_id or DEFAULT_PROJECT) if session is not None else None,
                    estimated_cost_usd=None,
                    effective_rate_usd_per_million_tokens=None,
                    effective_rate_usd_per_gigabyte_month=None,
                    event_info=_event_info(kind, quantity),
                )
            )
        return rsp.BillingUsageResponse(data=events, sessions=sessions, cost_data_through=None)

    def stored_now(
        self, owner: str, owner_name: str | None, project_id: str | None
    ) -> rsp.CheckpointStorageUsageResponse:
        """``AdminClient.get_current_checkpoint_storage_usage``: the bytes ``owner``'s checkpoints
        hold now, per project (of ``project_id`` only if given). A key sees its own: keys are
        tenants here, not members of an organization."""
        usage = self.store.checkpoint_storage(owner, project_id)
        return rsp.CheckpointStorageUsageResponse(
            effective_rate_usd_per_gigabyte_month=None,
            data=[
                rsp.CheckpointStorageUsageItem(
                    project_id=project,
                    org_user_urn=owner or "local",
                    user_name=owner_name,
                    checkpoint_count=count,
                    size_bytes=size,
                    size_gigabytes=size / GIGABYTE,
                    estimated_monthly_cost_usd=None,
                )
                for project, count, size in usage
            ],
        )


def _hour(value: datetime, field: str) -> int:
    """A UTC hour boundary as a unix time (a time without a zone is UTC); 400 off the hour."""
    moment = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    seconds = moment.timestamp()
    if seconds % HOUR:
        raise bad_request(f"{field} must be on a UTC hour boundary, got {value.isoformat()}")
    return int(seconds)


def _event_info(kind: str, quantity: float) -> dict:
    if kind == "storage":
        return {"type": "storage", "free": False, "gigabyte_hours": quantity}
    if kind == "checkpoint":
        return {"type": "checkpoint", "count": round(quantity)}
    info = {"type": kind, "token_count": round(quantity)}
    return info | {"cached": False} if kind == "sampling_prefill" else info
