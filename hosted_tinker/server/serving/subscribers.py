"""Who hears what the services say (``serving.events``), subscribed once at start-up: a part that
is off (no vLLM, no mirror) subscribes nothing, so the services that publish never ask. The order
of subscription is the order of effects. Each subscriber fails as it did when it was inline in
the service: the metrics, the usage ledger and vLLM's retiring of an adapter fail the request
(``fails_publisher``); the rest are logged."""

from __future__ import annotations

import time

from hosted_tinker.core.calls import on_rank_0
from hosted_tinker.core.errors import RolledBack, WorkerCrashed, WorkerDied
from hosted_tinker.inference.engine import WeightsRef
from hosted_tinker.inference.vllm_engine import VllmEngine
from hosted_tinker.server.metrics import ServerMetrics
from hosted_tinker.server.mirror import CheckpointMirror
from hosted_tinker.server.serving.audit import AuditLog
from hosted_tinker.server.serving.events import Changed, CheckpointEvents, Deleted, Made, Trained, TrainingEvents
from hosted_tinker.server.serving.run_metrics import KINDS, RunMetrics
from hosted_tinker.server.serving.usage import UsageLedger
from hosted_tinker.server.workers.backend import ProcessBackend

PASSES = ("forward", "forward_backward")  # the calls that train (or score) tokens
INLINE = (Exception,)  # a subscriber that was inline, without a handler: its failure is the request's
# The weights are gone with the worker: the step that changed them fails (vLLM keeps the previous
# version on any other failure, and the step itself succeeded).
WORKER_GONE = (WorkerCrashed, RolledBack, WorkerDied)


def checkpoint_events(
    metrics: ServerMetrics,
    usage: UsageLedger,
    audit: AuditLog,
    mirror: CheckpointMirror | None,
    vllm: VllmEngine | None,
) -> CheckpointEvents:
    """Who hears of a checkpoint made, changed or deleted."""
    events = CheckpointEvents()

    def made(e: Made) -> None:
        if e.how == "save":  # a training model's save (copies and uploads are not saves)
            metrics.checkpoint_bytes.labels(e.path.kind).inc(e.size)
            usage.checkpoint_saved(e.path.run_id)
        audit.record(
            e.owner, "checkpoint_create", e.owner, model_id=e.path.run_id, tinker_path=str(e.path), **e.details
        )

    def changed(e: Changed) -> None:
        if e.event is not None:
            audit.checkpoint(e.event, e.path, e.actor)

    def deleted(e: Deleted) -> None:
        audit.checkpoint("checkpoint_delete", e.path, e.actor, **({"reason": e.reason} if e.reason else {}))

    events.made.subscribe(made)  # the record is written before the mirror copies it up
    events.changed.subscribe(changed)
    events.deleted.subscribe(deleted)
    if mirror is not None:
        mirror.subscribe(events)
    if vllm is not None:  # a sampler's adapter loaded before it is asked for
        prefetch = vllm.prefetch_threadsafe

        def sampler_made(e: Made) -> None:
            if e.how == "save" and e.path.kind == "sampler_weights":  # a copy is not loaded ahead
                prefetch(WeightsRef(str(e.path), e.files, e.path))

        events.made.subscribe(sampler_made)
        events.snapshot.subscribe(prefetch)
    return events


def training_events(
    backend: ProcessBackend,
    metrics: ServerMetrics,
    usage: UsageLedger,
    run_metrics: RunMetrics,
    vllm: VllmEngine | None,
) -> TrainingEvents:
    """Who hears of a training call and of a model's weights changing or going."""
    events = TrainingEvents()

    def counted(e: Trained) -> None:
        if e.kind in PASSES:
            metrics.tokens_trained.labels(e.kind).inc(e.tokens)
            usage.trained(e.model_id, e.tokens)

    def recorded(e: Trained) -> None:  # the run's metrics (a forward-only call is not part of a step)
        if e.kind in KINDS:
            run_metrics.record(e.model_id, e.seq_id, e.kind, time.time(), e.duration_s, e.tokens, e.metrics)

    events.trained.subscribe(counted, fails_publisher=INLINE)
    events.trained.subscribe(recorded)  # the result is the client's whether or not it is recorded
    if vllm is not None:  # each run's adapter synced to vLLM after every change
        live = vllm.live

        def sync(model_id: str) -> None:
            step, weights = on_rank_0(backend.trainer.snapshot_weights(model_id))
            live.publish(model_id, step, backend.trainer.peft_config(model_id), weights)

        events.weights_changed.subscribe(sync, fails_publisher=WORKER_GONE)
        events.gone.subscribe(live.drop, fails_publisher=INLINE)
    return events
