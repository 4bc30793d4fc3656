"""A session's timeline as a trace (``RestClient.export_session_trace``, ``tinker session
export-trace``): each finished request of its training runs and samplers, when it was submitted,
when it began to run, when it ended, from the store's ``timeline`` (kept for the result
retention, even for results a client has already retrieved).

The trace is Chrome's JSON trace-event format, which Perfetto (ui.perfetto.dev,
trace_processor) opens whatever the file is called, the SDK's ``.pftrace`` included. One thread
per training run or sampler, named by its id: a training request's run is a slice on it
(the worker runs one job at a time, so they never overlap). Waits in the queue, and samples
(which share decode passes, so they overlap), are async slices of their own.
"""

from __future__ import annotations

import json
from typing import Any

from hosted_tinker.server.persistence.store import Store

SESSION_PID = 1


def session_trace(store: Store, session_id: str) -> bytes:
    """The trace of ``session_id``'s finished requests (checked by the caller), as JSON bytes."""
    events: list[dict[str, Any]] = [_meta("process_name", 0, session_id)]
    threads: dict[str, int] = {}
    for subject, request_id, kind, seq_id, submitted, started, finished, status in store.session_timeline(session_id):
        tid = threads.get(subject)
        if tid is None:
            tid = threads[subject] = len(threads) + 1
            events.append(_meta("thread_name", tid, subject))
        args = {"request_id": request_id, "seq_id": seq_id, "status": status}
        name = kind if status == "done" else f"{kind} ({status})"
        if started is None or kind == "sample":  # its wait and its run are one span to us
            events += _async(name, "request", request_id, tid, submitted, finished, args)
            continue
        events += _async(f"queued: {kind}", "queue", request_id, tid, submitted, started, args)
        events.append(
            {"name": name, "cat": kind, "ph": "X", "pid": SESSION_PID, "tid": tid, "ts": _us(started),
             "dur": _us(finished) - _us(started), "args": args}
        )  # fmt: skip
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode()


def _us(t: float) -> int:
    return round(t * 1e6)


def _meta(what: str, tid: int, name: str) -> dict[str, Any]:
    return {"name": what, "ph": "M", "pid": SESSION_PID, "tid": tid, "args": {"name": name}}


def _async(name: str, cat: str, request_id: str, tid: int, start: float, end: float, args: dict) -> list[dict]:
    span = {"name": name, "cat": cat, "id": request_id, "pid": SESSION_PID, "tid": tid, "args": args}
    return [span | {"ph": "b", "ts": _us(start)}, span | {"ph": "e", "ts": _us(max(start, end))}]
