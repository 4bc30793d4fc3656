"""Each training run's metrics, step by step: what ``GET /api/v1/training_runs/{id}/metrics``
serves to the web console and to scripts.

One row per *successfully finished* ``forward_backward`` or ``optim_step`` of a run (forward-only
calls are not steps), recorded on the dispatch thread as the call's job ends
(``serving.training``). A row belongs to the optimizer step it is part of, counted from 0 in the
run: ``forward_backward`` calls to the step that the next ``optim_step`` closes, an ``optim_step``
to the step it closes. A step is served as its calls summed up: durations and tokens added, the
``forward_backward`` metrics merged by their ``name:reduction`` suffix (``merge_metrics``), and
the ``optim_step``'s own metrics (``grad_norm``, ``learning_rate``, ``optimizer_step``) beside.

A ``duration_s`` is the wall time of the call's backend work; a request that ran in a joint
pass with other models' (``serving.joint_passes``) has its share of the pass's, by tokens.

Rows live in the server's SQLite file (table in ``schema.RUN_METRICS_SCHEMA``; their own
connection and lock, as ``sequences`` and ``serving.custom_losses``), so they outlive a restart.
Each run keeps its newest ``max_steps_per_run`` closed steps, and of its open one the newest
``MAX_OPEN_CALLS`` calls; models are never deleted from the store (unloaded ones stay listed as
runs), so neither are their metrics.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hosted_tinker.server.persistence.schema import RUN_METRICS_SCHEMA, connect

FORWARD_BACKWARD = "forward_backward"
OPTIM_STEP = "optim_step"
KINDS = (FORWARD_BACKWARD, OPTIM_STEP)
MAX_OPEN_CALLS = 10_000  # forward_backward calls kept of one step (checked every OPEN_CHECK_EVERY seq_ids)
OPEN_CHECK_EVERY = 1000

# A row as read back: (step, kind, recorded_at, duration_s, tokens, metrics JSON).
_Row = tuple[int, str, float, float, int, str]
_COLUMNS = "step, kind, recorded_at, duration_s, tokens, metrics"


def merge_metrics(calls: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's metrics from its ``forward_backward`` calls' (oldest first), by Tinker's naming
    convention, the suffix after the last ``:``: ``sum`` added, ``mean`` averaged (unweighted,
    over the calls that have it), ``max`` / ``min`` the extreme; any other name, the last value."""
    merged: dict[str, float] = {}
    means: dict[str, int] = {}  # how many calls had each :mean name
    for metrics in calls:
        for name, raw in metrics.items():
            value = float(raw)
            _, colon, reduction = name.rpartition(":")
            reduction = reduction if colon else ""
            if name not in merged:
                merged[name] = value
            elif reduction in ("sum", "mean"):
                merged[name] += value
            elif reduction == "max":
                merged[name] = max(merged[name], value)
            elif reduction == "min":
                merged[name] = min(merged[name], value)
            else:
                merged[name] = value
            if reduction == "mean":
                means[name] = means.get(name, 0) + 1
    for name, count in means.items():
        merged[name] /= count
    return merged


def _step_json(step: int, rows: list[_Row]) -> dict[str, Any]:
    """One step from its rows (in call order); with ``optim`` when its ``optim_step`` is among them."""
    calls = [row for row in rows if row[1] == FORWARD_BACKWARD]
    optim = next((row for row in rows if row[1] == OPTIM_STEP), None)
    out: dict[str, Any] = {
        "step": step,
        # A closed step's time is its optim_step's; an open one's, its latest call's.
        "time": (optim or rows[-1])[2],
        "duration_s": sum(row[3] for row in rows),
        "tokens": sum(row[4] for row in calls),
        "calls": len(calls),
        "metrics": _finite(merge_metrics([json.loads(row[5]) for row in calls])),
    }
    if optim is not None:
        out["optim"] = _finite(json.loads(optim[5]))
    return out


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    """NaN and infinities as null: JSON has no such numbers, and browsers refuse the bare words."""
    return {name: value if math.isfinite(value) else None for name, value in metrics.items()}


def _grouped(rows: list[_Row]) -> list[tuple[int, list[_Row]]]:
    """Rows ordered by step, grouped by it."""
    groups: list[tuple[int, list[_Row]]] = []
    for row in rows:
        if not groups or groups[-1][0] != row[0]:
            groups.append((row[0], []))
        groups[-1][1].append(row)
    return groups


