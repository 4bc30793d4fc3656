"""What follows a checkpoint's making, change or deletion, said once by the service that did it
and heard by every part that takes note: the usage ledger and the metrics count a save, the
audit log records who did what, the checkpoint mirror copies it up, vLLM loads a sampler's
adapter (or a sampler's snapshot) before it is asked for. Each part subscribes at start-up (``api.state``); a service
holds the one ``CheckpointEvents`` and never asks which parts are there.

A subscriber runs on the thread that made the event (the worker's, for a save), after the
checkpoint is whole and recorded; one that fails is logged and the others still hear it: what it
would note has happened, and the request that made it succeeded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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


class Topic(Generic[E]):
    """The subscribers of one kind of event, told in the order they subscribed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._subscribers: list[Callable[[E], None]] = []

    def subscribe(self, subscriber: Callable[[E], None]) -> None:
        self._subscribers.append(subscriber)

    def __call__(self, event: E) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(event)
            except Exception:
                log.exception("a subscriber to %s failed on %s", self.name, event)


class CheckpointEvents:
    def __init__(self) -> None:
        self.made: Topic[Made] = Topic("checkpoint made")
        self.changed: Topic[Changed] = Topic("checkpoint changed")
        self.deleted: Topic[Deleted] = Topic("checkpoint deleted")
        # a sampler's snapshot (save_weights_and_get_sampling_client): weights, not a checkpoint
        self.snapshot: Topic[WeightsRef] = Topic("sampler snapshot made")
