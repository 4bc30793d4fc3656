"""What the sampler knew: sequences sampled with ``record_stability_info``, kept for training.

A sampling request that asks for it records its prompt once and, per returned sequence, the
sampled tokens and the sampler's log-prob of each, under the ``sequence_id`` the client got
(``SampledSequence.sequence_id``). Training requests name them in provenance spans
(``Datum.with_provenance``), and ``stable_reinforce`` reads the recorded log-probs instead of
trusting the client's copy. On a mixture-of-experts model the record also holds which experts
each token was routed to (the prompt's once, each sequence's sampled tokens), which training
replays (``rank.routing_replay``): ``(tokens, layers, top_k)`` in ``core.routing.RECORD_DTYPE``,
stored as ``.npy`` bytes (Qwen3-30B-A3B: 768 bytes a token, against 8 for the token and its
log-prob). Routing is kept only while the key that sampled holds less than its ``record_bytes``
limit of it in live records (past it, a record keeps its tokens and log-probs, and training says
``routing_replayed:mean`` below 1), and replayed only on the model that recorded it (``model``,
``model_identity``): records outlive a restart, which may load another checkpoint.

As the official service documents: records belong to the session that sampled them, live one
day, and each training request that uses a sequence restarts its day. They are rows in the
server's SQLite file (their own connection; WAL lets it share the file with ``Store``), so
they survive a restart.
"""

from __future__ import annotations

import hashlib
import io
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hosted_tinker.server.persistence.schema import connect

