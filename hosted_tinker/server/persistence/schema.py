"""The server's SQLite file: the tables ``Store`` keeps, how every part of the server opens the
file (``connect``), and the columns added since a data directory was created (``migrate``).
``sequences`` and ``serving.custom_losses`` keep tables of their own in the same file;
``serving.run_metrics`` opens it with ``RUN_METRICS_SCHEMA`` (part of ``SCHEMA``) on its own connection."""

from __future__ import annotations

import logging
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

DATABASE = "hosted_tinker.sqlite"  # in the data directory

# One row per successfully finished forward_backward or optim_step of a training run
# (``serving.run_metrics``): ``step`` is the optimizer step the call belongs to, ``metrics`` JSON.
RUN_METRICS_SCHEMA = """
CREATE TABLE IF NOT EXISTS run_metrics (
    model_id TEXT NOT NULL,
    seq_id INTEGER NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER NOT NULL,
    recorded_at REAL NOT NULL,
    duration_s REAL NOT NULL,
    tokens INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (model_id, seq_id)
);
CREATE INDEX IF NOT EXISTS run_metrics_by_step ON run_metrics(model_id, step);
"""

SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    status TEXT NOT NULL DEFAULT 'active',
    tags TEXT NOT NULL DEFAULT '[]',
    user_metadata TEXT NOT NULL DEFAULT '{}',
    project_id TEXT,
    display_name TEXT,
    sdk_version TEXT,
    owner TEXT NOT NULL DEFAULT '',
    status_detail TEXT
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
    last_request_at REAL NOT NULL,
    next_seq INTEGER
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
    completed_at REAL,
    completion_seq INTEGER,
    started_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS futures_by_seq ON futures(model_id, seq_id) WHERE seq_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS futures_by_completion ON futures(completed_at);
