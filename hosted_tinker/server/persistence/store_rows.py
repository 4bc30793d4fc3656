"""The rows of the server's SQLite file that the REST listings and API keys read and write, and
checkpoints as they are read: ``Store``'s mixins (their statements run through its ``_exec``,
under its lock)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from hosted_tinker.server.persistence.records import (
    ApiKeyRecord,
    CheckpointRecord,
    ModelRecord,
    SamplerRecord,
    SessionRow,
)

if TYPE_CHECKING:
    from hosted_tinker.core.checkpoints import TinkerPath
    from hosted_tinker.server.persistence.schema import Fetched

# A session created without a project belongs to this one (SessionSummary.project_id is required).
DEFAULT_PROJECT = "default"
MODEL_COLUMNS = (
    "m.model_id, m.session_id, m.model_seq_id, m.base_model, m.lora, m.user_metadata, m.status, m.created_at"
)


# A checkpoint and its run's base model (a checkpoint belongs to run ``model_id``): one join,
# not a query per row; a left one, so that a checkpoint whose run row were missing still shows.
CHECKPOINTS = "checkpoints c LEFT JOIN models m ON m.model_id = c.model_id"
CHECKPOINT_COLUMNS = (
    "c.model_id, c.kind, c.name, c.created_at, c.size_bytes, c.expires_at, c.public, c.user_metadata, m.base_model"
)


def model_record(row: tuple) -> ModelRecord:
    return ModelRecord(row[0], row[1], row[2], row[3], json.loads(row[4]), json.loads(row[5]), row[6], row[7])


def checkpoint_record(row: tuple) -> CheckpointRecord:
    return CheckpointRecord(row[0], row[1], row[2], row[3], row[4], row[5], bool(row[6]), json.loads(row[7]), row[8])


class _Rows:
    def _exec(self, sql: str, args: tuple = ()) -> Fetched:
        raise NotImplementedError  # Store's


class CheckpointRows(_Rows):
    """Checkpoints as the services read them, each with its run's base model (``Store`` writes
    them)."""

    def checkpoint_created_at(self, path: TinkerPath) -> float | None:
        """When the checkpoint at ``path`` was made (its version), or None if there is none."""
        record = self.get_checkpoint(path.run_id, path.kind, path.name)
        return record.created_at if record is not None else None

    def get_checkpoint(self, model_id: str, kind: str, name: str) -> CheckpointRecord | None:
        row = self._exec(
            f"SELECT {CHECKPOINT_COLUMNS} FROM {CHECKPOINTS} WHERE c.model_id=? AND c.kind=? AND c.name=?",
            (model_id, kind, name),
        ).fetchone()
        return checkpoint_record(row) if row else None

    def list_checkpoints(self, model_id: str | None = None) -> list[CheckpointRecord]:
        """Newest first; all runs when ``model_id`` is None."""
        where, args = ("WHERE c.model_id=?", (model_id,)) if model_id is not None else ("", ())
        rows = self._exec(f"SELECT {CHECKPOINT_COLUMNS} FROM {CHECKPOINTS} {where} ORDER BY c.created_at DESC", args)
        return [checkpoint_record(r) for r in rows.fetchall()]

    def has_public_checkpoint(self, model_id: str) -> bool:
        return (
            self._exec("SELECT 1 FROM checkpoints WHERE model_id=? AND public=1 LIMIT 1", (model_id,)).fetchone()
            is not None
        )

    def owned_checkpoints(self, owner: str) -> list[CheckpointRecord]:
        """Newest first, of every run whose session ``owner`` opened."""
        rows = self._exec(
            f"SELECT {CHECKPOINT_COLUMNS} FROM checkpoints c JOIN models m ON m.model_id = c.model_id "
            "JOIN sessions s ON s.session_id = m.session_id WHERE s.owner=? ORDER BY c.created_at DESC",
            (owner,),
        )
        return [checkpoint_record(r) for r in rows.fetchall()]

    def expired_checkpoints(self, now: float) -> list[CheckpointRecord]:
        rows = self._exec(
            f"SELECT {CHECKPOINT_COLUMNS} FROM {CHECKPOINTS} WHERE c.expires_at IS NOT NULL AND c.expires_at <= ?",
            (now,),
        )
        return [checkpoint_record(r) for r in rows.fetchall()]

    def projects_of(self, owner: str) -> set[str]:
        """The projects of ``owner``'s sessions (one made without a project is in ``DEFAULT_PROJECT``)."""
        projects = "SELECT DISTINCT COALESCE(project_id, ?) FROM sessions WHERE owner=?"
        rows = self._exec(projects, (DEFAULT_PROJECT, owner))
        return {r[0] for r in rows.fetchall()}

    def search_checkpoints(
        self,
        owner: str,
        *,
        own: bool,
        others: list[str] | None,
        projects: list[str] | None = None,
        kind: str | None = None,
        base_models: list[str] | None = None,
        until: float | None = None,
    ) -> list[CheckpointRecord]:
        """Newest first: ``owner``'s checkpoints if ``own`` (of its sessions in ``projects``, if
        given), and other keys' published ones: of the keys ``others`` (every other key's when
        None). Of those, the ones of kind ``kind``, of runs of one of ``base_models`` and made
        at or before ``until``, where given. Lists travel as one JSON parameter each (any
        length: SQLite caps the number of parameters)."""
        visible: list[str] = []
        args: list[Any] = []  # the placeholders' values: text and numbers
        if own:
            mine = "s.owner = ?"
            args.append(owner)
            if projects is not None:
                mine += " AND COALESCE(s.project_id, ?) IN (SELECT value FROM json_each(?))"
                args += [DEFAULT_PROJECT, json.dumps(projects)]
            visible.append(f"({mine})")
        if others is None or others:
            theirs = "c.public = 1 AND s.owner != ?"
            args.append(owner)
            if others is not None:
                theirs += " AND s.owner IN (SELECT value FROM json_each(?))"
                args.append(json.dumps(others))
            visible.append(f"({theirs})")
        if not visible:
            return []
        where = [f"({' OR '.join(visible)})"]
        if kind is not None:
            where.append("c.kind = ?")
            args.append(kind)
        if base_models is not None:
            where.append("m.base_model IN (SELECT value FROM json_each(?))")
            args.append(json.dumps(base_models))
        if until is not None:
            where.append("c.created_at <= ?")
            args.append(until)
        rows = self._exec(
            f"SELECT {CHECKPOINT_COLUMNS} FROM checkpoints c JOIN models m ON m.model_id = c.model_id "
            f"JOIN sessions s ON s.session_id = m.session_id WHERE {' AND '.join(where)} ORDER BY c.created_at DESC",
            tuple(args),
        )
        return [checkpoint_record(r) for r in rows.fetchall()]


