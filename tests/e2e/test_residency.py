"""Parked models (``serving.residency``), end to end with the real SDK: a silent session's model,
the least recently used one past ``--max-resident-models``, and every model at SIGTERM are saved
whole and freed, and each comes back at its next request with exactly the losses it would have
had if it had never left (compared with the same run on the suite's shared server)."""

from __future__ import annotations

import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import tinker
from tinker import types

from tests.support.residency import datum, step
from tests.support.server import ALIAS, ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def reference(base_url: str, seed: int, steps: int) -> list[float]:
    """The same run, never interrupted, on the shared server."""
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=seed).result()
        return [step(tc, k) for k in range(steps)]


def health(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.base_url}/healthz", timeout=10).json()


def wait_for(srv: ServerProcess, ready: Callable[[dict], bool], what: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not ready(status := health(srv)):
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s: {status}"
        time.sleep(0.1)
    return status


@pytest.fixture(scope="module")
def parking(tmp_path_factory: pytest.TempPathFactory, shared_data_dir: Path):
    """Sessions count as silent after 2 s (the SDK heartbeats every 10 s); two models resident."""
    srv = start_server(tmp_path_factory.mktemp("residency"), "--session-timeout", "2", "--max-resident-models", "2")
    yield srv
    srv.stop()


def test_a_silent_sessions_model_is_parked_and_comes_back_exactly(parking, base_url):
    expected = reference(base_url, seed=11, steps=4)
    with tinker.ServiceClient(base_url=parking.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=11).result()
        losses = [step(tc, 0), step(tc, 1)]
        before = health(parking)["residency"]["parked_since_start"]
        status = wait_for(
            parking, lambda h: h["residency"]["parked_since_start"] > before, "parking the silent session's model"
        )
        assert status["active"]["parked_models"] >= 1
        restored = status["residency"]["restored_since_start"]
        losses += [step(tc, 2), step(tc, 3)]
        assert health(parking)["residency"]["restored_since_start"] > restored
    assert losses == expected


def test_past_the_budget_the_least_recently_used_is_parked_and_all_continue_exactly(parking, base_url):
    """Three tenants on a budget of two: each step of one parks another; every curve is exact."""
    seeds = (21, 22, 23)
    expected = {seed: reference(base_url, seed, steps=3) for seed in seeds}
    clients = [tinker.ServiceClient(base_url=parking.base_url) for _ in seeds]
    try:
        trainers = {
            seed: sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=seed).result()
            for seed, sc in zip(seeds, clients, strict=True)
        }
        losses: dict[int, list[float]] = {seed: [] for seed in seeds}
        for k in range(3):
            for seed, tc in trainers.items():
                losses[seed].append(step(tc, k))
                assert health(parking)["residency"]["resident"] <= 2
        assert losses == expected
        assert health(parking)["residency"]["parked_since_start"] >= 3
        # Unloading a parked model deletes its saved state.
        parked_dir = parking.data_dir / "parked"
        parked = [d.name for d in parked_dir.iterdir() if not d.name.startswith(".")]
        assert parked
        unloaded = httpx.post(f"{parking.base_url}/api/v1/unload_model", json={"model_id": parked[0]}, timeout=30)
        assert unloaded.status_code == 200, unloaded.text
        wait_for(parking, lambda _: not (parked_dir / parked[0]).exists(), "deleting an unloaded model's state")
    finally:
        for sc in clients:
            sc.__exit__(None, None, None)
    # Finishing the sessions unloads their models, parked ones too: nothing is left on disk.
    wait_for(parking, lambda h: h["active"]["parked_models"] == 0, "unloading the finished sessions' models")
    assert not [d for d in (parking.data_dir / "parked").iterdir() if not d.name.startswith(".")]


