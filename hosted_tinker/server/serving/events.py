"""What follows a checkpoint's making, change or deletion, or a training call, said once by the
service that did it and heard by every part that takes note: the usage ledger and the metrics
count a save or a pass's tokens, the audit log records who did what, the checkpoint mirror copies
a checkpoint up, vLLM loads a sampler's adapter (or a sampler's snapshot) before it is asked for
and syncs a run's adapter when its weights change, the run's metrics record each step. Each part
subscribes at start-up (``serving.subscribers``); a service holds the one ``CheckpointEvents``
or ``TrainingEvents`` and never asks which parts are there (a part that is off has no subscriber).

A subscriber runs on the thread that made the event (the worker's, for a save or a step), after
what it notes is done; one that fails is logged and the others still hear it: what it would note
has happened, and the request that made it succeeded. Only the failures a subscriber names when
it subscribes (``fails_publisher``) reach the request instead: what it did inline before it was
a subscriber (a worker that died while vLLM's copy of the weights was taken fails the step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from hosted_tinker.core.checkpoints import CheckpointFiles, TinkerPath
from hosted_tinker.inference.engine import WeightsRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Made:
    """A checkpoint is written and recorded: saved from a training model, copied or uploaded."""

    path: TinkerPath
    owner: str  # the key whose checkpoint it is (and who made it)
    size: int
    files: CheckpointFiles  # where it is
    how: str = "save"  # "save", "copy" (copy_weights), "upload" (an adapter brought from elsewhere)
    details: dict[str, object] = field(default_factory=dict)  # what the audit entry adds


@dataclass(frozen=True)
class Changed:
    """A checkpoint's row changed: published, unpublished (``event``), or a new TTL (no event)."""

    path: TinkerPath
    actor: str | None
    event: str | None = None


@dataclass(frozen=True)
class Deleted:
    """A checkpoint is gone, deleted by ``actor`` or (``reason``) its TTL."""

    path: TinkerPath
    actor: str | None
    reason: str | None = None


E = TypeVar("E")


Failures = tuple[type[BaseException], ...]


class Topic(Generic[E]):
    """The subscribers of one kind of event, told in the order they subscribed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._subscribers: list[tuple[Callable[[E], None], Failures]] = []

    def subscribe(self, subscriber: Callable[[E], None], *, fails_publisher: Failures = ()) -> None:
        """``fails_publisher``: the failures of ``subscriber`` that are the publisher's own (raised
        to it, and the later subscribers not told); any other is logged."""
        self._subscribers.append((subscriber, fails_publisher))

    def __call__(self, event: E) -> None:
        for subscriber, fatal in self._subscribers:
            try:
                subscriber(event)
            except fatal:
                raise
            except Exception:
                log.exception("a subscriber to %s failed on %s", self.name, event)


class CheckpointEvents:
    def __init__(self) -> None:
        self.made: Topic[Made] = Topic("checkpoint made")
        self.changed: Topic[Changed] = Topic("checkpoint changed")
        self.deleted: Topic[Deleted] = Topic("checkpoint deleted")
        # a sampler's snapshot (save_weights_and_get_sampling_client): weights, not a checkpoint
        self.snapshot: Topic[WeightsRef] = Topic("sampler snapshot made")


@dataclass(frozen=True)
class Trained:
    """A training call's job succeeded, its result about to reach its client."""

    model_id: str
    seq_id: int
    kind: str  # "forward", "forward_backward" (a pass of ``tokens``) or "optim_step"
    duration_s: float  # its share of the pass it ran in, or its step's
    tokens: int
    metrics: Mapping[str, float]


class TrainingEvents:
    def __init__(self) -> None:
        # on the worker's thread, once a job set a model's weights (created, loaded, stepped, restored)
        self.weights_changed: Topic[str] = Topic("weights changed")
        self.trained: Topic[Trained] = Topic("training call")
        self.gone: Topic[str] = Topic("model gone")  # unloaded, or lost with its worker
