"""Each run's per-step metrics (``serving.run_metrics``) and ``GET /api/v1/training_runs/{id}/metrics``:
the merge of a step's calls by metric suffix, which step a call belongs to, the bound per run and
paging on a SQLite file; then an SDK run on a keyed server, read back over HTTP by its owner only."""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from hosted_tinker.server.serving.run_metrics import FORWARD_BACKWARD, OPTIM_STEP, RunMetrics, merge_metrics
from tests.support.server import ALIAS, start_server
from tests.support.tenants import cli

fast = pytest.mark.fast


def optim(lr: float, step: int) -> dict[str, float]:
    return {"grad_norm": 0.5, "learning_rate": lr, "optimizer_step": float(step)}


@pytest.fixture
def runs(tmp_path: Path) -> RunMetrics:
    return RunMetrics(tmp_path / "db.sqlite")


def train(runs: RunMetrics, model_id: str, steps: int, first_seq: int = 1) -> int:
    """``steps`` steps of one forward_backward and one optim_step each; the next seq_id."""
    seq = first_seq
    for i in range(steps):
        runs.record(model_id, seq, FORWARD_BACKWARD, 100.0 + i, 0.25, 10, {"loss:sum": float(i)})
        runs.record(model_id, seq + 1, OPTIM_STEP, 100.5 + i, 0.125, 0, optim(1e-3, i + 1))
        seq += 2
    return seq


# ---- merging a step's calls -----------------------------------------------------------------


@fast
def test_merge_follows_each_suffix_rule():
    calls = [
        {"loss:sum": 1.0, "gap:mean": 2.0, "gap:max": 1.0, "gap:min": 5.0, "tag": 1.0, "custom/a:b:sum": 1.0},
        {"loss:sum": 2.5, "gap:mean": 4.0, "gap:max": 3.0, "gap:min": 2.0, "tag": 7.0, "custom/a:b:sum": 2.0},
        {"gap:mean": 9.0, "gap:max": -1.0, "gap:min": 4.0, "late:sum": 3.0, "ratio:p50": 0.5},
    ]
    assert merge_metrics(calls) == {
        "loss:sum": 3.5,  # added
        "gap:mean": 5.0,  # (2 + 4 + 9) / 3, unweighted over the calls that have it
        "gap:max": 3.0,
        "gap:min": 2.0,
        "tag": 7.0,  # no suffix: the last call's
        "custom/a:b:sum": 3.0,  # the suffix after the last ':'
        "late:sum": 3.0,  # only in the last call
        "ratio:p50": 0.5,  # an unknown reduction: the last call's
    }


@fast
def test_merge_of_one_call_is_that_call_and_of_none_is_empty():
    one = {"loss:sum": 1.5, "x:mean": 0.25, "y:max": -2.0, "z:min": 3.0, "w": 4.0}
    assert merge_metrics([one]) == one
    assert merge_metrics([]) == {}
    assert merge_metrics([{"sum": 1.0}, {"sum": 2.0}]) == {"sum": 2.0}  # a name without ':' has no suffix


@fast
def test_merged_mean_averages_calls_that_have_it_only():
    assert merge_metrics([{"a:mean": 1.0}, {"b:sum": 1.0}, {"a:mean": 3.0}])["a:mean"] == 2.0


# ---- steps ----------------------------------------------------------------------------------


