"""What was done to each key's checkpoints and sessions, and by whom: ``AdminClient.get_audit_log``.

An entry belongs to the key whose resource it concerns (``owner``) and names the key that acted
(``actor``; None for the server's own doing, a TTL's expiry). A key reads the entries that
concern its resources or that it did: keys are tenants here, so there is no organization-wide
admin; the operator has the request log besides. Events (``<resource>_<action>``):

- ``checkpoint_create``, ``checkpoint_delete`` (by its owner, or ``reason: "ttl"``),
  ``checkpoint_publish``, ``checkpoint_unpublish``;
- ``checkpoint_read``: another key used a published checkpoint, with the ``purpose``
  (``load``, ``sample``, ``download``, ``copy``, ``describe``): its first such use of the UTC day
  (a server restart may record one more); an owner's use of its own is not an event;
- ``project_session_assign``: a session was moved to a project.

Entries are kept ``RETENTION_S`` (90 days). Writing one never fails the call it records.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, date, datetime

from hosted_tinker.core.checkpoints import TinkerPath
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.protocol.responses import iso_time

log = logging.getLogger(__name__)

RETENTION_S = 90 * 24 * 3600
DAY_S = 24 * 3600
MAX_READS_REMEMBERED = 100_000
# The SDK's event_type values, and the event names each takes (teams and organizations: none here).
EVENT_TYPES = {"all": "", "checkpoints": "checkpoint_", "projects": "project_", "teams": None, "organizations": None}


class AuditLog:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock
        self._reads: set[tuple[str, str, str]] = set()  # (reader, path, purpose) recorded on _reads_day
        self._reads_day = -1
        self._lock = threading.Lock()  # reads are recorded from the event loop and from threads

    def record(self, owner: str, event: str, actor: str | None, **details: object) -> None:
        try:
            self.store.add_audit(self._clock(), owner, actor, event, {"actor": actor, **details})
        except Exception:  # what it records has happened; the entry is what is lost, and said so
            log.exception("could not record the audit event %s of %r", event, owner)

    def checkpoint(self, event: str, path: TinkerPath, actor: str | None, **details: object) -> None:
        """An event of the checkpoint at ``path``, recorded for the key that owns its run."""
        self._checkpoint(self._owner(path), event, path, actor, **details)

    def read(self, path: TinkerPath, reader: str, purpose: str) -> None:
        """``reader`` used the checkpoint (checked readable): an event when it is another's, the
        first such read of the UTC day for that purpose (so that another key's calls cannot grow
        an owner's log past one entry per checkpoint, purpose and day)."""
        owner = self._owner(path)
        if owner == reader:
            return
        day, seen = int(self._clock() // DAY_S), (reader, str(path), purpose)
        with self._lock:
            if day != self._reads_day or len(self._reads) >= MAX_READS_REMEMBERED:
                self._reads_day, self._reads = day, set()  # (too many to remember: an entry more, at worst)
            if seen in self._reads:
                return
            self._reads.add(seen)
        self._checkpoint(owner, "checkpoint_read", path, reader, purpose=purpose, first_of_the_day=True)

    def _owner(self, path: TinkerPath) -> str | None:
        """The key that opened the session the checkpoint's run belongs to (ids name it)."""
        return self.store.session_owner(path.run_id.partition(":")[0])

    def _checkpoint(
        self, owner: str | None, event: str, path: TinkerPath, actor: str | None, **details: object
    ) -> None:
        if owner is not None:
            self.record(owner, event, actor, model_id=path.run_id, tinker_path=str(path), **details)

    def entries(self, key: str, event_type: str, day: date | None) -> rsp.AuditLogResponse:
        """``AuditLogResponse``: what concerned ``key``'s resources or was done by it on ``day``
        (UTC, default today), oldest first."""
        prefix = EVENT_TYPES[event_type]
        if prefix is None:
            return rsp.AuditLogResponse(entries=[])
        start = datetime.combine(day or datetime.now(UTC).date(), datetime.min.time(), UTC).timestamp()
        rows = self.store.audit_of(key, start, start + DAY_S, prefix)  # (seconds: 9999-12-31 has an end too)
        return rsp.AuditLogResponse(entries=[_entry(at, event, details) for at, event, details in rows])

    def delete_expired(self) -> int:
        return self.store.delete_audit_before(self._clock() - RETENTION_S)


def _entry(at: float, event: str, details: dict) -> rsp.AuditLogEntry:
    # The SDK's deprecated copies of checkpoint events' details (null on other events).
    return rsp.AuditLogEntry(
        timestamp=iso_time(at).isoformat(),
        event=event,
        event_details=details,
        model_id=details.get("model_id"),
        tinker_path=details.get("tinker_path"),
        purpose=details.get("purpose"),
    )
