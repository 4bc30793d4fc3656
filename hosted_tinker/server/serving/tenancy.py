"""Who may touch what.

Every object belongs to the session it was made in: model ids are ``{session}:train:{n}``,
sampler ids ``{session}:sample:{n}``, a checkpoint lives under its model, and a future names its
model or sampler. A session belongs to the tenant (API key) that opened it. Another tenant gets
the same 404 as for an id that does not exist, so ids of others cannot even be confirmed.

A published checkpoint (``RestClient.publish_checkpoint_from_tinker_path``) can be read (loaded,
sampled, described) by every tenant; only its owner can change or delete it. Reading is checked
at every call, not once: a sampling session opened on it by another tenant ends (404) at its next
call once the owner unpublishes or deletes it.
"""

from __future__ import annotations

from hosted_tinker.core.checkpoints import CheckpointError, TinkerPath
from hosted_tinker.core.errors import not_found
from hosted_tinker.server.persistence.records import ModelRecord, SamplerRecord
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol.strict import is_text
from hosted_tinker.server.serving.audit import AuditLog


class Tenancy:
    def __init__(self, store: Store, audit: AuditLog | None = None) -> None:
        self.store = store
        self.audit = audit  # another key's reads of a published checkpoint are audit events

    def owns(self, tenant: str, object_id: str) -> bool:
        """Whether ``tenant`` opened the session that ``object_id`` (a session, model, run or
        sampler id) starts with. Ids name their session, so no other row is needed: an unknown
        id in one's own session passes here and is answered by the service's own 404."""
        if not is_text(object_id):  # no id holds a lone surrogate (and SQLite cannot be asked)
            return False
        return self.store.session_owner(object_id.partition(":")[0]) == tenant

    def session(self, tenant: str, session_id: str, field: str = "session_id") -> None:
        if ":" in session_id or not self.owns(tenant, session_id):
            raise not_found(f"{field} {session_id!r} does not exist")

    def model(self, tenant: str, model_id: str, field: str = "model_id") -> None:
        if not self.owns(tenant, model_id):
            raise not_found(f"{field} {model_id!r} does not exist")

    def run(self, tenant: str, run_id: str, field: str = "training run") -> ModelRecord:
        """``tenant``'s training run ``run_id``; 404 if it is another's or does not exist (a
        made-up id in one's own session passes ``owns``). Every route on a run asks here."""
        self.model(tenant, run_id, field)
        record = self.store.get_model(run_id)
        if record is None:
            raise not_found(f"{field} {run_id!r} does not exist")
        return record

    def visible_run(self, tenant: str, run_id: str, field: str = "training run") -> tuple[ModelRecord, bool]:
        """A run ``tenant`` owns, or another's with a published checkpoint (``access_scope``
        "accessible"), and whether ``tenant`` owns it; 404 for any other."""
        if self.owns(tenant, run_id):
            return self.run(tenant, run_id, field), True
        record = self.store.get_model(run_id) if is_text(run_id) else None
        if record is None or not self.store.has_public_checkpoint(run_id):
            raise not_found(f"{field} {run_id!r} does not exist")
        return record, False

    def sampler(self, tenant: str, sampler_id: str, field: str = "sampling_session_id") -> None:
        if not self.owns(tenant, sampler_id):
            raise not_found(f"{field} {sampler_id!r} does not exist")
        record = self.store.get_sampler(sampler_id)
        if record is not None and (why := self.cannot_sample(tenant, record)) is not None:
            raise not_found(f"{field} {sampler_id!r} samples {record.model_path}, which {why}")

    def may_sample(self, tenant: str, sampler: SamplerRecord) -> bool:
        return self.cannot_sample(tenant, sampler) is None

    def cannot_sample(self, tenant: str, sampler: SamplerRecord) -> str | None:
        """Why ``tenant`` may no longer sample the checkpoint ``sampler`` was opened on, if so:
        it was deleted, or it is another tenant's and no longer published."""
        if sampler.model_path is None:
            return None
        path = TinkerPath.parse(sampler.model_path)
        record = self.store.get_checkpoint(path.run_id, path.kind, path.name)
        if record is None:
            return "no longer exists (deleted, or past its TTL)"
        if not record.public and not self.owns(tenant, path.run_id):
            return "its owner no longer publishes"
        return None

    def future(self, tenant: str, request_id: str) -> None:
        # Through the id of the future's model or sampler, not that object's row: a retired
        # ephemeral sampler's finished samples stay readable.
        subject = self.store.future_subject(request_id)
        if subject is None or not self.owns(tenant, subject):
            raise not_found(f"request_id {request_id!r} does not exist")

    def can_read(self, tenant: str, path: TinkerPath) -> bool:
        """Whether ``tenant`` may load, sample or describe the checkpoint at ``path``."""
        if self.owns(tenant, path.run_id):
            return True
        record = self.store.get_checkpoint(path.run_id, path.kind, path.name)
        return record is not None and record.public

    def readable(self, tenant: str, path: str, field: str = "path", purpose: str | None = None) -> None:
        """404 for a ``tinker://`` path this tenant may not read; a malformed path is left to the
        service, which answers it with a 400 that says what is wrong. ``purpose``: what the read
        is for, recorded (``serving.audit``) when the checkpoint is another key's."""
        try:
            parsed = TinkerPath.parse(path)
        except CheckpointError:
            return
        if not self.can_read(tenant, parsed):
            raise not_found(f"{field}: checkpoint {path} does not exist")
        if purpose is not None and self.audit is not None:
            self.audit.read(parsed, tenant, purpose)
