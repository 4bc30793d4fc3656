"""SQLite persistence for sessions, models, futures and checkpoints (and, in ``store_rows``,
the checkpoints as read, the REST listings and API keys); it survives a restart.

One connection guarded by a lock: the event loop and the backend worker thread both write,
each write is a short statement, and WAL keeps readers off the writer's back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hosted_tinker.server.persistence.records import FutureRecord, ModelRecord
from hosted_tinker.server.persistence.schema import DATABASE, SCHEMA, Fetched, connect, migrate
from hosted_tinker.server.persistence.store_rows import (
    MODEL_COLUMNS,
    AuditRows,
    CheckpointRows,
    KeyRows,
    ListingRows,
    UsageRows,
    model_record,
)

if TYPE_CHECKING:
    from hosted_tinker.core.checkpoints import TinkerPath

log = logging.getLogger(__name__)


# The models a key holds, for its limits: loaded or parked, in its unfinished sessions (heard
# from or not: a client that never heartbeats must not get around a count).
_HELD_MODELS = (
    "FROM models WHERE status IN ('active', 'parked') AND session_id IN "
    "(SELECT session_id FROM sessions WHERE owner=? AND status='active')"
)


class Store(CheckpointRows, ListingRows, UsageRows, AuditRows, KeyRows):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = connect(path, SCHEMA)
        migrate(self._db)
        self._lock = threading.Lock()
        # Futures are numbered in the order they finish (``completions``), across restarts.
        self._completion_seq = self._db.execute("SELECT COALESCE(MAX(completion_seq), 0) FROM futures").fetchone()[0]

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> Store:
        """The server's database in ``data_dir`` (the server and ``hosted-tinker keys`` share it)."""
        return cls(Path(data_dir) / DATABASE)

    def _exec(self, sql: str, args: tuple = ()) -> Fetched:
        """Run one statement and read all it returns, under the lock. A cursor read later would
        share the connection with other threads unguarded, and its unfinished statement would
        hold a read snapshot open: the next write on this connection after another connection's
        commit (``sequences``, ``run_metrics``) then fails at once with "database is locked"
        (SQLITE_BUSY_SNAPSHOT, which no busy timeout waits out)."""
        with self._lock:
            cursor = self._db.execute(sql, args)
            try:
                return Fetched(cursor.fetchall(), cursor.rowcount)
            finally:
                cursor.close()

    def close(self) -> None:
        """Checkpoint the write-ahead log into the database and empty it, then close: a clean stop
        leaves one file (it left a 4 MB log, which other connections still open keep from being
        checkpointed when this one closes)."""
        with self._lock:
            busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if busy:
                log.warning("closing the database: its write-ahead log could not be checkpointed (a reader held it)")
            self._db.close()

    def recover_after_restart(self) -> tuple[int, int]:
        """Fail futures that were in flight and mark live models lost; return both counts."""
        pending = [row[0] for row in self._exec("SELECT request_id FROM futures WHERE status='pending'")]
        for request_id in pending:
            self.fail_future(request_id, "the server restarted while this request was in flight; resubmit it", "server")
        failed = len(pending)
        lost = self._exec("UPDATE models SET status='lost' WHERE status='active'").rowcount
        return failed, lost

    # ---- sessions -------------------------------------------------------------------------

    def add_session(
        self,
        session_id: str,
        *,
        owner: str,
        tags: list[str],
        user_metadata: dict,
        project_id: str | None,
        display_name: str | None,
        sdk_version: str | None,
    ) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO sessions(session_id, owner, created_at, last_heartbeat, tags, user_metadata, project_id, "
            "display_name, sdk_version) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                session_id,
                owner,
                now,
                now,
                json.dumps(tags),
                json.dumps(user_metadata),
                project_id,
                display_name,
                sdk_version,
            ),
        )

    # ---- owners: a session belongs to the key that opened it (see serving/tenancy.py) ----

    def session_owner(self, session_id: str) -> str | None:
        row = self._exec("SELECT owner FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return row[0] if row else None

    def future_subject(self, request_id: str) -> str | None:
        """The model or sampler id a future belongs to (every future names one; both ids start
        with their session's id: ``{session}:train:{n}``, ``{session}:sample:{n}``)."""
        row = self._exec("SELECT model_id FROM futures WHERE request_id=?", (request_id,)).fetchone()
        return row[0] if row else None

    def session_status(self, session_id: str) -> str | None:
        row = self._exec("SELECT status FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return row[0] if row else None

    def touch_session(self, session_id: str) -> bool:
        cur = self._exec("UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id))
        return cur.rowcount > 0

    def finish_session(self, session_id: str, status: str, detail: str | None = None) -> bool:
        cur = self._exec(
            "UPDATE sessions SET status=?, status_detail=? WHERE session_id=?", (status, detail, session_id)
        )
        return cur.rowcount > 0

    def set_session_project(self, session_id: str, project_id: str) -> None:
        self._exec("UPDATE sessions SET project_id=? WHERE session_id=?", (project_id, session_id))

    # ---- models ---------------------------------------------------------------------------

    def add_model(
        self, model_id: str, *, session_id: str, model_seq_id: int, base_model: str, lora: dict, user_metadata: dict
    ) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO models(model_id, session_id, model_seq_id, base_model, lora, user_metadata, "
            "created_at, last_request_at) VALUES (?,?,?,?,?,?,?,?)",
            (model_id, session_id, model_seq_id, base_model, json.dumps(lora), json.dumps(user_metadata), now, now),
        )

    def get_model(self, model_id: str) -> ModelRecord | None:
        row = self._exec(
            f"SELECT {MODEL_COLUMNS} FROM models m WHERE model_id=?",
            (model_id,),
        ).fetchone()
        return None if row is None else model_record(row)

    def live_models_of_session(self, session_id: str) -> list[str]:
        rows = self._exec(
            "SELECT model_id FROM models WHERE session_id=? AND status IN ('active', 'parked')", (session_id,)
        )
        return [r[0] for r in rows.fetchall()]

    def live_model_ids(self, owner: str) -> list[str]:
        rows = self._exec(
            "SELECT m.model_id FROM models m JOIN sessions s ON s.session_id = m.session_id "
            "WHERE m.status IN ('active', 'parked') AND s.owner=? ORDER BY m.created_at",
            (owner,),
        )
        return [r[0] for r in rows.fetchall()]

    def model_ids(self, status: str) -> list[str]:
        return [r[0] for r in self._exec("SELECT model_id FROM models WHERE status=?", (status,)).fetchall()]

    def set_model_status(self, model_id: str, status: str) -> None:
        self._exec("UPDATE models SET status=? WHERE model_id=?", (status, model_id))

    def set_model_status_if(self, model_id: str, status: str, expected: str, next_seq: int | None = None) -> bool:
        """Set ``status`` only if the model is still ``expected`` (another thread may have unloaded
        it meanwhile), and ``next_seq``: the seq_id its requests resume at after a restart, if
        parked (None: one past its last future's). Whether it was set."""
        cur = self._exec(
            "UPDATE models SET status=?, next_seq=? WHERE model_id=? AND status=?",
            (status, next_seq, model_id, expected),
        )
        return cur.rowcount == 1

    def usage(self, owner: str, live_since: float) -> dict[str, int]:
        """What ``owner`` holds, for its limits: sessions heard from since ``live_since``, models
        loaded or parked in its unfinished sessions (heard from or not: a client that never
        heartbeats must not get around the count), and bytes of stored checkpoints."""
        live = "SELECT session_id FROM sessions WHERE owner=? AND status='active' AND last_heartbeat >= ?"
        sessions = self._exec(f"SELECT COUNT(*) FROM ({live})", (owner, live_since)).one()[0]
        models = self._exec(f"SELECT COUNT(*) {_HELD_MODELS}", (owner,)).one()[0]
        stored = self._exec(
            "SELECT COALESCE(SUM(c.size_bytes), 0) FROM checkpoints c JOIN models m ON m.model_id = c.model_id "
            "JOIN sessions s ON s.session_id = m.session_id WHERE s.owner=?",
            (owner,),
        ).one()[0]
        return {"sessions": sessions, "models": models, "checkpoint_bytes": stored}

    def live_loras(self, owner: str) -> list[dict]:
        """The LoRA specs of the models ``usage`` counts for ``owner`` (loaded or parked)."""
        return [json.loads(lora) for (lora,) in self._exec(f"SELECT lora {_HELD_MODELS}", (owner,)).fetchall()]

    def count_active(self) -> dict[str, int]:
        """Live sessions, loaded models and parked ones (saved off the workers), for /healthz."""
        sessions = self._exec("SELECT COUNT(*) FROM sessions WHERE status='active'").one()[0]
        models = self._exec("SELECT COUNT(*) FROM models WHERE status='active'").one()[0]
        parked = self._exec("SELECT COUNT(*) FROM models WHERE status='parked'").one()[0]
        return {"sessions": sessions, "models": models, "parked_models": parked}

    def parked_models(self) -> list[tuple[str, int]]:
        """Each parked model and the seq_id its next request must carry (one past its last)."""
        rows = self._exec(
            "SELECT m.model_id, COALESCE(m.next_seq, MAX(f.seq_id) + 1, 1) FROM models m "
            "LEFT JOIN futures f ON f.model_id = m.model_id WHERE m.status='parked' GROUP BY m.model_id"
        )
        return [(r[0], r[1]) for r in rows.fetchall()]

    def silent_sessions(self, before: float) -> list[str]:
        """Unfinished sessions not heard from since ``before``."""
        rows = self._exec("SELECT session_id FROM sessions WHERE status='active' AND last_heartbeat < ?", (before,))
        return [r[0] for r in rows.fetchall()]

    def silent_models(self, before: float) -> list[str]:
        """Loaded models of sessions not heard from since ``before``."""
        rows = self._exec(
            "SELECT m.model_id FROM models m JOIN sessions s ON s.session_id = m.session_id "
            "WHERE m.status='active' AND s.last_heartbeat < ?",
            (before,),
        )
        return [r[0] for r in rows.fetchall()]

    # ---- futures --------------------------------------------------------------------------

    def add_future(self, request_id: str, *, kind: str, model_id: str | None, seq_id: int | None) -> None:
        self._exec(
            "INSERT INTO futures(request_id, model_id, seq_id, kind, created_at) VALUES (?,?,?,?,?)",
            (request_id, model_id, seq_id, kind, time.time()),
        )

    def find_future(self, model_id: str, seq_id: int) -> str | None:
        row = self._exec("SELECT request_id FROM futures WHERE model_id=? AND seq_id=?", (model_id, seq_id)).fetchone()
        return row[0] if row else None

    def complete_future(self, request_id: str, payload: bytes, media_type: str) -> None:
        self._finish_future(request_id, "status='done', payload=?, media_type=?", (payload, media_type))

    def fail_future(self, request_id: str, error: str, category: str) -> None:
        self._finish_future(request_id, "status='failed', error=?, category=?", (error, category))

    def _finish_future(self, request_id: str, assignments: str, values: tuple) -> None:
        # Numbered and written under one lock, so that numbers are committed in their order and
        # a reader of ``completions`` never sees a later number before an earlier one. Its times
        # go to the timeline in the same transaction.
        with self._lock:
            self._completion_seq += 1
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    f"UPDATE futures SET {assignments}, completed_at=?, completion_seq=? WHERE request_id=?",
                    (*values, time.time(), self._completion_seq, request_id),
                )
                self._db.execute(
                    "INSERT OR REPLACE INTO timeline SELECT request_id, model_id, kind, seq_id, created_at, "
                    "started_at, completed_at, status FROM futures WHERE request_id=?",
                    (request_id,),
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def future_started(self, request_id: str) -> None:
        """Its job began to run (the dispatch thread): the end of its wait in the queue."""
        self._exec("UPDATE futures SET started_at=? WHERE request_id=?", (time.time(), request_id))

    def session_timeline(self, session_id: str) -> list[tuple]:
        """``(subject, request_id, kind, seq_id, submitted_at, started_at, finished_at, status)``
        of the session's finished requests, in the order they were submitted."""
        # Subjects are "{session}:...": the range [session + ":", session + ";") holds exactly
        # those, and the index reads it as a range.
        return self._exec(
            "SELECT subject, request_id, kind, seq_id, submitted_at, started_at, finished_at, status FROM timeline "
            "WHERE subject >= ? AND subject < ? ORDER BY submitted_at",
            (session_id + ":", session_id + ";"),
        ).fetchall()

    def completions(self, model_id: str, seq_range: tuple[int, int], after: int, limit: int = 1000) -> list[tuple]:
        """``(completion_seq, request_id, status, payload bytes)`` of ``model_id``'s futures with
        ``seq_id`` in ``[lo, hi)`` that finished after number ``after``, in finishing order."""
        return self._exec(
            "SELECT completion_seq, request_id, status, length(payload) FROM futures "
            "WHERE model_id=? AND completion_seq > ? AND seq_id >= ? AND seq_id < ? ORDER BY completion_seq LIMIT ?",
            (model_id, after, *seq_range, limit),
        ).fetchall()

    def delete_finished(self, model_id: str, seq_range: tuple[int, int], request_ids: list[str]) -> int:
        """Forget finished futures of ``model_id`` (in ``seq_range``) whose results were retrieved."""
        deleted = 0
        for request_id in request_ids:
            deleted += self._exec(
                "DELETE FROM futures WHERE request_id=? AND model_id=? AND seq_id >= ? AND seq_id < ? "
                "AND status != 'pending'",
                (request_id, model_id, *seq_range),
            ).rowcount
        return deleted

    def delete_futures_finished_before(self, cutoff: float, batch: int = 1000) -> int:
        """Forget results finished before ``cutoff`` (a pending future is never deleted), ``batch``
        rows at a time: a first sweep over a large backlog must not hold the store for long."""
        deleted = 0
        while True:
            n = self._exec(
                "DELETE FROM futures WHERE rowid IN (SELECT rowid FROM futures "
                "WHERE completed_at < ? AND status != 'pending' LIMIT ?)",
                (cutoff, batch),
            ).rowcount
            deleted += n
            if n < batch:
                break
        while (
            self._exec(  # the timeline is kept as long
                "DELETE FROM timeline WHERE rowid IN (SELECT rowid FROM timeline WHERE finished_at < ? LIMIT ?)",
                (cutoff, batch),
            ).rowcount
            == batch
        ):
            pass
        return deleted

    def get_future(self, request_id: str) -> FutureRecord | None:
        row = self._exec(
            "SELECT request_id, model_id, seq_id, kind, status, media_type, payload, error, category "
            "FROM futures WHERE request_id=?",
            (request_id,),
        ).fetchone()
        return FutureRecord(*row) if row else None

    # ---- checkpoints (read in ``store_rows.CheckpointRows``) --------------------------------

    def put_checkpoint(
        self,
        model_id: str,
        kind: str,
        name: str,
        *,
        size_bytes: int,
        ttl_seconds: int | None,
        user_metadata: dict[str, str],
    ) -> None:
        now = time.time()
        self._exec(
            "INSERT OR REPLACE INTO checkpoints(model_id, kind, name, created_at, size_bytes, expires_at, "
            "user_metadata) VALUES (?,?,?,?,?,?,?)",
            (
                model_id,
                kind,
                name,
                now,
                size_bytes,
                now + ttl_seconds if ttl_seconds else None,
                json.dumps(user_metadata),
            ),
        )

    def delete_checkpoint(self, model_id: str, kind: str, name: str, *, mirrored: bool = False) -> None:
        """The row goes; with ``mirrored``, in the same transaction a tombstone comes (below)."""
        key = (model_id, kind, name)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM checkpoints WHERE model_id=? AND kind=? AND name=?", key)
                if mirrored:
                    self._db.execute(
                        "INSERT OR REPLACE INTO mirror_deletions (model_id, kind, name, deleted_at) "
                        "VALUES (?, ?, ?, ?)",
                        (*key, time.time()),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def update_checkpoint(self, model_id: str, kind: str, name: str, **fields: object) -> None:
        assert set(fields) <= {"public", "expires_at", "created_at"}  # created_at: a restored copy's
        for column, value in fields.items():
            self._exec(
                f"UPDATE checkpoints SET {column}=? WHERE model_id=? AND kind=? AND name=?",
                (value, model_id, kind, name),
            )

    # A checkpoint deleted here whose copy in the mirror may still be there (``server.mirror``):
    # until that copy is gone, a start must not restore it.

    def clear_mirror_deletion(self, path: TinkerPath) -> None:
        self._exec(
            "DELETE FROM mirror_deletions WHERE model_id=? AND kind=? AND name=?", (path.run_id, path.kind, path.name)
        )

    def mirror_deletions(self) -> list[tuple[str, str, str]]:
        """(run id, kind, name) of each, oldest first."""
        return self._exec("SELECT model_id, kind, name FROM mirror_deletions ORDER BY deleted_at").fetchall()
