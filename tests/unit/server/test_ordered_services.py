"""The services' rules for a model's ordered requests. A key's limits are checked by the services,
not the routes: a save over the key's checkpoint bytes is refused inside the training service's
ordered submission, so it still uses up its seq_id (the model's later requests do not wait for
it), and holds no bytes afterwards. A request reads its model's record once, and what checks it
is given that record. (Through the SDK and raw HTTP: tests/e2e/test_quotas.py and
test_ordered_routes.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hosted_tinker.core.checkpoints import CheckpointFiles
from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.persistence.records import FutureRecord
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.quotas import Limits, Quotas
from hosted_tinker.server.scheduler import Scheduler
from hosted_tinker.server.serving.checkpoints import CheckpointService
from hosted_tinker.server.serving.sessions import SessionService
from hosted_tinker.server.serving.tenancy import Tenancy
from hosted_tinker.server.serving.training import TrainingService

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]

OWNER, SESSION = "key-a", "sess-a"
MODEL = f"{SESSION}:train:0"


@pytest.fixture
def services(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A training and a checkpoint service over a real store and scheduler, for a key that may
    store no checkpoint bytes at all; no worker (nothing here reaches one)."""
    store = Store(tmp_path / "db.sqlite")
    scheduler = Scheduler(store)
    quotas = Quotas(store, Limits(checkpoint_bytes=0, sessions=1), max_lora_rank=64)
    trainer = SimpleNamespace(optim_step=lambda model_id, params: {"grad_norm": 1.0})
    backend = SimpleNamespace(capabilities=None, trainer=trainer)  # ProcessBackend: the ranks' Trainer calls
    training = TrainingService(
        backend,
        scheduler,
        store,
        ["tiny"],
        "tiny",
        sequences=None,
        custom_losses=None,
        residency=SimpleNamespace(around=lambda model_id, job: job),
        joint=None,
        quotas=quotas,
        images=SimpleNamespace(),
    )
    files = CheckpointFiles(tmp_path / "checkpoints")
    checkpoints = CheckpointService(training, files, files, links=None, tenancy=Tenancy(store))
    store.add_session(
        SESSION, owner=OWNER, tags=[], user_metadata={}, project_id=None, display_name=None, sdk_version=None
    )
    lora = {"rank": 4, "optimizer": "adamw"}
    store.add_model(MODEL, session_id=SESSION, model_seq_id=0, base_model="tiny", lora=lora, user_metadata={})
    scheduler.open_model(MODEL)
    yield SimpleNamespace(store=store, scheduler=scheduler, quotas=quotas, training=training, checkpoints=checkpoints)
    scheduler.shutdown()


def finished(store: Store, request_id: str) -> FutureRecord:
    deadline = time.monotonic() + 10
    while (record := store.get_future(request_id)) is None or not record.finished:
        assert time.monotonic() < deadline, f"{request_id} did not finish"
        time.sleep(0.01)
    return record


def test_a_save_over_the_keys_checkpoint_bytes_uses_up_its_seq_id(services: SimpleNamespace) -> None:
    save = wire.SaveWeightsRequest(model_id=MODEL, seq_id=1, path="step-1")
    with pytest.raises(ApiError) as refused:
        services.checkpoints.save_weights(save, OWNER)
    assert refused.value.status == 403 and refused.value.code == "quota_exceeded"
    assert "limit checkpoint_bytes reached" in refused.value.detail

    request_id = services.scheduler.find(MODEL, 1)  # the refusal is seq_id 1's failed future
    assert request_id is not None
    record = finished(services.store, request_id)
    assert record.status == "failed" and "limit checkpoint_bytes reached" in record.error
    assert services.scheduler.next_seq(MODEL) == 2  # the model's next request does not wait for it
    assert services.checkpoints.save_weights(save, OWNER) == request_id  # a resend: the same future
    assert services.quotas._reserved == {}  # nothing is left held


def test_a_refusal_before_the_reservation_keeps_its_own_answer(services: SimpleNamespace) -> None:
    """A seq_id out of range is refused before anything is reserved or used up, as before."""
    with pytest.raises(ApiError) as refused:
        services.checkpoints.save_weights(wire.SaveWeightsRequest(model_id=MODEL, seq_id=0, path="x"), OWNER)
    assert refused.value.status == 400 and "seq_id must be between" in refused.value.detail
    assert services.scheduler.find(MODEL, 0) is None and services.quotas._reserved == {}


def test_a_session_over_the_keys_limit_is_refused_by_the_session_service(services: SimpleNamespace) -> None:
    sessions = SessionService(services.store, services.training, services.quotas)
    request = wire.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38")
    with pytest.raises(ApiError) as refused:  # the fixture's session is the key's one live session
        sessions.create(request, OWNER)
    assert refused.value.status == 403 and "limit sessions reached" in refused.value.detail


def test_an_ordered_request_reads_its_models_record_once(
    services: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``submit_ordered`` reads the live record and hands it to the request's checks and job: an
    optim_step, a save and a refused request each read it once (a parked model's job reads it
    again as it runs, ``Residency.bring_back``: it may have been parked since; not faked here)."""
    reads = []
    get_model = services.store.get_model
    monkeypatch.setattr(services.store, "get_model", lambda model_id: reads.append(model_id) or get_model(model_id))
    request_id = services.training.optim_step(wire.OptimStepRequest(model_id=MODEL, seq_id=1))
    assert finished(services.store, request_id).status == "done"
    assert reads == [MODEL]
    reads.clear()
    with pytest.raises(ApiError):  # over the key's bytes: refused in its prepare, which gets the record
        services.checkpoints.save_weights(wire.SaveWeightsRequest(model_id=MODEL, seq_id=2, path="x"), OWNER)
    assert reads == [MODEL]


def test_a_save_that_cannot_be_queued_lets_go_of_its_reservation(
    services: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its checks passed and its bytes were reserved, but the scheduler refused the job: nothing
    will ever settle or release what it holds, so the submission lets go of it."""
    monkeypatch.setattr(services.quotas, "of", lambda tenant: Limits(checkpoint_bytes=1000))
    monkeypatch.setattr(services.checkpoints, "likely_size", lambda model_id, kind: 100)

    def refuse(*args, **kwargs):
        raise RuntimeError("the scheduler is shutting down")

    monkeypatch.setattr(services.scheduler, "submit", refuse)
    with pytest.raises(RuntimeError, match="shutting down"):
        services.checkpoints.save_weights(wire.SaveWeightsRequest(model_id=MODEL, seq_id=1, path="x"), OWNER)
    assert not any(services.quotas._reserved.values())