-- Every finished request's times, kept (unlike its future, which a client may retrieve and so
-- delete) for the result retention: a session's trace (``serving.traces``). ``subject`` is the
-- model or sampler id, which starts with its session's id.
CREATE TABLE IF NOT EXISTS timeline (
    request_id TEXT PRIMARY KEY,
    subject TEXT,
    kind TEXT NOT NULL,
    seq_id INTEGER,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL NOT NULL,
    status TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS timeline_by_subject ON timeline(subject, submitted_at);
CREATE INDEX IF NOT EXISTS timeline_by_finish ON timeline(finished_at);
-- What each key used, per UTC hour (``serving.usage``): tokens trained and sampled, checkpoints
-- saved, gigabyte-hours stored; kept for good. ``session_id`` is '' for usage of no session
-- (an OpenAI /v1 request).
CREATE TABLE IF NOT EXISTS usage (
    bucket INTEGER NOT NULL,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    kind TEXT NOT NULL,
    quantity REAL NOT NULL,
    PRIMARY KEY (owner, bucket, session_id, base_model, kind)
);
-- What was done to each key's checkpoints and sessions, and by whom (``serving.audit``).
CREATE TABLE IF NOT EXISTS audit (
    at REAL NOT NULL,
    owner TEXT NOT NULL,
    actor TEXT,
    event TEXT NOT NULL,
    details TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_owner ON audit(owner, at);
CREATE INDEX IF NOT EXISTS audit_by_actor ON audit(actor, at);
CREATE TABLE IF NOT EXISTS checkpoints (
    model_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_bytes INTEGER NOT NULL,
    expires_at REAL,
    public INTEGER NOT NULL DEFAULT 0,
    user_metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (model_id, kind, name)
);
CREATE TABLE IF NOT EXISTS mirror_deletions (
    model_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    deleted_at REAL NOT NULL,
    PRIMARY KEY (model_id, kind, name)
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL,
    limits TEXT NOT NULL DEFAULT '{}'
);
-- When a key's console browsers last signed out (``server.console``): its cookies made before
-- then are refused. By the key's SHA-256, as a cookie names it; kept for a cookie's lifetime.
CREATE TABLE IF NOT EXISTS console_signouts (
    digest TEXT PRIMARY KEY,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    model_path TEXT,
    model_id TEXT,
    snapshot TEXT,
    created_at REAL NOT NULL,
    kind TEXT NOT NULL DEFAULT 'snapshot',
    clients INTEGER NOT NULL DEFAULT 0
);
"""
    + RUN_METRICS_SCHEMA
)


class DatabaseDamaged(RuntimeError):
    """The server's database file cannot be used as it is: said once, clearly, at start-up."""


WAL_SUFFIX = "-wal"  # SQLite's write-ahead log, beside the database: its last commits until a checkpoint
WAL_MAGIC = (0x377F0682, 0x377F0683)  # the last bit: the byte order of its checksums (big-endian if set)
WAL_VERSION = 3007000


def wal_problem(header: bytes) -> str | None:
    """What is wrong with a write-ahead log whose file starts with ``header`` (its first 32
    bytes), if anything: SQLite itself ignores a log whose header is not one, and deletes it,
    and with it the commits it held (a silent empty start)."""
    if len(header) < 32:
        return f"is cut short ({len(header)} bytes, not a log's 32-byte header)"
    magic, version, page_size, *_, sum1, sum2 = struct.unpack(">8I", header[:32])
    if magic not in WAL_MAGIC or version != WAL_VERSION or page_size & (page_size - 1) or not 512 <= page_size <= 65536:
        return "is not a SQLite write-ahead log (its header is garbled)"
    words = struct.unpack((">" if magic & 1 else "<") + "6I", header[:24])
    s1 = s2 = 0
    for first, second in zip(words[::2], words[1::2], strict=True):  # SQLite's checksum of the header
        s1 = (s1 + first + s2) & 0xFFFFFFFF
        s2 = (s2 + second + s1) & 0xFFFFFFFF
    return None if (s1, s2) == (sum1, sum2) else "has a header whose checksum does not hold (it is garbled)"


def check(path: Path) -> None:
    """``PRAGMA quick_check`` of the whole file, so that a damaged page is found at start-up and
    not by whichever request first reads it, and of its write-ahead log's header, so that a
    garbled log is not silently dropped; ``DatabaseDamaged`` says what to do."""
    advice = "restore it from a backup, or move it aside to start with an empty one"
    wal = path.with_name(path.name + WAL_SUFFIX)
    if wal.exists() and wal.stat().st_size > 0:  # empty: checkpointed, nothing in it
        with open(wal, "rb") as f:
            header = f.read(32)
        problem = wal_problem(header) if path.exists() else f"has no database {path} beside it"
        if path.exists() and header == bytes(32):
            # Never written (a power loss after the file grew): it holds no commit, as SQLite
            # finds too, and the start goes on, said.
            log.warning("the database's write-ahead log %s was never written (all zeros): ignored", wal)
        elif problem is not None:
            raise DatabaseDamaged(f"the database's write-ahead log {wal} {problem}: {advice}")
    if not path.exists():
        return
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            problems = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
        finally:
            db.close()
    except sqlite3.DatabaseError as e:  # not a database at all (garbled, truncated header)
        raise DatabaseDamaged(f"the database {path} cannot be read ({e}): {advice}") from None
    if problems != ["ok"]:
        raise DatabaseDamaged(f"the database {path} is damaged ({'; '.join(problems)}): {advice}")


BUSY_TIMEOUT_S = 60.0


def connect(path: str | Path, schema: str) -> sqlite3.Connection:
    """A connection to the server's database as every part of it opens one: shared between
    threads (each user guards it with its own lock), autocommit, WAL, ``schema`` applied."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Several connections write to the file (store, sampling records, custom losses): a writer
    # waits for another's lock up to BUSY_TIMEOUT_S. sqlite3's default of 5 s was reached on a
    # loaded 2-core machine, and a finished result that cannot be recorded is a client that waits
    # forever.
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    return db


def migrate(db: sqlite3.Connection) -> None:
    """Columns added since a data dir was created (sessions made before keys belong to no key,
        samplers made before inflight ones are snapshots, futures finished before completion
        numbers have none, keys made before per-key limits have none of their own, sessions
    finished before details were kept have none)."""
    for table, column, declared in [
        ("sessions", "owner", "TEXT NOT NULL DEFAULT ''"),
        ("samplers", "kind", "TEXT NOT NULL DEFAULT 'snapshot'"),
        ("samplers", "clients", "INTEGER NOT NULL DEFAULT 0"),
        ("futures", "completion_seq", "INTEGER"),
        ("api_keys", "limits", "TEXT NOT NULL DEFAULT '{}'"),
        ("models", "next_seq", "INTEGER"),
        ("sessions", "status_detail", "TEXT"),
        ("futures", "started_at", "REAL"),
    ]:
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declared}")
    db.execute(
        "CREATE INDEX IF NOT EXISTS futures_by_finish_order ON futures(model_id, completion_seq) "
        "WHERE completion_seq IS NOT NULL"
    )
    # A key's sessions and a session's models are read at every create, list and search: without
    # these, each read scanned every key's rows (190 ms at 1,200 large sessions).
    db.execute("CREATE INDEX IF NOT EXISTS sessions_by_owner ON sessions(owner, created_at)")
    db.execute("CREATE INDEX IF NOT EXISTS models_by_session ON models(session_id)")


class Fetched:
    """What a statement returned, read to the end (``Store._exec``): the rows, and how many it changed."""

    __slots__ = ("rows", "rowcount")

    def __init__(self, rows: list[tuple], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    def fetchone(self) -> tuple | None:
        return self.rows[0] if self.rows else None

    def one(self) -> tuple:
        """The row of a statement that always returns one (an aggregate, or a RETURNING of a row
        that exists); ``IndexError`` if it returned none."""
        return self.rows[0]

    def fetchall(self) -> list[tuple]:
        return self.rows

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.rows)