TTL_S = 24 * 3600.0
# Ids per statement: SQLite caps a statement's parameters (32766), and a request may name
# as many sequences as its body holds spans.
_IDS_PER_QUERY = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sampled_prompts (
    request_key TEXT PRIMARY KEY,
    prompt BLOB NOT NULL,
    routing BLOB
);
CREATE TABLE IF NOT EXISTS sampled_sequences (
    sequence_id TEXT PRIMARY KEY,
    request_key TEXT NOT NULL,
    session_id TEXT NOT NULL,
    tokens BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sampled_sequences_by_request ON sampled_sequences(request_key);
CREATE INDEX IF NOT EXISTS sampled_sequences_by_expiry ON sampled_sequences(expires_at);
-- A sequence's routing, in a table of its own: each training request that uses a sequence
-- restarts its day, and SQLite rewrites a whole row to update one column (tens of megabytes for
-- a long sequence's routing).
CREATE TABLE IF NOT EXISTS sampled_routing (
    sequence_id TEXT PRIMARY KEY,
    routing BLOB NOT NULL
);
"""


# Columns added since the tables were first made (a data directory of an earlier version).
_ADDED = [
    ("sampled_prompts", "routing", "BLOB"),
    ("sampled_prompts", "routing_model", "TEXT"),  # model_identity of the model that recorded it
    ("sampled_sequences", "owner", "TEXT NOT NULL DEFAULT ''"),  # the key that sampled it
    ("sampled_sequences", "routing_bytes", "INTEGER NOT NULL DEFAULT 0"),  # its routing's (and its prompt's)
]


@dataclass(frozen=True)
class RecordedSequence:
    """prompt int32 ``(P,)``, tokens int32 ``(T,)``, logprobs float32 ``(T,)``: the sampler's
    log-prob of each sampled token, exactly as returned to the client; ``rows``: where routing
    recorded by this server's model is kept (its ``sampled_routing`` row, None if only its prompt's
    was kept; its prompt's row), which ``routing`` reads
    (apart: it is ~100 times the rest, and read where the training request runs, not where it
    is checked); None if it has none."""

    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    rows: tuple[int | None, int] | None = None
    request_key: str = ""  # the sampling request that recorded it (``routing`` checks it is still the one)

    @property
    def routed(self) -> bool:
        return self.rows is not None


# One run of a sequence's positions whose routing is wanted: (sequence_id, sampled, offset,
# length), rows [offset, offset + length) of its sampled tokens' routing (``sampled``) or its prompt's.
RoutingRun = tuple[str, bool, int, int]


def model_identity(model_path: str) -> str:
    """What tells one served model from another across restarts: its path (or hub id), its
    config, and its weight files' names and sizes (a Base and an Instruct checkpoint of one
    architecture differ there, not in their configs)."""
    digest = hashlib.sha256(model_path.encode())
    folder = Path(model_path)
    if folder.is_dir():
        config = folder / "config.json"
        digest.update(config.read_bytes() if config.exists() else b"")
        for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return digest.hexdigest()


class Sampled(NamedTuple):
    """One sampled sequence as ``record`` takes it."""

    sequence_id: str
    tokens: Iterable[int]
    logprobs: Iterable[float]
    routing: np.ndarray | None = None


class SequenceRecords:
    def __init__(
        self, path: str | Path, model: str = "", ttl_s: float = TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        """``model``: the served model's ``model_identity``, under which routing is recorded and
        replayed."""
        self._db = connect(path, _SCHEMA)
        for table, column, declared in _ADDED:
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declared}")
        self._db.execute(
            "CREATE INDEX IF NOT EXISTS sampled_sequences_by_owner ON sampled_sequences(owner, expires_at)"
        )
        if "routing" in {row[1] for row in self._db.execute("PRAGMA table_info(sampled_sequences)")}:
            with self._db:  # a data directory of stop 53's, which kept routing in the row: moved out
                self._db.execute("BEGIN")
                self._db.execute(
                    "INSERT OR IGNORE INTO sampled_routing(sequence_id, routing) "
                    "SELECT sequence_id, routing FROM sampled_sequences WHERE routing IS NOT NULL"
                )
                self._db.execute("UPDATE sampled_sequences SET routing = NULL WHERE routing IS NOT NULL")
        self.model = model
        self._lock = threading.Lock()
        self.ttl_s = ttl_s
        self._clock = clock

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def record(
        self,
        session_id: str,
        request_key: str,
        prompt: Iterable[int],
        sequences: list[Sampled],
        prompt_routing: np.ndarray | None = None,
        *,
        owner: str = "",
        routing_limit: int | None = None,
    ) -> bool:
        """One sampling request of ``owner``'s: its prompt (and its routing), and each sequence.
        Its routing is kept only if the owner's live records then hold at most ``routing_limit``
        bytes of routing (None: no limit); whether it was."""
        expires = self._clock() + self.ttl_s
        routings = [_npy(prompt_routing)] + [_npy(seq.routing) for seq in sequences]
        size = sum(len(r) for r in routings if r is not None)
        kept = True
        with self._lock, self._db:
            self._db.execute("BEGIN")
            if size and routing_limit is not None:
                (held,) = self._db.execute(
                    "SELECT coalesce(sum(routing_bytes), 0) FROM sampled_sequences WHERE owner=? AND expires_at>?",
                    (owner, self._clock()),
                ).fetchone()
                if held + size > routing_limit:
                    routings, kept = [None] * len(routings), False
            self._db.execute(
                "INSERT OR REPLACE INTO sampled_prompts(request_key, prompt, routing, routing_model) VALUES (?,?,?,?)",
                (request_key, _int32(prompt), routings[0], self.model),
            )
            self._db.executemany(
                "DELETE FROM sampled_routing WHERE sequence_id=?", [(seq.sequence_id,) for seq in sequences]
            )
            self._db.executemany(
                "INSERT INTO sampled_routing(sequence_id, routing) VALUES (?,?)",
                [(seq.sequence_id, routing) for seq, routing in zip(sequences, routings[1:], strict=True) if routing],
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO sampled_sequences(sequence_id, request_key, session_id, tokens, logprobs, "
                "expires_at, owner, routing_bytes) VALUES (?,?,?,?,?,?,?,?)",
                [
                    (
                        seq.sequence_id,
                        request_key,
                        session_id,
                        _int32(seq.tokens),
                        np.asarray(list(seq.logprobs), dtype="<f4").tobytes(),
                        expires,
                        owner,
                        # the prompt's routing is counted with the first sequence's
                        (len(routing) if routing is not None else 0) + (len(routings[0] or b"") if j == 0 else 0),
                    )
                    for j, (seq, routing) in enumerate(zip(sequences, routings[1:], strict=True))
                ],
            )
        return kept

    def take(self, session_id: str, sequence_ids: Iterable[str]) -> dict[str, RecordedSequence]:
        """The live records of ``session_id`` among ``sequence_ids`` (others are simply absent),
        each with its day restarted: a training request is using them."""
        ids = sorted(set(sequence_ids))
        now = self._clock()
        rows: list[tuple] = []
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for chunk in _chunks(ids):
                marks = ",".join("?" * len(chunk))
                found = self._db.execute(
                    # typeof, not IS NOT NULL: SQLite answers typeof without reading the value (a
                    # long record's routing is tens of megabytes; take runs on the event loop)
                    "SELECT s.sequence_id, p.prompt, s.tokens, s.logprobs, "
                    "typeof(p.routing) = 'blob' OR r.rowid IS NOT NULL, p.routing_model, r.rowid, p.rowid, "
                    "s.request_key "
                    "FROM sampled_sequences s "
                    "JOIN sampled_prompts p ON p.request_key = s.request_key "
                    "LEFT JOIN sampled_routing r ON r.sequence_id = s.sequence_id "
                    f"WHERE s.session_id=? AND s.expires_at>? AND s.sequence_id IN ({marks})",
                    (session_id, now, *chunk),
                ).fetchall()
                self._db.execute(
                    f"UPDATE sampled_sequences SET expires_at=? WHERE session_id=? AND expires_at>? "
                    f"AND sequence_id IN ({marks})",
                    (now + self.ttl_s, session_id, now, *chunk),
                )
                rows += found
        return {
            sid: RecordedSequence(
                np.frombuffer(prompt, dtype="<i4"),
                np.frombuffer(tokens, dtype="<i4"),
                np.frombuffer(lps, dtype="<f4"),
                # another model's routing is not this one's to replay
                (row, prompt_row) if routed and model == self.model else None,
                key,
            )
            for sid, prompt, tokens, lps, routed, model, row, prompt_row, key in rows
        }

    def routing(
        self, records: Mapping[str, RecordedSequence], runs: Iterable[RoutingRun]
    ) -> dict[RoutingRun, np.ndarray]:
        """The routing each run reads of ``records`` (``take``'s: live, the session's, this
        model's), ``(length, layers, top_k)``; a run with none is absent. Only the run's rows are
        read (SQLite's incremental blob I/O: a SQL function such as ``substr`` would load the
        whole value), so a training request reads and holds its own tokens' routing, never whole
        records (a key may keep gigabytes of them); a run of no position reads nothing. The lock
        is let go between records: sampling records and the event loop's ``take`` wait for one
        record's read at most.

        ``take`` ran earlier, on the event loop: since then the record may have been replaced (its
        ``seq_id`` sampled again) or dropped, and SQLite may have given its row id to another
        record, another key's too. So a row is read only if it is still the one ``take`` saw: the
        sequence's row names the same sampling request and tokens, the routing row the same
        sequence (or, for a prompt's, the same request). Otherwise the run has no routing."""
        by_record: dict[tuple[str, int, str], list[RoutingRun]] = {}
        for run in sorted({run for run in runs if run[3] > 0}):
            if (record := records.get(run[0])) is not None and record.rows is not None:
                table, rowid = ("sampled_routing", record.rows[0]) if run[1] else ("sampled_prompts", record.rows[1])
                if rowid is not None:
                    by_record.setdefault((table, rowid, run[0]), []).append(run)
        out: dict[RoutingRun, np.ndarray] = {}
        for (table, rowid, sequence_id), record_runs in by_record.items():
            with self._lock:
                if self._still(table, rowid, sequence_id, records[sequence_id]):
                    out.update(self._read_runs(table, rowid, record_runs))
        return out

    def _still(self, table: str, rowid: int, sequence_id: str, record: RecordedSequence) -> bool:
        """Whether routing row ``rowid`` of ``table`` is still ``record``'s (read no routing)."""
        owner = "sequence_id" if table == "sampled_routing" else "request_key"
        same_row = self._db.execute(
            f"SELECT 1 FROM {table} WHERE rowid=? AND {owner}=?",
            (rowid, sequence_id if table == "sampled_routing" else record.request_key),
        ).fetchone()
        same_record = self._db.execute(
            "SELECT 1 FROM sampled_sequences WHERE sequence_id=? AND request_key=? AND tokens=?",
            (sequence_id, record.request_key, record.tokens.astype("<i4").tobytes()),
        ).fetchone()
        return same_row is not None and same_record is not None

    def _read_runs(self, table: str, rowid: int, runs: list[RoutingRun]) -> dict[RoutingRun, np.ndarray]:
        """Each run's rows of one record's routing (none if it has no routing, or is gone)."""
        try:
            blob = self._db.blobopen(table, "routing", rowid, readonly=True)
        except sqlite3.OperationalError:  # NULL (no routing kept), or the row deleted since
            return {}
        out = {}
        with blob:
            stream = io.BytesIO(blob.read(min(len(blob), 4096)))  # the .npy header, and then some
            version = np.lib.format.read_magic(stream)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(stream)
            data, row_bytes = stream.tell(), int(np.prod(shape[1:])) * dtype.itemsize
            for run in runs:
                _, _, offset, length = run
                rows = max(0, min(offset + length, shape[0]) - offset)
                if rows:
                    blob.seek(data + offset * row_bytes)
                out[run] = np.frombuffer(blob.read(rows * row_bytes) if rows else b"", dtype=dtype).reshape(
                    rows, *shape[1:]
                )
        return out

    def delete_expired(self) -> int:
        """Drop sequences past their day, and prompts no sequence refers to any more."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            now = self._clock()
            self._db.execute(
                "DELETE FROM sampled_routing WHERE sequence_id IN "
                "(SELECT sequence_id FROM sampled_sequences WHERE expires_at<=?)",
                (now,),
            )
            gone = self._db.execute("DELETE FROM sampled_sequences WHERE expires_at<=?", (now,)).rowcount
            if gone:
                self._db.execute(
                    "DELETE FROM sampled_prompts WHERE NOT EXISTS "
                    "(SELECT 1 FROM sampled_sequences s WHERE s.request_key = sampled_prompts.request_key)"
                )
        return gone


def _chunks(ids: list[str]) -> Iterable[list[str]]:
    return (ids[start : start + _IDS_PER_QUERY] for start in range(0, len(ids), _IDS_PER_QUERY))


def _int32(tokens: Iterable[int]) -> bytes:
    return np.asarray(list(tokens), dtype="<i4").tobytes()


def _npy(array: np.ndarray | None) -> bytes | None:
    if array is None:
        return None
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(array, dtype="<i2"), allow_pickle=False)
    return out.getvalue()


def _from_npy(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.load(io.BytesIO(blob), allow_pickle=False)
