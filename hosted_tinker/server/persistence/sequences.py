"""What the sampler knew: sequences sampled with ``record_stability_info``, kept for training.

A sampling request that asks for it records its prompt once and, per returned sequence, the
sampled tokens and the sampler's log-prob of each, under the ``sequence_id`` the client got
(``SampledSequence.sequence_id``). Training requests name them in provenance spans
(``Datum.with_provenance``), and ``stable_reinforce`` reads the recorded log-probs instead of
trusting the client's copy. On a mixture-of-experts model the record also holds which experts
each token was routed to (the prompt's once, each sequence's sampled tokens), which training
replays (``rank.routing_replay``): int16 ``(tokens, layers, top_k)``, stored as ``.npy`` bytes
(Qwen3-30B-A3B: 768 bytes a token, against 8 for the token and its log-prob).

As the official service documents: records belong to the session that sampled them, live one
day, and each training request that uses a sequence restarts its day. They are rows in the
server's SQLite file (their own connection; WAL lets it share the file with ``Store``), so
they survive a restart.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable
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
    expires_at REAL NOT NULL,
    routing BLOB
);
CREATE INDEX IF NOT EXISTS sampled_sequences_by_request ON sampled_sequences(request_key);
CREATE INDEX IF NOT EXISTS sampled_sequences_by_expiry ON sampled_sequences(expires_at);
"""


# Columns added since the tables were first made (a data directory of an earlier version).
_ADDED = [("sampled_prompts", "routing"), ("sampled_sequences", "routing")]


@dataclass(frozen=True)
class RecordedSequence:
    """prompt int32 ``(P,)``, tokens int32 ``(T,)``, logprobs float32 ``(T,)``: the sampler's
    log-prob of each sampled token, exactly as returned to the client; on a mixture-of-experts
    model, the experts of each prompt position ``(P, layers, top_k)`` and of each sampled token
    ``(T, layers, top_k)`` (-1 where none was recorded), else None."""

    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    prompt_routing: np.ndarray | None = None
    routing: np.ndarray | None = None


class Sampled(NamedTuple):
    """One sampled sequence as ``record`` takes it."""

    sequence_id: str
    tokens: Iterable[int]
    logprobs: Iterable[float]
    routing: np.ndarray | None = None


class SequenceRecords:
    def __init__(self, path: str | Path, ttl_s: float = TTL_S, clock: Callable[[], float] = time.time) -> None:
        self._db = connect(path, _SCHEMA)
        for table, column in _ADDED:
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} BLOB")
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
        sequences: Iterable[Sampled | tuple],
        prompt_routing: np.ndarray | None = None,
    ) -> None:
        """One sampling request: its prompt (and its routing), and each sequence (``Sampled``)."""
        expires = self._clock() + self.ttl_s
        rows = [
            (
                seq.sequence_id,
                request_key,
                session_id,
                _int32(seq.tokens),
                np.asarray(list(seq.logprobs), dtype="<f4").tobytes(),
                expires,
                _npy(seq.routing),
            )
            for seq in (Sampled(*s) for s in sequences)
        ]
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO sampled_prompts(request_key, prompt, routing) VALUES (?,?,?)",
                (request_key, _int32(prompt), _npy(prompt_routing)),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO sampled_sequences"
                "(sequence_id, request_key, session_id, tokens, logprobs, expires_at, routing) VALUES (?,?,?,?,?,?,?)",
                rows,
            )

    def take(self, session_id: str, sequence_ids: Iterable[str]) -> dict[str, RecordedSequence]:
        """The live records of ``session_id`` among ``sequence_ids`` (others are simply absent),
        each with its day restarted: a training request is using them."""
        ids = sorted(set(sequence_ids))
        now = self._clock()
        rows: list[tuple] = []
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for start in range(0, len(ids), _IDS_PER_QUERY):
                chunk = ids[start : start + _IDS_PER_QUERY]
                marks = ",".join("?" * len(chunk))
                found = self._db.execute(
                    "SELECT s.sequence_id, p.prompt, s.tokens, s.logprobs, p.routing, s.routing "
                    "FROM sampled_sequences s "
                    "JOIN sampled_prompts p ON p.request_key = s.request_key "
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
                _from_npy(prompt_routing),
                _from_npy(routing),
            )
            for sid, prompt, tokens, lps, prompt_routing, routing in rows
        }

    def delete_expired(self) -> int:
        """Drop sequences past their day, and prompts no sequence refers to any more."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            gone = self._db.execute("DELETE FROM sampled_sequences WHERE expires_at<=?", (self._clock(),)).rowcount
            if gone:
                self._db.execute(
                    "DELETE FROM sampled_prompts WHERE NOT EXISTS "
                    "(SELECT 1 FROM sampled_sequences s WHERE s.request_key = sampled_prompts.request_key)"
                )
        return gone


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