def test_a_stop_parks_every_model_and_a_kill_goes_back_to_the_last_save(tmp_path: Path, base_url: str):
    """An SDK client trains 3 steps; the server gets SIGTERM and is started again on the same
    data directory and port, and the same client goes on: exactly the uninterrupted curve. Then
    it saves, trains a step, and the server is SIGKILLed (no time to park): the model comes back
    from that save, its next request failing once to say so, and goes on as if the step after
    the save had never been taken (the documented loss)."""
    expected = reference(base_url, seed=31, steps=7)
    srv = start_server(tmp_path)
    port = urlsplit(srv.base_url).port
    try:
        sc = tinker.ServiceClient(base_url=srv.base_url)
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=31).result()
        model_id = tc.get_info().model_id
        losses = [step(tc, k) for k in range(3)]
        srv.stop(signal.SIGTERM)
        assert srv.proc.returncode == -signal.SIGTERM  # uvicorn ends as the signal asked, once shut down
        assert "shutdown: parked 1 models" in srv.log_path.read_text()
        srv = start_server(tmp_path, port=port)
        assert health(srv)["active"]["parked_models"] == 1
        losses += [step(tc, k) for k in range(3, 5)]
        assert tc.get_info().model_id == model_id
        assert health(srv)["residency"]["restored_since_start"] == 1

        path = tc.save_state("last").result().path
        step(tc, 5)  # learned after the save: lost with the kill
        srv.stop(signal.SIGKILL)
        srv = start_server(tmp_path, port=port)
        with pytest.raises(tinker.RequestFailedError, match=f"restored from {path} \\(optimizer step 5\\)"):
            tc.forward_backward([datum(5)], "cross_entropy").result()
        losses += [step(tc, 5), step(tc, 6)]
        sc.__exit__(None, None, None)
    finally:
        srv.stop()
    assert losses == expected


def test_a_model_parked_between_forward_backward_and_optim_step_keeps_its_gradients(tmp_path: Path, base_url: str):
    """Two models resident. One has run forward_backward twice and no optim_step when two others
    push it off the workers; when it comes back its step is the one it would have taken, and so
    is the rest of its curve."""
    adam = types.AdamParams(learning_rate=1e-2)

    def accumulate_and_step(tc: tinker.TrainingClient, between: Callable[[], None]) -> list[float]:
        tc.forward_backward([datum(0)], "cross_entropy").result()
        tc.forward_backward([datum(1)], "cross_entropy").result()
        between()
        norms = [tc.optim_step(adam).result().metrics["grad_norm"]]
        return norms + [step(tc, 2), step(tc, 3)]

    with tinker.ServiceClient(base_url=base_url) as sc:  # never parked
        expected = accumulate_and_step(
            sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=41).result(), lambda: None
        )
    srv = start_server(tmp_path, "--max-resident-models", "2")
    try:
        with tinker.ServiceClient(base_url=srv.base_url) as sc:
            held = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=41).result()

            def crowd_it_out() -> None:
                for seed in (42, 43):
                    step(sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=seed).result(), 0)
                assert health(srv)["residency"]["parked_since_start"] >= 1

            got = accumulate_and_step(held, crowd_it_out)
    finally:
        srv.stop()
    assert got == pytest.approx(expected, rel=1e-6)


def status_of(srv: ServerProcess, model_id: str) -> str:
    with sqlite3.connect(srv.data_dir / "hosted_tinker.sqlite") as db:
        return db.execute("SELECT status FROM models WHERE model_id=?", (model_id,)).fetchone()[0]


def test_past_the_budget_a_tenant_with_more_models_parks_its_own(tmp_path: Path, tiny_model_dir: Path):
    """A budget of two, two tenants: B's model is the least recently used, yet when A makes a
    second model, A's first is parked, not B's (a global LRU would let one key with many models
    push every other tenant off the workers)."""
    srv = start_server(tmp_path, "--model", str(tiny_model_dir), "--dev-any-key", "--max-resident-models", "2")
    clients = {t: tinker.ServiceClient(base_url=srv.base_url, api_key=f"tml-tenant-{t}") for t in "ab"}
    try:
        b = clients["b"].create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
        step(b, 0)
        a1 = clients["a"].create_lora_training_client(base_model=ALIAS, rank=4, seed=2).result()
        step(a1, 0)
        a2 = clients["a"].create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
        step(a2, 0)
        assert status_of(srv, a1.get_info().model_id) == "parked"
        assert status_of(srv, b.get_info().model_id) == "active"
        step(b, 1)  # still resident: nothing restored for B
        assert health(srv)["residency"] == {
            "resident": 2,
            "max_resident": 2,
            "parked_since_start": 1,
            "restored_since_start": 0,
        }
    finally:
        for sc in clients.values():
            sc.__exit__(None, None, None)
        srv.stop()