class RunMetrics:
    """Thread-safe: the dispatch thread records while the event loop's worker threads read."""

    def __init__(self, path: str | Path, max_steps_per_run: int = 10_000) -> None:
        if max_steps_per_run < 1:
            raise ValueError(f"max_steps_per_run must be at least 1, got {max_steps_per_run}")
        self.max_steps_per_run = max_steps_per_run
        self._db = connect(path, RUN_METRICS_SCHEMA)
        self._lock = threading.Lock()

    def _last_closed(self, model_id: str) -> int | None:
        """The run's newest closed step (under the lock). Walks the (model_id, step) index from
        the top, past the open step's few rows."""
        row = self._db.execute(
            "SELECT step FROM run_metrics WHERE model_id=? AND kind=? ORDER BY step DESC LIMIT 1",
            (model_id, OPTIM_STEP),
        ).fetchone()
        return None if row is None else row[0]

    def record(
        self,
        model_id: str,
        seq_id: int,
        kind: str,
        recorded_at: float,
        duration_s: float,
        tokens: int,
        metrics: Mapping[str, float],
    ) -> None:
        """A finished call of ``model_id``, in the run's call order. A second record of the same
        ``(model_id, seq_id)`` changes nothing."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        body = json.dumps({name: float(value) for name, value in metrics.items()})
        with self._lock:
            closed = self._last_closed(model_id)
            step = 0 if closed is None else closed + 1
            inserted = self._db.execute(
                "INSERT OR IGNORE INTO run_metrics VALUES (?,?,?,?,?,?,?,?)",
                (model_id, seq_id, kind, step, recorded_at, duration_s, tokens, body),
            ).rowcount
            if inserted and kind == OPTIM_STEP and step >= self.max_steps_per_run:
                self._db.execute(
                    "DELETE FROM run_metrics WHERE model_id=? AND step<=?", (model_id, step - self.max_steps_per_run)
                )
            elif inserted and seq_id % OPEN_CHECK_EVERY == 0:
                # A client that never calls optim_step must not grow its open step without end:
                # past MAX_OPEN_CALLS, its oldest calls go (the step's merge then covers the rest).
                self._db.execute(
                    "DELETE FROM run_metrics WHERE model_id=? AND step=? AND seq_id NOT IN "
                    "(SELECT seq_id FROM run_metrics WHERE model_id=? AND step=? ORDER BY seq_id DESC LIMIT ?)",
                    (model_id, step, model_id, step, MAX_OPEN_CALLS),
                )

    def last_steps(self, model_ids: Sequence[str]) -> dict[str, int]:
        """The newest closed step of each of ``model_ids`` that has one (for the console's list)."""
        if not model_ids:
            return {}
        marks = ",".join("?" * len(model_ids))
        with self._lock:
            rows = self._db.execute(
                f"SELECT model_id, MAX(step) FROM run_metrics WHERE kind=? AND model_id IN ({marks}) GROUP BY model_id",
                (OPTIM_STEP, *model_ids),
            ).fetchall()
        return {model_id: step for model_id, step in rows}

    def steps(self, model_id: str, after: int = -1, limit: int = 500, with_open: bool = True) -> dict[str, Any]:
        """The run's closed steps after step ``after``, oldest first, at most ``limit``;
        ``next_after`` (the last one's index) when there are more; and, ``with_open``, the step
        still open (its ``forward_backward`` calls since the last ``optim_step``), or None."""
        if after < -1 or limit < 1:
            raise ValueError(f"after must be >= -1 and limit >= 1, got after={after}, limit={limit}")
        with self._lock:
            closed = [
                row[0]
                for row in self._db.execute(
                    "SELECT step FROM run_metrics WHERE model_id=? AND kind=? AND step>? ORDER BY step LIMIT ?",
                    (model_id, OPTIM_STEP, after, limit + 1),
                )
            ]
            page = closed[:limit]
            rows: list[_Row] = []
            if page:
                rows = self._db.execute(
                    f"SELECT {_COLUMNS} FROM run_metrics WHERE model_id=? AND step BETWEEN ? AND ? "
                    "ORDER BY step, seq_id",
                    (model_id, page[0], page[-1]),
                ).fetchall()
            open_rows: list[_Row] = []
            if with_open:
                last = self._last_closed(model_id)
                open_rows = self._db.execute(
                    f"SELECT {_COLUMNS} FROM run_metrics WHERE model_id=? AND step>? ORDER BY seq_id",
                    (model_id, -1 if last is None else last),
                ).fetchall()
        # JSON is parsed off the lock: a large page must not hold up the dispatch thread's records.
        shown = set(page)
        return {
            "run_id": model_id,
            "steps": [_step_json(step, group) for step, group in _grouped(rows) if step in shown],
            "next_after": page[-1] if len(closed) > limit else None,
            "open_step": _step_json(open_rows[0][0], open_rows) if open_rows else None,
        }
