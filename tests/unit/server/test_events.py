"""``serving.events``: every subscriber hears each event, in order, whatever another one does
(unless its failure is the publisher's); ``serving.subscribers``: what follows a training call
or a change of a run's weights, failing as it did inline."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from hosted_tinker.core.checkpoints import TinkerPath
from hosted_tinker.core.errors import WorkerDied
from hosted_tinker.server.metrics import ServerMetrics
from hosted_tinker.server.serving.events import CheckpointEvents, Deleted, Trained, TrainingEvents
from hosted_tinker.server.serving.subscribers import training_events

pytestmark = pytest.mark.fast


def test_a_failing_subscriber_is_logged_and_the_others_still_hear(caplog: pytest.LogCaptureFixture) -> None:
    events, heard = CheckpointEvents(), []
    event = Deleted(TinkerPath("run", "weights", "x"), actor="key-a")

    def broken(_: Deleted) -> None:
        raise RuntimeError("mirror queue gone")

    events.deleted.subscribe(lambda e: heard.append(("first", e)))
    events.deleted.subscribe(broken)
    events.deleted.subscribe(lambda e: heard.append(("last", e)))
    with caplog.at_level(logging.ERROR):
        events.deleted(event)  # the deletion happened: nothing is raised to the request that made it
    assert heard == [("first", event), ("last", event)]
    assert "a subscriber to checkpoint deleted failed" in caplog.text
    events.made(object())  # a topic nobody subscribed to: nothing happens


def test_a_failure_the_subscriber_names_is_the_publishers() -> None:
    """``fails_publisher``: what failed inline before it was a subscriber still fails the request
    (the subscribers after it are not told); any other failure of it is only logged."""
    events, heard = TrainingEvents(), []

    def sync(model_id: str) -> None:
        if model_id == "dead":
            raise WorkerDied("rank 0 exited")
        raise RuntimeError("vLLM's queue is closed")

    events.weights_changed.subscribe(sync, fails_publisher=(WorkerDied,))
    events.weights_changed.subscribe(heard.append)
    with pytest.raises(WorkerDied):
        events.weights_changed("dead")
    assert heard == []
    events.weights_changed("alive")  # logged, and the next subscriber still hears it
    assert heard == ["alive"]


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def __call__(self, *args: object) -> None:
        if self.fail:
            raise RuntimeError("database is locked")
        self.calls.append(args)


def training(usage: Recorder, run_metrics: Recorder, vllm: object | None = None) -> TrainingEvents:
    ledger, recorded = SimpleNamespace(trained=usage), SimpleNamespace(record=run_metrics)
    return training_events(SimpleNamespace(), ServerMetrics(), ledger, recorded, vllm)


def test_a_training_call_is_counted_and_recorded_as_it_was_inline(caplog: pytest.LogCaptureFixture) -> None:
    usage, run_metrics = Recorder(), Recorder()
    events = training(usage, run_metrics)
    events.trained(Trained("m", 1, "forward", 0.5, 10, {"loss:sum": 1.0}))  # a forward-only pass: not a step's
    events.trained(Trained("m", 2, "forward_backward", 0.5, 10, {"loss:sum": 1.0}))
    events.trained(Trained("m", 3, "optim_step", 0.1, 0, {}))  # trains no tokens
    assert usage.calls == [("m", 10), ("m", 10)]
    assert [(c[1], c[2]) for c in run_metrics.calls] == [(2, "forward_backward"), (3, "optim_step")]
    events.weights_changed("m")  # without vLLM nobody hears these: nothing happens
    events.gone("m")

    events = training(Recorder(), Recorder(fail=True))  # the run's metrics: logged, the call succeeds
    with caplog.at_level(logging.ERROR):
        events.trained(Trained("m", 4, "optim_step", 0.1, 0, {}))
    assert "a subscriber to training call failed" in caplog.text
    events = training(Recorder(fail=True), Recorder())  # the usage ledger was inline: the call fails
    with pytest.raises(RuntimeError, match="database is locked"):
        events.trained(Trained("m", 5, "forward_backward", 0.1, 3, {}))


def test_a_runs_adapter_goes_to_vllm_after_each_change_unless_its_worker_died() -> None:
    published, dropped = [], []
    live = SimpleNamespace(publish=lambda *args: published.append(args), drop=dropped.append)
    trainer = SimpleNamespace(snapshot_weights=lambda model_id: (3, {"w": 1}), peft_config=lambda model_id: {"r": 4})
    backend = SimpleNamespace(trainer=trainer)  # ProcessBackend's calls to the ranks' Trainer
    events = training_events(backend, ServerMetrics(), SimpleNamespace(), SimpleNamespace(), SimpleNamespace(live=live))
    events.weights_changed("m")
    events.gone("m")
    assert published == [("m", 3, {"r": 4}, {"w": 1})] and dropped == ["m"]

    def died(model_id: str) -> tuple:
        raise WorkerDied("rank 0 exited")

    trainer.snapshot_weights = died
    with pytest.raises(WorkerDied):  # the weights are gone with the worker: the step fails
        events.weights_changed("m")