class ListingRows(_Rows):
    """Runs, sessions and samplers, as the REST routes and the console list them."""

    def list_models(
        self, owner: str, limit: int, offset: int, *, published: bool = False, project: str | None = None
    ) -> tuple[list[ModelRecord], int]:
        """``owner``'s runs, newest first; with ``published`` also others' runs with a published
        checkpoint; with ``project``, only ``owner``'s runs of sessions in that project (sessions
        made without one are in ``DEFAULT_PROJECT``; projects are each key's own names, so
        another's runs are in none of them, and a name of another's cannot be tried)."""
        where, args = "s.owner=?", [owner]
        if published and project is None:
            where += " OR EXISTS (SELECT 1 FROM checkpoints c WHERE c.model_id = m.model_id AND c.public=1)"
        if project is not None:
            where = f"{where} AND COALESCE(s.project_id, ?) = ?"
            args += [DEFAULT_PROJECT, project]
        runs = f"FROM models m JOIN sessions s ON s.session_id = m.session_id WHERE {where}"
        total = self._exec(f"SELECT COUNT(*) {runs}", tuple(args)).one()[0]
        rows = self._exec(
            f"SELECT {MODEL_COLUMNS} {runs} ORDER BY m.created_at DESC LIMIT ? OFFSET ?", (*args, limit, offset)
        ).fetchall()
        return [model_record(r) for r in rows], total

    def model_last_request(self, model_id: str) -> float:
        """Its newest request's time; the run's creation where none is kept (a copy has made
        none, and finished futures are purged after a while)."""
        row = self._exec(
            "SELECT MAX(COALESCE((SELECT MAX(created_at) FROM futures WHERE model_id=?1), 0), last_request_at) "
            "FROM models WHERE model_id=?1",
            (model_id,),
        ).fetchone()
        return row[0] if row is not None and row[0] is not None else 0.0

    def list_sessions(self, owner: str, limit: int, offset: int) -> list[str]:
        rows = self._exec(
            "SELECT session_id FROM sessions WHERE owner=? ORDER BY created_at DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        return [r[0] for r in rows.fetchall()]

    def sessions_of(self, owner: str) -> list[SessionRow]:
        """``owner``'s sessions, newest first."""
        rows = self._exec(
            "SELECT session_id, created_at, owner, project_id, status, display_name, user_metadata, status_detail "
            "FROM sessions WHERE owner=? ORDER BY created_at DESC",
            (owner,),
        ).fetchall()
        return [SessionRow(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]), r[7]) for r in rows]

    def checkpoint_storage(self, owner: str, project: str | None = None) -> list[tuple[str, int, int]]:
        """(project, checkpoints, bytes) of ``owner``'s unexpired checkpoints, per project of
        their sessions."""
        rows = self._exec(
            "SELECT COALESCE(s.project_id, ?1) AS project, COUNT(*), SUM(c.size_bytes) FROM checkpoints c "
            "JOIN models m ON m.model_id = c.model_id JOIN sessions s ON s.session_id = m.session_id "
            "WHERE s.owner=?2 AND (c.expires_at IS NULL OR c.expires_at > ?3) AND (?4 IS NULL OR project = ?4) "
            "GROUP BY project ORDER BY project",
            (DEFAULT_PROJECT, owner, time.time(), project),
        ).fetchall()
        return [(r[0], r[1], r[2] or 0) for r in rows]

    def checkpoints_count(self, session_id: str) -> int:
        return self._exec(
            "SELECT COUNT(*) FROM checkpoints c JOIN models m ON m.model_id = c.model_id WHERE m.session_id=?",
            (session_id,),
        ).one()[0]

    def get_session(self, session_id: str) -> dict | None:
        row = self._exec(
            "SELECT user_metadata, display_name FROM sessions WHERE session_id=?", (session_id,)
        ).fetchone()
        if row is None:
            return None
        models = self._exec("SELECT model_id FROM models WHERE session_id=? ORDER BY model_seq_id", (session_id,))
        samplers = self._exec("SELECT sampler_id FROM samplers WHERE session_id=? ORDER BY created_at", (session_id,))
        return {
            "training_run_ids": [r[0] for r in models.fetchall()],
            "sampler_ids": [r[0] for r in samplers.fetchall()],
            "user_metadata": json.loads(row[0]),
            "display_name": row[1],
        }

    def add_sampler(
        self,
        sampler_id: str,
        *,
        session_id: str,
        base_model: str,
        model_path: str | None,
        model_id: str | None,
        snapshot: str | None = None,
        kind: str = "snapshot",
    ) -> None:
        self._exec(
            "INSERT INTO samplers(sampler_id, session_id, base_model, model_path, model_id, snapshot, created_at, "
            "kind) VALUES (?,?,?,?,?,?,?,?)",
            (sampler_id, session_id, base_model, model_path, model_id, snapshot, time.time(), kind),
        )

    def ephemeral_sampler_ids(self, owner: str) -> list[str]:
        return [s.sampler_id for s in reversed(self.ephemeral_samplers(owner=owner))]

    def ephemeral_samplers(
        self, *, model_id: str | None = None, session_id: str | None = None, owner: str | None = None
    ) -> list[SamplerRecord]:
        """Samplers on ephemeral snapshots, newest first, optionally of one model, session or owner."""
        where = "x.snapshot IS NOT NULL"
        args: list[Any] = []
        if model_id is not None:
            where, args = where + " AND x.model_id=?", [*args, model_id]
        if session_id is not None:
            where, args = where + " AND x.session_id=?", [*args, session_id]
        if owner is not None:
            where, args = where + " AND s.owner=?", [*args, owner]
        rows = self._exec(
            "SELECT x.sampler_id, x.session_id, x.base_model, x.model_path, x.model_id, x.snapshot, x.kind "
            "FROM samplers x LEFT JOIN sessions s ON s.session_id = x.session_id "
            f"WHERE {where} ORDER BY x.created_at DESC, x.rowid DESC",
            tuple(args),
        )
        return [SamplerRecord(*r) for r in rows.fetchall()]

    def samplers_of_run(self, run_id: str, owner: str, limit: int = 100) -> list[tuple[SamplerRecord, float]]:
        """``owner``'s sampling sessions on a run's weights (its snapshots, or a path of its
        checkpoints: another key's, on a published one, are not the run owner's to see), newest
        first, with when each was made."""
        prefix = f"tinker://{run_id}/"
        rows = self._exec(
            "SELECT x.sampler_id, x.session_id, x.base_model, x.model_path, x.model_id, x.snapshot, x.kind, "
            "x.created_at FROM samplers x JOIN sessions s ON s.session_id = x.session_id "
            "WHERE s.owner=? AND (x.model_id=? OR substr(x.model_path, 1, ?)=?) ORDER BY x.created_at DESC LIMIT ?",
            (owner, run_id, len(prefix), prefix, limit),
        )
        return [(SamplerRecord(*r[:7]), r[7]) for r in rows.fetchall()]

    def delete_sampler(self, sampler_id: str) -> None:
        self._exec("DELETE FROM samplers WHERE sampler_id=?", (sampler_id,))

    def join_sampler(self, sampler_id: str) -> int:
        """The next client number of a sampling session (its first client is 0, joiners 1, 2, …)."""
        row = self._exec(
            "UPDATE samplers SET clients = clients + 1 WHERE sampler_id=? RETURNING clients", (sampler_id,)
        ).one()
        return int(row[0])

    def get_sampler(self, sampler_id: str) -> SamplerRecord | None:
        row = self._exec(
            "SELECT sampler_id, session_id, base_model, model_path, model_id, snapshot, kind "
            "FROM samplers WHERE sampler_id=?",
            (sampler_id,),
        ).fetchone()
        return SamplerRecord(*row) if row else None


