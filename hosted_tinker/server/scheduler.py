"""Per-model ``seq_id`` ordering, de-duplication, backpressure, and dispatch to the backend worker.

A request becomes a future at submit time. It waits in its model's queue until every lower
``seq_id`` has been dispatched, then runs on the single dispatch thread, which drives the
backend's worker process. Jobs reach that thread in dispatch order, so each model's requests
execute in ``seq_id`` order, while the event loop stays free to answer polls and health
checks. A finished future wakes its pollers at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from hosted_tinker.core.errors import ApiError, ServerError, too_many
from hosted_tinker.server.metrics import ServerMetrics
from hosted_tinker.server.persistence.records import FutureRecord
from hosted_tinker.server.persistence.store import Store

log = logging.getLogger(__name__)

# A job returns its result as (payload bytes, media type).
Job = Callable[[], tuple[bytes, str]]

# Early arrivals hold their decoded batches in memory until their turn: bound them. The SDK
# runs at most a few requests ahead (chunks of one call, the cookbook's 2-batch pipeline).
MAX_WAITING_PER_MODEL = 256
MAX_SEQ_AHEAD = 4096
RETRY_AFTER_S = 1  # what a 429 asks for; the SDK's HTTP layer honours Retry-After
RECORD_RETRY_S = (0.05, 0.2, 1.0, 5.0, 15.0)  # between tries to write a job's outcome (``_recorded``)


@dataclass(frozen=True)
class QueueLimits:
    """Bounds on accepted, unfinished requests (each holds its decoded input in memory until it
    has run). Over a bound, a submit gets 429 + Retry-After and the SDK sends it again later."""

    max_pending: int = 1024  # over all models and samplers
    max_pending_per_model: int = 64  # per training model or sampling session
    # The forward_backward batches they hold, in request bytes (about 2.5x that in memory once
    # decoded): 256 waiting batches of 256 MiB would otherwise be allowed.
    max_pending_bytes: int = 4 << 30


class KeyBounds(Protocol):
    """Who owns a request, and how many pending requests that owner may have (``server.quotas``):
    one key must not fill the server's bound, e.g. with requests that wait for a ``seq_id`` it
    never sends."""

    def owner(self, subject: str) -> str | None:
        """The key that opened the session a model or sampler id names (None: nobody's)."""
        ...

    def pending(self, owner: str) -> tuple[int, int] | None:
        """The most requests ``owner`` may have accepted and unfinished, and the most bytes of
        batches they may hold (None: no bound)."""
        ...


@dataclass
class _ModelQueue:
    next_seq: int
    waiting: dict[int, tuple[str, Job]] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        store: Store,
        limits: QueueLimits = QueueLimits(),
        metrics: ServerMetrics | None = None,
        keys: KeyBounds | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.keys = keys
        self.metrics = metrics or ServerMetrics()  # the server's counters, for every service that has the scheduler
        self._pending: dict[str, str | None] = {}  # request id -> its model, until it finishes
        self._when_done: dict[str, Callable[[], None]] = {}  # request id -> what its end lets go
        self._pending_per_model: dict[str | None, int] = {}
        self._owners: dict[str, str] = {}  # request id -> the key it counts against (``keys``)
        self._pending_per_key: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # request id -> the bytes of the batch it holds
        self._pending_bytes = 0
        self._pending_bytes_per_key: dict[str, int] = {}
        self.refused = 0  # submits answered 429
        # Per model, the seq_ids of its jobs dispatched and not yet started, in order.
        self._unstarted: dict[str, deque[int]] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dispatch")
        self._queues: dict[str, _ModelQueue] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._watchers: dict[str | None, set[asyncio.Event]] = {}  # model -> who waits for any of its results
        self.cancelled = 0  # sampling requests their clients gave up (cancel_future)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._count_lock = threading.Lock()
        self.in_flight = 0  # dispatched to the worker and not yet finished

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

    # ---- submitting -----------------------------------------------------------------------

    def find(self, model_id: str, seq_id: int) -> str | None:
        """The request id already registered for ``(model_id, seq_id)``, if any."""
        return self.store.find_future(model_id, seq_id)

    def check_capacity(self, model_id: str, seq_id: int | None, owner: str | None = None, size: int = 0) -> None:
        """Refuse, for now, a request over a queue bound (429: the SDK retries it after Retry-After):
        the server's, its model's, or its key's (``owner``, else the owner of ``model_id``), in
        requests and in the ``size`` bytes of the batch it holds.

        The request a model's queue is waiting for is always let in: refusing it while its
        successors hold the slots would leave them waiting forever. So is a batch when nothing
        else holds bytes: one as large as the body limit allows must be able to run.
        """
        queue = self._queues.get(model_id)
        if queue is not None and seq_id == queue.next_seq and queue.waiting:
            return
        if queue is not None and seq_id is not None and seq_id != queue.next_seq:
            if seq_id - queue.next_seq > MAX_SEQ_AHEAD or len(queue.waiting) >= MAX_WAITING_PER_MODEL:
                raise self._refuse(
                    f"seq_id {seq_id} is too far ahead of model {model_id} (next to run: {queue.next_seq})"
                )
        if self._pending_per_model.get(model_id, 0) >= self.limits.max_pending_per_model:
            raise self._refuse(
                f"{model_id} has {self.limits.max_pending_per_model} requests pending (the per-model bound)"
            )
        owner = owner or self._owner(model_id)
        limits = self.keys.pending(owner) if self.keys is not None and owner is not None else None
        if limits is not None and owner is not None:  # (limits: only with an owner)
            count, held = limits
            if self._pending_per_key.get(owner, 0) >= count:
                raise self._refuse(
                    f"limit pending reached: this key has {count} requests pending (accepted, unfinished)"
                )
            holding = self._pending_bytes_per_key.get(owner, 0)  # once: the dispatch thread releases
            if _over(holding, size, held):
                raise self._refuse(
                    f"limit pending_bytes reached: this key's pending batches hold {holding} bytes; "
                    f"this one's {size} would pass {held}"
                )
        if len(self._pending) >= self.limits.max_pending:
            raise self._refuse(f"the server has {self.limits.max_pending} requests pending (its global bound)")
        holding = self._pending_bytes
        if _over(holding, size, self.limits.max_pending_bytes):
            raise self._refuse(
                f"the server's pending batches hold {holding} bytes; this one's {size} would pass "
                f"its bound of {self.limits.max_pending_bytes} (--max-pending-bytes)"
            )

    def _owner(self, subject: str | None) -> str | None:
        return self.keys.owner(subject) if self.keys is not None and subject is not None else None

    def _refuse(self, detail: str) -> ApiError:
        self.refused += 1
        return too_many(detail, RETRY_AFTER_S)

    def queue_status(self) -> dict:
        """For /healthz: what is queued, and the bounds."""
        return {
            "in_flight": self.in_flight,
            "pending": len(self._pending),
            "pending_busiest_model": max(self._pending_per_model.values(), default=0),
            "pending_busiest_key": max(self._pending_per_key.values(), default=0),
            "pending_bytes": self._pending_bytes,
            "max_pending_bytes": self.limits.max_pending_bytes,
            "max_pending": self.limits.max_pending,
            "max_pending_per_model": self.limits.max_pending_per_model,
            "refused": self.refused,
            "cancelled": self.cancelled,
        }

    def open_model(self, model_id: str, first_seq: int = 1) -> None:
        """Start ordering a model's requests; its creation was seq 0."""
        self._queues.setdefault(model_id, _ModelQueue(next_seq=first_seq))

    def close_model(self, model_id: str, why: str = "was unloaded", category: str = "user") -> None:
        """Stop ordering a model's requests; those still waiting for their turn fail."""
        queue = self._queues.pop(model_id, None)
        for request_id, _ in queue.waiting.values() if queue else ():
            self._finish(request_id, error=f"model {model_id} {why} before this request ran", category=category)

    def close_model_threadsafe(self, model_id: str, why: str, category: str) -> None:
        """``close_model`` from the dispatch thread: the queues belong to the event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.close_model, model_id, why, category)

    def submit(
        self, kind: str, job: Job, *, model_id: str | None = None, seq_id: int | None = None, size: int = 0
    ) -> str:
        """Register a future for ``job`` (holding a batch of ``size`` bytes) and queue it; return
        its request id.

        A resent ``(model_id, seq_id)`` returns the original request id and queues nothing.
        Synchronous on purpose: with no await inside, two identical submits cannot race.
        """
        if model_id is not None and seq_id is not None:
            existing = self.find(model_id, seq_id)
            if existing is not None:
                return existing
        request_id = self.register(kind, model_id=model_id, seq_id=seq_id, size=size)
        job = self._timed(kind, job)
        queue = self._queues.get(model_id) if model_id is not None else None
        if queue is None or model_id is None or seq_id is None:  # (a queue: only with a model_id)
            self._dispatch(request_id, job)
        elif seq_id < queue.next_seq:
            self._finish(request_id, error=f"seq_id {seq_id} of model {model_id} was already used", category="user")
        else:
            queue.waiting[seq_id] = (request_id, job)
            while queue.next_seq in queue.waiting:
                rid, next_job = queue.waiting.pop(queue.next_seq)
                with self._count_lock:
                    self._unstarted.setdefault(model_id, deque()).append(queue.next_seq)
                self._dispatch(rid, self._starting(model_id, queue.next_seq, next_job))
                queue.next_seq += 1
        return request_id

    def _timed(self, kind: str, job: Job) -> Job:
        seconds = self.metrics.job_seconds.labels(kind)

        def run() -> tuple[bytes, str]:
            with seconds.time():
                return job()

        return run

    def _starting(self, model_id: str, seq_id: int, job: Job) -> Job:
        def run() -> tuple[bytes, str]:
            with self._count_lock:
                self._unstarted[model_id].popleft()
                if not self._unstarted[model_id]:
                    del self._unstarted[model_id]
            return job()

        return run

    def up_next(self, model_id: str) -> int | None:
        """The seq_id of the model's job that runs next on the dispatch thread, if one was
        dispatched (every earlier one has started): a job that may run ahead of its turn
        (``serving.joint_passes``) without breaking the model's order."""
        with self._count_lock:
            unstarted = self._unstarted.get(model_id)
            return unstarted[0] if unstarted else None

    def next_seq(self, model_id: str) -> int | None:
        """The seq_id a model's queue waits for next (read from the dispatch thread: an int)."""
        queue = self._queues.get(model_id)
        return queue.next_seq if queue is not None else None

    def pending_per_model(self) -> dict[str, int]:
        """Accepted, unfinished requests of each model or sampler (for /metrics)."""
        with self._count_lock:
            return {model: n for model, n in self._pending_per_model.items() if model is not None}

    def register(self, kind: str, *, model_id: str | None = None, seq_id: int | None = None, size: int = 0) -> str:
        """A new pending future whose outcome someone will report with ``complete``/``fail``."""
        request_id = f"req-{secrets.token_urlsafe(12)}"
        owner = self._owner(model_id)  # before the row: a future stored must be held, and end
        self.store.add_future(request_id, kind=kind, model_id=model_id, seq_id=seq_id)
        self._events[request_id] = asyncio.Event()
        self._hold(request_id, model_id, owner, size)
        return request_id

    @contextmanager
    def slot(self, key: str, owner: str | None = None) -> Iterator[None]:
        """A place under the bounds for a request that has no future (an OpenAI completion,
        answered on its own connection), held while it runs; 429 when there is none. ``key`` is
        what the per-model bound counts it against, ``owner`` the key's."""
        self.check_capacity(key, None, owner)
        token = f"slot-{secrets.token_urlsafe(12)}"
        self._hold(token, key, owner)
        try:
            yield
        finally:
            self._release(token)

    def _hold(self, request_id: str, model_id: str | None, owner: str | None, size: int = 0) -> None:
        with self._count_lock:
            self._pending[request_id] = model_id
            self._pending_per_model[model_id] = self._pending_per_model.get(model_id, 0) + 1
            if owner is not None:
                self._owners[request_id] = owner
                self._pending_per_key[owner] = self._pending_per_key.get(owner, 0) + 1
            if size:
                self._sizes[request_id] = size
                self._pending_bytes += size
                if owner is not None:
                    self._pending_bytes_per_key[owner] = self._pending_bytes_per_key.get(owner, 0) + size

    def when_done(self, request_id: str, release: Callable[[], None]) -> None:
        """Call ``release`` when the request finishes however it does (done, failed, or dropped
        before it ran: its model unloaded); at once if it already has."""
        with self._count_lock:
            if request_id in self._pending:
                self._when_done[request_id] = release
                return
        release()

    def _release(self, request_id: str) -> None:
        with self._count_lock:
            release = self._when_done.pop(request_id, None)
        if release is not None:
            try:
                release()
            except Exception:
                log.exception("releasing what request %s held failed", request_id)
        with self._count_lock:
            if request_id in self._pending:
                _decrement(self._pending_per_model, self._pending.pop(request_id))
            size = self._sizes.pop(request_id, 0)
            self._pending_bytes -= size
            if request_id in self._owners:
                owner = self._owners.pop(request_id)
                _decrement(self._pending_per_key, owner)
                if size:
                    _decrement(self._pending_bytes_per_key, owner, size)

    def complete(self, request_id: str, payload: bytes, media_type: str) -> None:
        self._finish(request_id, payload=payload, media_type=media_type)

    def fail(self, request_id: str, error: str, category: str) -> None:
        self._finish(request_id, error=error, category=category)

    def run_on_worker(self, fn: Callable[[], None]) -> None:
        """Queue work that reports its own futures (e.g. a sampling batch) behind earlier jobs."""
        with self._count_lock:
            self.in_flight += 1

        def run() -> None:
            try:
                fn()
            except Exception:
                log.exception("worker task failed")
            finally:
                with self._count_lock:
                    self.in_flight -= 1

        self._worker.submit(run)

    def _dispatch(self, request_id: str, job: Job) -> None:
        with self._count_lock:
            self.in_flight += 1
        self._worker.submit(self._run, request_id, job)

    def _run(self, request_id: str, job: Job) -> None:
        """On the worker thread: run the job and record its outcome."""
        try:
            try:
                self.store.future_started(request_id)  # its wait in the queue ends (a session's trace)
                payload, media_type = job()
            except Exception as e:
                self._recorded(request_id, functools.partial(self.fail_with, request_id, e))
            else:
                self._recorded(
                    request_id, functools.partial(self._finish, request_id, payload=payload, media_type=media_type)
                )
        finally:
            with self._count_lock:
                self.in_flight -= 1

    def _recorded(self, request_id: str, record: Callable[[], None]) -> None:
        """On the worker thread: ``record`` a job's outcome, trying again while the database
        refuses it. An outcome that is never written leaves its client polling forever, and the
        thread pool would drop the exception without a word."""
        for wait_s in (*RECORD_RETRY_S, None):
            try:
                record()
                return
            except sqlite3.OperationalError as e:
                if wait_s is None:
                    log.exception("the outcome of %s could not be recorded; its client will wait for it", request_id)
                    return
                log.warning("recording the outcome of %s failed (%s); again in %g s", request_id, e, wait_s)
                time.sleep(wait_s)

    def fail_with(self, request_id: str, error: BaseException) -> None:
        """Fail a future with what ``error`` means to its client (``core.errors``): the one place
        where an exception becomes a future's ``error`` and ``category``."""
        if isinstance(error, ServerError):
            message = error.message_for(self._pending.get(request_id))
        else:
            log.error("request %s failed", request_id, exc_info=error)
            message = f"internal error: {type(error).__name__}: {error}"
        category = error.category if isinstance(error, ServerError) else "server"
        if category == "server":
            log.error("request %s failed: %s", request_id, message)
        self._finish(request_id, error=message, category=category)

    def _finish(
        self,
        request_id: str,
        *,
        payload: bytes | None = None,
        media_type: str | None = None,
        error: str | None = None,
        category: str | None = None,
    ) -> None:
        if error is not None:
            self.store.fail_future(request_id, error, category or "server")
        else:
            self.store.complete_future(request_id, payload or b"", media_type or "application/json")
        model_id = self._pending.get(request_id)
        self._release(request_id)
        event = self._events.pop(request_id, None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake, event, model_id)

    def _wake(self, event: asyncio.Event | None, model_id: str | None) -> None:
        if event is not None:
            event.set()
        for watcher in self._watchers.pop(model_id, ()):
            watcher.set()

    # ---- polling --------------------------------------------------------------------------

    @contextmanager
    def watch(self, model_id: str) -> Iterator[asyncio.Event]:
        """An event set when any future of ``model_id`` next finishes. Enter before reading the
        store, so that a result written in between still wakes the reader."""
        event = asyncio.Event()
        self._watchers.setdefault(model_id, set()).add(event)
        try:
            yield event
        finally:
            watchers = self._watchers.get(model_id)
            if watchers is not None:
                watchers.discard(event)
                if not watchers:
                    del self._watchers[model_id]

    async def wait(self, request_id: str, timeout: float) -> FutureRecord | None:
        """The future's record once finished, or still pending after ``timeout`` seconds."""
        event = self._events.get(request_id)
        record = self.store.get_future(request_id)
        if record is None or record.finished or event is None:
            return record
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        return self.store.get_future(request_id)


def _decrement(counts: dict, key: object, by: int = 1) -> None:
    left = counts.pop(key) - by
    if left:
        counts[key] = left


def _over(held: int, size: int, bound: int) -> bool:
    """Whether a batch of ``size`` bytes would take what is held past ``bound``; one always fits
    when nothing is held."""
    return size > 0 and held > 0 and held + size > bound
