"""Many tenants, one pass: ``forward_backward`` requests of different models on the same base,
run together in one pass over it.

Every ``forward_backward`` (or forward-only) request is registered here once validated. When one
runs on the dispatch thread, it takes along the requests of other models that are *up next* for
their model (every earlier job of that model has started: ``Scheduler.up_next``), of the same
kind, whose model is on the workers, up to ``max_tokens`` in all, and the backend runs them in one
pass (``Trainer.forward_backward_many``: each model's loss and gradients its own, a failure only
its own request's). Each taken request keeps its place in the dispatch queue; when its turn comes
its job finds its outcome here and returns it. A model's requests therefore still run in
``seq_id`` order, and a request never waits for another tenant's: it can only run earlier.

Runs on the dispatch thread, except ``register``/``forget`` (the event loop): one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hosted_tinker.core.types import ForwardBackwardBatch, ForwardBackwardResult, RequestFailed
from hosted_tinker.rank.trainer import Trainer
from hosted_tinker.server.scheduler import Scheduler

# What is left of a batch's preparation, done on the dispatch thread just before the batch runs,
# in whichever request's pass (``TrainingService._replay``: the recorded routing, too big to
# read on the event loop); what it raises is the request's outcome. None: nothing left.
Finish = Callable[[], None] | None


@dataclass
class Pending:
    """A validated request, until its job has run (``outcome``: set when it ran in another's
    pass; ``seconds``: its share of its pass's time, by tokens, once it ran)."""

    model_id: str
    seq_id: int
    batch: ForwardBackwardBatch
    tokens: int
    finish: Finish = None
    outcome: ForwardBackwardResult | BaseException | None = None
    seconds: float = 0.0


class JointPasses:
    def __init__(
        self, trainer: Trainer, scheduler: Scheduler, resident: Callable[[str], bool], max_tokens: int
    ) -> None:
        self.trainer = trainer  # the workers' (``ProcessBackend.trainer``)
        self.scheduler = scheduler
        self.resident = resident  # whether a model is on the workers now (``Residency.is_resident``)
        self.max_tokens = max_tokens  # 0: every request runs alone
        self._pending: dict[tuple[str, int], Pending] = {}
        self._lock = threading.Lock()
        self.passes = 0  # joint passes run (of two requests or more)
        self.joined = 0  # requests that ran in another request's pass

    def status(self) -> dict:
        """For /healthz: the bound, and what joint passes have run since start."""
        return {"max_tokens": self.max_tokens, "passes": self.passes, "joined": self.joined}

    def register(self, model_id: str, seq_id: int, batch: ForwardBackwardBatch, finish: Finish = None) -> Pending:
        entry = Pending(model_id, seq_id, batch, sum(d.num_tokens for d in batch.data), finish)
        with self._lock:
            self._pending[(model_id, seq_id)] = entry
        return entry

    def forget(self, entry: Pending) -> None:
        with self._lock:
            self._pending.pop((entry.model_id, entry.seq_id), None)

    def run(self, entry: Pending) -> ForwardBackwardResult:
        """On the dispatch thread, when ``entry``'s job runs: its result, from a pass it joined
        earlier or from one it leads now."""
        self.forget(entry)
        if entry.outcome is None and self._ready(entry):
            companions = [c for c in self._companions(entry) if self._ready(c)]
            if not companions:
                started = time.perf_counter()
                try:
                    return self.trainer.forward_backward(entry.model_id, entry.batch)
                finally:
                    entry.seconds = time.perf_counter() - started
            self._run_together([entry, *companions])
        if isinstance(entry.outcome, BaseException):
            raise entry.outcome
        assert entry.outcome is not None  # _run_together gave every entry of its pass one
        return entry.outcome

    @staticmethod
    def _ready(entry: Pending) -> bool:
        """Whether ``entry`` may run: its preparation finished (once); what that raised, its outcome."""
        finish, entry.finish = entry.finish, None
        if finish is not None:
            try:
                finish()
            except Exception as e:  # a refusal (another model's routing), or a failed read
                entry.outcome = e
        return entry.outcome is None

    def _companions(self, lead: Pending) -> list[Pending]:
        """Other models' requests that may run now, with ``lead``: oldest first, within the budget."""
        if self.max_tokens <= 0:
            return []
        budget = self.max_tokens - lead.tokens
        chosen: list[Pending] = []
        with self._lock:
            for key in [key for key in self._pending if self._never_runs(*key)]:
                del self._pending[key]
            candidates = list(self._pending.values())
        for entry in candidates:
            if (
                entry.model_id == lead.model_id
                or entry.outcome is not None
                or entry.batch.forward_only != lead.batch.forward_only
                or entry.tokens > budget
                or any(c.model_id == entry.model_id for c in chosen)
                or self.scheduler.up_next(entry.model_id) != entry.seq_id
            ):
                continue
            if not self.resident(entry.model_id):  # bringing it back could push a model of this pass off
                continue
            chosen.append(entry)
            budget -= entry.tokens
        return chosen

    def _never_runs(self, model_id: str, seq_id: int) -> bool:
        """A request whose job will not run (its model was unloaded while it waited, or the job
        failed before it got here, e.g. bringing its model back): its turn has passed."""
        next_seq = self.scheduler.next_seq(model_id)
        if next_seq is None:
            return True
        up_next = self.scheduler.up_next(model_id)
        return seq_id < (up_next if up_next is not None else next_seq)

    def _run_together(self, entries: list[Pending]) -> None:
        with self._lock:
            for entry in entries[1:]:
                self._pending.pop((entry.model_id, entry.seq_id), None)
        started = time.perf_counter()
        outcomes: list[ForwardBackwardResult | BaseException]
        try:
            replies = self.trainer.forward_backward_many([(e.model_id, e.batch) for e in entries])
            outcomes = [r.error() if isinstance(r, RequestFailed) else r for r in replies]
        except BaseException as e:  # the workers died under all of them
            outcomes = [e] * len(entries)
        seconds, tokens = time.perf_counter() - started, sum(e.tokens for e in entries)
        for entry, outcome in zip(entries, outcomes, strict=True):
            entry.outcome = outcome
            entry.seconds = seconds * entry.tokens / max(1, tokens)
        self.passes += 1
        self.joined += len(entries) - 1