class UsageRows(_Rows):
    """The usage ledger (``serving.usage``): quantities added up per hour, key, session, base
    model and kind."""

    def add_usage(self, bucket: int, owner: str, session_id: str, base_model: str, kind: str, quantity: float) -> None:
        self._exec(
            "INSERT INTO usage VALUES (?,?,?,?,?,?) ON CONFLICT (owner, bucket, session_id, base_model, kind) "
            "DO UPDATE SET quantity = quantity + excluded.quantity",
            (bucket, owner, session_id, base_model, kind, quantity),
        )

    def usage_of(self, owner: str, start: int, end: int) -> list[tuple[int, str, str, str, float]]:
        """``(bucket, session_id, base_model, kind, quantity)`` of ``owner`` in hours [start, end)."""
        return self._exec(
            "SELECT bucket, session_id, base_model, kind, quantity FROM usage WHERE owner=? AND bucket>=? AND bucket<? "
            "ORDER BY bucket, quantity DESC",
            (owner, start, end),
        ).fetchall()

    def stored_bytes(self) -> list[tuple[str, str, str, int]]:
        """``(owner, session_id, base_model, bytes)`` of every unexpired checkpoint, per session."""
        return self._exec(
            "SELECT s.owner, s.session_id, m.base_model, SUM(c.size_bytes) FROM checkpoints c "
            "JOIN models m ON m.model_id = c.model_id JOIN sessions s ON s.session_id = m.session_id "
            "WHERE c.expires_at IS NULL OR c.expires_at > ? GROUP BY s.session_id, m.base_model",
            (time.time(),),
        ).fetchall()


