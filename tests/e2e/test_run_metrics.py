"""Each run's per-step metrics through the front door: an SDK run read back over
``GET /api/v1/training_runs/{id}/metrics`` by its owner only, and a joint pass's calls recorded
in their own runs (the merge, steps, bounds and paging: ``tests/unit/server/test_run_metrics.py``)."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from tests.support.server import ALIAS, ServerProcess


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_sdk_run_reads_back_step_by_step_to_its_owner_only(keyed: tuple[ServerProcess, str, str]):
    import tinker
    from tinker import types

    server, key_a, key_b = keyed
    tokens = list(range(10, 22))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )
    rates = [1e-3, 2e-3, 5e-3]
    with tinker.ServiceClient(base_url=server.base_url, api_key=key_a) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        run_id = tc.get_info().model_id
        losses, grad_norms = [], []
        for lr in rates:
            losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            tc.forward([datum], "cross_entropy").result()  # forward-only: not part of a step
            grad_norms.append(tc.optim_step(types.AdamParams(learning_rate=lr)).result().metrics["grad_norm"])
        open_loss = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]

    url = f"{server.base_url}/api/v1/training_runs/{run_id}/metrics"
    with httpx.Client(headers={"X-API-Key": key_a}, timeout=30) as a:
        r = a.get(url)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["run_id"] == run_id and body["next_after"] is None
        steps = body["steps"]
        assert [s["step"] for s in steps] == [0, 1, 2]
        for step, loss, lr, grad_norm in zip(steps, losses, rates, grad_norms, strict=True):
            assert math.isclose(step["metrics"]["loss:sum"], loss, rel_tol=1e-6), (step, loss)
            assert step["optim"]["learning_rate"] == pytest.approx(lr, rel=1e-12)
            assert math.isclose(step["optim"]["grad_norm"], grad_norm, rel_tol=1e-6)
            assert step["tokens"] == len(tokens) and step["calls"] == 1
            assert step["duration_s"] > 0
        assert [s["optim"]["optimizer_step"] for s in steps] == [1.0, 2.0, 3.0]
        assert steps[0]["time"] < steps[1]["time"] < steps[2]["time"]
        open_step = body["open_step"]
        assert open_step["step"] == 3 and open_step["calls"] == 1 and "optim" not in open_step
        assert math.isclose(open_step["metrics"]["loss:sum"], open_loss, rel_tol=1e-6)

        first = a.get(url, params={"limit": 2}).json()
        assert [s["step"] for s in first["steps"]] == [0, 1] and first["next_after"] == 1
        rest = a.get(url, params={"after": first["next_after"], "limit": 2}).json()
        assert [s["step"] for s in rest["steps"]] == [2] and rest["next_after"] is None

        for params, field in [({"limit": 0}, "limit"), ({"limit": 5001}, "limit"), ({"after": -2}, "after")]:
            r = a.get(url, params=params)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", field], r.text
        missing = f"{server.base_url}/api/v1/training_runs/{run_id.rpartition(':')[0]}:99/metrics"
        assert a.get(missing).status_code == 404

    with httpx.Client(headers={"X-API-Key": key_b}, timeout=30) as b:
        r = b.get(url)
        assert r.status_code == 404 and run_id in r.json()["detail"]
    assert httpx.get(url, timeout=30).status_code == 401


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_requests_run_in_a_joint_pass_are_recorded_once_each_in_their_own_run(base_url: str):
    """Three models' forward_backward calls queue behind a long one and run in one joint pass
    (``serving.joint_passes``): each is a call of its own run's step, with its own loss."""
    import tinker
    from tinker import types

    from tests.support.metrics import moved, scrape
    from tests.support.training import datums

    tenants = 3
    with tinker.ServiceClient(base_url=base_url) as sc:
        clients = [sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=i).result() for i in range(tenants)]
        blocker = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        batches = [datums(seed, 2, 16 + 5 * seed) for seed in range(tenants)]
        before = scrape(base_url)
        busy = blocker.forward_backward(datums(7, 48, 400), "cross_entropy")  # holds the dispatch thread
        deadline = time.monotonic() + 30
        while scrape(base_url)[("hosted_tinker_in_flight", ())] < 1:
            assert time.monotonic() < deadline, "the blocker never reached the dispatch thread"
        futures = [tc.forward_backward(b, "cross_entropy") for tc, b in zip(clients, batches, strict=True)]
        losses = [f.result().metrics["loss:sum"] for f in futures]
        busy.result()
        assert moved(before, scrape(base_url), "hosted_tinker_joint_pass_joined_total") == tenants - 1
        for tc in (*clients, blocker):
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        with httpx.Client(base_url=base_url, headers={"X-API-Key": "tml-x"}, timeout=30) as c:
            for tc, batch, loss in zip(clients, batches, losses, strict=True):
                body = c.get(f"/api/v1/training_runs/{tc.get_info().model_id}/metrics").json()
                [step] = body["steps"]
                assert step["calls"] == 1 and body["open_step"] is None
                assert step["tokens"] == sum(d.model_input.length for d in batch)
                assert math.isclose(step["metrics"]["loss:sum"], loss, rel_tol=1e-6)
            blocked = c.get(f"/api/v1/training_runs/{blocker.get_info().model_id}/metrics").json()
            assert [s["calls"] for s in blocked["steps"]] == [1] and blocked["steps"][0]["tokens"] == 48 * 400