@fast
def test_forward_backward_calls_belong_to_the_step_their_optim_step_closes(runs: RunMetrics):
    runs.record("m", 1, FORWARD_BACKWARD, 10.0, 0.5, 7, {"loss:sum": 2.0, "gap:mean": 1.0})
    runs.record("m", 2, FORWARD_BACKWARD, 11.0, 0.25, 5, {"loss:sum": 3.0, "gap:mean": 3.0})
    runs.record("m", 3, OPTIM_STEP, 12.0, 0.125, 0, optim(1e-3, 1))
    runs.record("m", 4, FORWARD_BACKWARD, 13.0, 1.0, 4, {"loss:sum": 1.5})
    page = runs.steps("m")
    assert page["run_id"] == "m" and page["next_after"] is None
    assert page["steps"] == [
        {
            "step": 0,
            "time": 12.0,
            "duration_s": 0.875,
            "tokens": 12,
            "calls": 2,
            "metrics": {"loss:sum": 5.0, "gap:mean": 2.0},
            "optim": optim(1e-3, 1),
        }
    ]
    assert page["open_step"] == {
        "step": 1,
        "time": 13.0,
        "duration_s": 1.0,
        "tokens": 4,
        "calls": 1,
        "metrics": {"loss:sum": 1.5},
    }
    runs.record("m", 5, OPTIM_STEP, 14.0, 0.5, 0, optim(2e-3, 2))
    page = runs.steps("m")
    assert [s["step"] for s in page["steps"]] == [0, 1] and page["open_step"] is None
    assert page["steps"][1]["optim"]["learning_rate"] == 2e-3 and page["steps"][1]["duration_s"] == 1.5


@fast
def test_an_optim_step_without_calls_is_a_step_and_runs_are_apart(runs: RunMetrics):
    runs.record("a", 1, OPTIM_STEP, 1.0, 0.1, 0, optim(1e-3, 1))
    runs.record("b", 1, FORWARD_BACKWARD, 2.0, 0.1, 3, {"loss:sum": 1.0})
    a, b = runs.steps("a"), runs.steps("b")
    assert a["steps"] == [
        {"step": 0, "time": 1.0, "duration_s": 0.1, "tokens": 0, "calls": 0, "metrics": {}, "optim": optim(1e-3, 1)}
    ]
    assert a["open_step"] is None and b["steps"] == [] and b["open_step"]["calls"] == 1
    assert runs.steps("nobody") == {"run_id": "nobody", "steps": [], "next_after": None, "open_step": None}


@fast
def test_a_second_record_of_a_call_changes_nothing(runs: RunMetrics):
    train(runs, "m", 1)
    runs.record("m", 2, OPTIM_STEP, 99.0, 9.0, 0, optim(5.0, 9))  # seq_id 2 was the optim_step
    runs.record("m", 1, FORWARD_BACKWARD, 99.0, 9.0, 99, {"loss:sum": 99.0})
    page = runs.steps("m")
    assert [s["step"] for s in page["steps"]] == [0] and page["open_step"] is None
    assert page["steps"][0]["optim"] == optim(1e-3, 1) and page["steps"][0]["tokens"] == 10


@fast
def test_steps_outlive_the_connection(tmp_path: Path):
    path = tmp_path / "db.sqlite"
    train(RunMetrics(path), "m", 2)
    again = RunMetrics(path)
    again.record("m", 5, OPTIM_STEP, 200.0, 0.1, 0, optim(1e-3, 3))
    assert [s["step"] for s in again.steps("m")["steps"]] == [0, 1, 2]


@fast
def test_bad_arguments_are_refused(runs: RunMetrics, tmp_path: Path):
    with pytest.raises(ValueError, match="kind"):
        runs.record("m", 1, "forward", 1.0, 0.1, 1, {})
    with pytest.raises(ValueError):
        runs.steps("m", after=-2)
    with pytest.raises(ValueError):
        runs.steps("m", limit=0)
    with pytest.raises(ValueError):
        RunMetrics(tmp_path / "other.sqlite", max_steps_per_run=0)


# ---- bounds and paging ----------------------------------------------------------------------


@fast
def test_a_run_keeps_its_newest_steps(tmp_path: Path):
    runs = RunMetrics(tmp_path / "db.sqlite", max_steps_per_run=3)
    seq = train(runs, "m", 5)
    train(runs, "other", 2)
    runs.record("m", seq, FORWARD_BACKWARD, 500.0, 0.1, 1, {"loss:sum": 1.0})  # the open step stays too
    page = runs.steps("m")
    assert [s["step"] for s in page["steps"]] == [2, 3, 4]
    assert [s["metrics"]["loss:sum"] for s in page["steps"]] == [2.0, 3.0, 4.0]
    assert page["open_step"]["step"] == 5
    db = sqlite3.connect(tmp_path / "db.sqlite")
    try:  # the older steps' rows are gone, not only hidden
        assert db.execute("SELECT MIN(step), COUNT(*) FROM run_metrics WHERE model_id='m'").fetchone() == (2, 7)
    finally:
        db.close()
    assert [s["step"] for s in runs.steps("other")["steps"]] == [0, 1]