class AuditRows(_Rows):
    """The audit log (``serving.audit``)."""

    def add_audit(self, at: float, owner: str, actor: str | None, event: str, details: dict) -> None:
        self._exec("INSERT INTO audit VALUES (?,?,?,?,?)", (at, owner, actor, event, json.dumps(details)))

    def audit_of(self, key: str, start: float, end: float, prefix: str) -> list[tuple[float, str, dict]]:
        """``(at, event, details)`` of what concerned ``key``'s resources or was done by it in
        [start, end), oldest first, of events whose name starts with ``prefix``."""
        rows = self._exec(
            "SELECT at, event, details FROM audit WHERE (owner=?1 OR actor=?1) AND at>=?2 AND at<?3 "
            "AND substr(event, 1, length(?4)) = ?4 ORDER BY at",
            (key, start, end, prefix),
        ).fetchall()
        return [(at, event, json.loads(details)) for at, event, details in rows]

    def delete_audit_before(self, cutoff: float) -> int:
        return self._exec("DELETE FROM audit WHERE at < ?", (cutoff,)).rowcount


class KeyRows(_Rows):
    """API keys: only their hashes are stored (``server.keys``)."""

    def add_api_key(self, key_id: str, *, name: str, sha256: str, prefix: str) -> None:
        self._exec(
            "INSERT INTO api_keys(key_id, name, sha256, prefix, created_at) VALUES (?,?,?,?,?)",
            (key_id, name, sha256, prefix, time.time()),
        )

    def api_key_hash(self, key_id: str) -> str | None:
        row = self._exec("SELECT sha256 FROM api_keys WHERE key_id=?", (key_id,)).fetchone()
        return row[0] if row else None

    def api_key_id(self, sha256: str) -> str | None:
        """The id of the unrevoked key with this hash, if any."""
        row = self._exec("SELECT key_id FROM api_keys WHERE sha256=? AND revoked_at IS NULL", (sha256,)).fetchone()
        return row[0] if row else None

    def api_key_valid(self, key_id: str) -> bool:
        """Whether a key with this id exists and is not revoked."""
        row = self._exec("SELECT 1 FROM api_keys WHERE key_id=? AND revoked_at IS NULL", (key_id,)).fetchone()
        return row is not None

    def console_sign_out(self, digest: str, at: float, forget_before: float) -> None:
        """Refuse the console cookies of the key with this SHA-256 made until ``at``; sign-outs
        before ``forget_before`` (whose cookies have all expired) are forgotten."""
        self._exec("DELETE FROM console_signouts WHERE at < ?", (forget_before,))
        self._exec("INSERT OR REPLACE INTO console_signouts(digest, at) VALUES (?, ?)", (digest, at))

    def console_signed_out_at(self, digest: str) -> float | None:
        row = self._exec("SELECT at FROM console_signouts WHERE digest=?", (digest,)).fetchone()
        return row[0] if row else None

    def api_key_name(self, key_id: str) -> str | None:
        row = self._exec("SELECT name FROM api_keys WHERE key_id=?", (key_id,)).fetchone()
        return row[0] if row else None

    def api_key_limits(self, key_id: str) -> dict[str, int | float]:
        """The limits this key has of its own (the rest are the server's); {} for any other tenant."""
        row = self._exec("SELECT limits FROM api_keys WHERE key_id=?", (key_id,)).fetchone()
        return json.loads(row[0]) if row else {}

    def set_api_key_limits(self, key_id: str, limits: dict) -> None:
        """Replace the limits of its own that the key ``key_id`` has."""
        self._exec("UPDATE api_keys SET limits=? WHERE key_id=?", (json.dumps(limits), key_id))

    def has_api_keys(self) -> bool:
        """Whether a key was ever created here (revoked ones count: revoking the last key must not
        open the server to everyone)."""
        return self._exec("SELECT 1 FROM api_keys LIMIT 1").fetchone() is not None

    def list_api_keys(self) -> list[ApiKeyRecord]:
        rows = self._exec("SELECT key_id, name, prefix, created_at, revoked_at FROM api_keys ORDER BY created_at")
        return [ApiKeyRecord(*r) for r in rows.fetchall()]

    def revoke_api_key(self, key_id_or_name: str) -> int:
        """Revoke the key with this id, or every key with this name; return how many."""
        cur = self._exec(
            "UPDATE api_keys SET revoked_at=? WHERE (key_id=? OR name=?) AND revoked_at IS NULL",
            (time.time(), key_id_or_name, key_id_or_name),
        )
        return cur.rowcount
