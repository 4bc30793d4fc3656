"""What each console page shows, gathered from the services the API routes use (never by asking
the server over HTTP). Runs on the event loop, except ``recent_errors`` (a file read: callers
run it in a thread). Every function that names a run checks that the tenant owns it first."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosted_tinker.core.checkpoints import TinkerPath
from hosted_tinker.server.quotas import LIVE_S
from hosted_tinker.server.serving.health import health

if TYPE_CHECKING:
    from hosted_tinker.server.api.state import ServerState

RUNS_PER_PAGE = 50
ERRORS_SHOWN = 50
MODELS_SHOWN = 50  # of the busiest queues and the resident models
CHECKPOINTS_SHOWN = 100  # of a run's, newest first (each gets signed links to its files)
LOG_TAIL_BYTES = 1 << 20  # the request log's last MiB is searched for errors


def runs(state: ServerState, tenant: str, offset: int) -> dict[str, Any]:
    """A page of ``tenant``'s runs, newest first."""
    models, total = state.store.list_models(tenant, RUNS_PER_PAGE, offset)
    last_steps = state.run_metrics.last_steps([m.model_id for m in models])
    rows = [
        {
            "run_id": m.model_id,
            "base_model": m.base_model,
            "lora_rank": m.lora.get("rank"),
            "created_at": m.created_at,
            "last_step": last_steps.get(m.model_id),
            "status": m.status,
            "session_id": m.session_id,
        }
        for m in models
    ]
    pages = {
        "previous": max(0, offset - RUNS_PER_PAGE) if offset > 0 else None,
        "next": offset + RUNS_PER_PAGE if offset + RUNS_PER_PAGE < total else None,
    }
    return {"runs": rows, "total": total, "offset": offset, "pages": pages}


def run(state: ServerState, tenant: str, run_id: str, base_url: str) -> dict[str, Any]:
    """One run of ``tenant``'s: what it is, its checkpoints (with signed links to their files)
    and its sampling sessions. Another tenant's run is a 404, as on the API. Lists checkpoint
    directories: run it in a thread."""
    model = state.tenancy.run(tenant, run_id)
    records = state.store.list_checkpoints(run_id)
    checkpoints = []
    for record in records[:CHECKPOINTS_SHOWN]:
        try:
            urls = state.checkpoints.links.urls(TinkerPath(run_id, record.kind, record.name), base_url, tenant).urls
        except OSError:  # deleted (or swept past its TTL) since it was listed
            continue
        files = [{"name": name, "url": url} for name, url in urls.items()]
        checkpoint = state.runs.checkpoint_json(record).model_dump()
        checkpoints.append({**checkpoint, "kind": record.kind, "name": record.name, "files": files})
    samplers = [
        {
            "sampler_id": sampler.sampler_id,
            "kind": sampler.kind,
            "model_path": sampler.model_path,
            "session_id": sampler.session_id,
            "created_at": created_at,
        }
        for sampler, created_at in state.store.samplers_of_run(run_id, owner=tenant)
    ]
    return {
        "run_id": run_id,
        "base_model": model.base_model,
        "lora": model.lora,
        "status": model.status,
        "created_at": model.created_at,
        "session_id": model.session_id,
        "user_metadata": model.user_metadata,
        "checkpoints": checkpoints,
        "checkpoints_total": len(records),
        "samplers": samplers,
    }


def server(state: ServerState) -> dict[str, Any]:
    """The operator's page: what /healthz says, per-model queue depths, the keys and their use."""
    status = health(state).model_dump()
    now = time.time()
    keys = []
    for record in state.store.list_api_keys():
        limits = state.quotas.of(record.key_id)
        keys.append(
            {
                "key_id": record.key_id,
                "name": record.name,
                "prefix": record.prefix,
                "created_at": record.created_at,
                "revoked_at": record.revoked_at,
                "limits": limits.model_dump() if limits is not None else {},
                "usage": state.store.usage(record.key_id, live_since=now - LIVE_S),
            }
        )
    queue = sorted(state.scheduler.pending_per_model().items(), key=lambda item: -item[1])[:MODELS_SHOWN]
    resident = state.training.residency.resident()[:MODELS_SHOWN]
    return {"health": status, "keys": keys, "queue_by_model": queue, "resident": resident}


def recent_errors(log_path: Path, limit: int = ERRORS_SHOWN) -> list[dict[str, Any]]:
    """The last ``limit`` answers of 400 or more in the request log (its last MiB), newest
    first. A file read: run it in a thread."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL_BYTES))
            tail = f.read().splitlines()
    except OSError:
        return []
    if size > LOG_TAIL_BYTES:
        tail = tail[1:]  # the first line is cut
    found: deque[dict[str, Any]] = deque(maxlen=limit)
    for raw in tail:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and isinstance(line.get("status"), int) and line["status"] >= 400:
            found.append(line)
    return list(reversed(found))


def when(t: float | None) -> str:
    """A stored time for a page: UTC, to the second (the page's script shows it as local time)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "—"


def size(n: int | None) -> str:
    """Bytes for a page: 1.5 MiB."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