@fast
def test_pages_follow_next_after(runs: RunMetrics):
    train(runs, "m", 5)
    pages = [runs.steps("m", after=after, limit=2) for after in (-1, 1, 3, 4)]
    assert [[s["step"] for s in p["steps"]] for p in pages] == [[0, 1], [2, 3], [4], []]
    assert [p["next_after"] for p in pages] == [1, 3, None, None]
    exact = runs.steps("m", after=2, limit=2)  # the last two: nothing more
    assert [s["step"] for s in exact["steps"]] == [3, 4] and exact["next_after"] is None
    assert [s["step"] for s in runs.steps("m", after=-1, limit=5000)["steps"]] == [0, 1, 2, 3, 4]


@fast
def test_an_open_step_keeps_its_newest_calls(runs: RunMetrics, monkeypatch):
    from hosted_tinker.server.serving import run_metrics

    monkeypatch.setattr(run_metrics, "MAX_OPEN_CALLS", 5)
    monkeypatch.setattr(run_metrics, "OPEN_CHECK_EVERY", 4)
    for seq in range(1, 13):  # twelve forward_backward calls, never an optim_step
        runs.record("m", seq, FORWARD_BACKWARD, float(seq), 0.1, 1, {"loss:sum": 1.0})
    # checked at seq 4, 8 and 12: after the last, its newest five remain
    assert runs.steps("m")["open_step"]["calls"] == 5
    runs.record("m", 13, OPTIM_STEP, 13.0, 0.1, 0, optim(1e-3, 1))
    [step] = runs.steps("m")["steps"]
    assert step["calls"] == 5 and step["metrics"]["loss:sum"] == 5.0


@fast
def test_last_steps_name_each_run_s_newest_closed_step(runs: RunMetrics):
    train(runs, "a", 3)
    train(runs, "b", 1)
    runs.record("c", 1, FORWARD_BACKWARD, 1.0, 0.1, 4, {"loss:sum": 1.0})  # open only: no closed step
    assert runs.last_steps(["a", "b", "c", "missing"]) == {"a": 2, "b": 0}
    assert runs.last_steps([]) == {}


@fast
def test_reads_while_another_thread_records(runs: RunMetrics):
    def writer() -> None:
        train(runs, "m", 200)

    thread = threading.Thread(target=writer)
    thread.start()
    while thread.is_alive():
        steps = runs.steps("m", limit=5000)["steps"]
        assert [s["step"] for s in steps] == list(range(len(steps)))
        assert all(s["calls"] == 1 for s in steps)
    thread.join()
    assert len(runs.steps("m", limit=5000)["steps"]) == 200


# ---- through the SDK, on a keyed server -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_sdk_run_reads_back_step_by_step_to_its_owner_only(tmp_path: Path, tiny_model_dir: Path):
    import tinker
    from tinker import types

    key_a = cli("keys", "create", "--data-dir", str(tmp_path), "--name", "alice")
    key_b = cli("keys", "create", "--data-dir", str(tmp_path), "--name", "bob")
    server = start_server(tmp_path, "--model", str(tiny_model_dir))
    tokens = list(range(10, 22))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )
    rates = [1e-3, 2e-3, 5e-3]
    try:
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
    finally:
        server.stop()


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


@fast
def test_non_finite_values_are_served_as_null(runs: RunMetrics):
    runs.record("m", 1, FORWARD_BACKWARD, 1.0, 0.1, 4, {"loss:sum": float("nan"), "ok:mean": 2.0})
    runs.record("m", 2, OPTIM_STEP, 2.0, 0.1, 0, {"grad_norm": float("inf"), "learning_rate": 1e-3})
    [step] = runs.steps("m")["steps"]
    assert step["metrics"] == {"loss:sum": None, "ok:mean": 2.0}
    assert step["optim"] == {"grad_norm": None, "learning_rate": 1e-3}
    assert runs.steps("m", with_open=False)["open_step"] is None
