"""SQLite persistence for sessions, models and futures; it survives a restart.

One connection guarded by a lock: the event loop and the backend worker thread both write,
each write is a short statement, and WAL keeps readers off the writer's back.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    status TEXT NOT NULL DEFAULT 'active',
    tags TEXT NOT NULL DEFAULT '[]',
    user_metadata TEXT NOT NULL DEFAULT '{}',
    project_id TEXT,
    display_name TEXT,
    sdk_version TEXT
);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    model_seq_id INTEGER NOT NULL,
    base_model TEXT NOT NULL,
    lora TEXT NOT NULL,
    user_metadata TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL DEFAULT 'active',
    created_at REAL NOT NULL,
    last_request_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY,
    model_id TEXT,
    seq_id INTEGER,
    kind TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    media_type TEXT,
    payload BLOB,
    error TEXT,
    category TEXT,
    created_at REAL NOT NULL,
    completed_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS futures_by_seq ON futures(model_id, seq_id) WHERE seq_id IS NOT NULL;
"""


@dataclass(frozen=True)
class FutureRecord:
    request_id: str
    model_id: str | None
    seq_id: int | None
    kind: str
    status: str  # pending | done | failed
    media_type: str | None
    payload: bytes | None
    error: str | None
    category: str | None

    @property
    def finished(self) -> bool:
        return self.status != "pending"


@dataclass(frozen=True)
class ModelRecord:
    model_id: str
    session_id: str
    model_seq_id: int
    base_model: str
    lora: dict[str, Any]
    user_metadata: dict[str, Any]
    status: str  # active | unloaded | lost


class Store:
    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def recover_after_restart(self) -> tuple[int, int]:
        """Fail futures that were in flight and mark live models lost; return both counts."""
        now = time.time()
        failed = self._exec(
            "UPDATE futures SET status='failed', category='server', completed_at=?, "
            "error='the server restarted while this request was in flight; resubmit it' "
            "WHERE status='pending'",
            (now,),
        ).rowcount
        lost = self._exec("UPDATE models SET status='lost' WHERE status='active'").rowcount
        return failed, lost

    # ---- sessions -------------------------------------------------------------------------

    def add_session(
        self,
        session_id: str,
        *,
        tags: list[str],
        user_metadata: dict,
        project_id: str | None,
        display_name: str | None,
        sdk_version: str | None,
    ) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO sessions(session_id, created_at, last_heartbeat, tags, user_metadata, project_id, "
            "display_name, sdk_version) VALUES (?,?,?,?,?,?,?,?)",
            (session_id, now, now, json.dumps(tags), json.dumps(user_metadata), project_id, display_name, sdk_version),
        )

    def session_status(self, session_id: str) -> str | None:
        row = self._exec("SELECT status FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return row[0] if row else None

    def touch_session(self, session_id: str) -> bool:
        cur = self._exec("UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id))
        return cur.rowcount > 0

    def finish_session(self, session_id: str, status: str) -> bool:
        cur = self._exec("UPDATE sessions SET status=? WHERE session_id=?", (status, session_id))
        return cur.rowcount > 0

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
            "SELECT model_id, session_id, model_seq_id, base_model, lora, user_metadata, status "
            "FROM models WHERE model_id=?",
            (model_id,),
        ).fetchone()
        if row is None:
            return None
        return ModelRecord(row[0], row[1], row[2], row[3], json.loads(row[4]), json.loads(row[5]), row[6])

    def live_models_of_session(self, session_id: str) -> list[str]:
        rows = self._exec("SELECT model_id FROM models WHERE session_id=? AND status='active'", (session_id,))
        return [r[0] for r in rows.fetchall()]

    def set_model_status(self, model_id: str, status: str) -> None:
        self._exec("UPDATE models SET status=? WHERE model_id=?", (status, model_id))

    def count_active(self) -> dict[str, int]:
        """Live sessions and loaded models, for /healthz."""
        sessions = self._exec("SELECT COUNT(*) FROM sessions WHERE status='active'").fetchone()[0]
        models = self._exec("SELECT COUNT(*) FROM models WHERE status='active'").fetchone()[0]
        return {"sessions": sessions, "models": models}

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
        self._exec(
            "UPDATE futures SET status='done', payload=?, media_type=?, completed_at=? WHERE request_id=?",
            (payload, media_type, time.time(), request_id),
        )

    def fail_future(self, request_id: str, error: str, category: str) -> None:
        self._exec(
            "UPDATE futures SET status='failed', error=?, category=?, completed_at=? WHERE request_id=?",
            (error, category, time.time(), request_id),
        )

    def get_future(self, request_id: str) -> FutureRecord | None:
        row = self._exec(
            "SELECT request_id, model_id, seq_id, kind, status, media_type, payload, error, category "
            "FROM futures WHERE request_id=?",
            (request_id,),
        ).fetchone()
        return FutureRecord(*row) if row else None
