"""The unit tests of what tests/e2e/test_run_metrics.py tests end to end (no server here)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from hosted_tinker.server.serving.run_metrics import FORWARD_BACKWARD, OPTIM_STEP, RunMetrics, merge_metrics

pytestmark = pytest.mark.fast


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


def test_merge_of_one_call_is_that_call_and_of_none_is_empty():
    one = {"loss:sum": 1.5, "x:mean": 0.25, "y:max": -2.0, "z:min": 3.0, "w": 4.0}
    assert merge_metrics([one]) == one
    assert merge_metrics([]) == {}
    assert merge_metrics([{"sum": 1.0}, {"sum": 2.0}]) == {"sum": 2.0}  # a name without ':' has no suffix


def test_merged_mean_averages_calls_that_have_it_only():
    assert merge_metrics([{"a:mean": 1.0}, {"b:sum": 1.0}, {"a:mean": 3.0}])["a:mean"] == 2.0


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


def test_an_optim_step_without_calls_is_a_step_and_runs_are_apart(runs: RunMetrics):
    runs.record("a", 1, OPTIM_STEP, 1.0, 0.1, 0, optim(1e-3, 1))
    runs.record("b", 1, FORWARD_BACKWARD, 2.0, 0.1, 3, {"loss:sum": 1.0})
    a, b = runs.steps("a"), runs.steps("b")
    assert a["steps"] == [
        {"step": 0, "time": 1.0, "duration_s": 0.1, "tokens": 0, "calls": 0, "metrics": {}, "optim": optim(1e-3, 1)}
    ]
    assert a["open_step"] is None and b["steps"] == [] and b["open_step"]["calls"] == 1
    assert runs.steps("nobody") == {"run_id": "nobody", "steps": [], "next_after": None, "open_step": None}


def test_a_second_record_of_a_call_changes_nothing(runs: RunMetrics):
    train(runs, "m", 1)
    runs.record("m", 2, OPTIM_STEP, 99.0, 9.0, 0, optim(5.0, 9))  # seq_id 2 was the optim_step
    runs.record("m", 1, FORWARD_BACKWARD, 99.0, 9.0, 99, {"loss:sum": 99.0})
    page = runs.steps("m")
    assert [s["step"] for s in page["steps"]] == [0] and page["open_step"] is None
    assert page["steps"][0]["optim"] == optim(1e-3, 1) and page["steps"][0]["tokens"] == 10


def test_steps_outlive_the_connection(tmp_path: Path):
    path = tmp_path / "db.sqlite"
    train(RunMetrics(path), "m", 2)
    again = RunMetrics(path)
    again.record("m", 5, OPTIM_STEP, 200.0, 0.1, 0, optim(1e-3, 3))
    assert [s["step"] for s in again.steps("m")["steps"]] == [0, 1, 2]


def test_bad_arguments_are_refused(runs: RunMetrics, tmp_path: Path):
    with pytest.raises(ValueError, match="kind"):
        runs.record("m", 1, "forward", 1.0, 0.1, 1, {})
    with pytest.raises(ValueError):
        runs.steps("m", after=-2)
    with pytest.raises(ValueError):
        runs.steps("m", limit=0)
    with pytest.raises(ValueError):
        RunMetrics(tmp_path / "other.sqlite", max_steps_per_run=0)


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


def test_pages_follow_next_after(runs: RunMetrics):
    train(runs, "m", 5)
    pages = [runs.steps("m", after=after, limit=2) for after in (-1, 1, 3, 4)]
    assert [[s["step"] for s in p["steps"]] for p in pages] == [[0, 1], [2, 3], [4], []]
    assert [p["next_after"] for p in pages] == [1, 3, None, None]
    exact = runs.steps("m", after=2, limit=2)  # the last two: nothing more
    assert [s["step"] for s in exact["steps"]] == [3, 4] and exact["next_after"] is None
    assert [s["step"] for s in runs.steps("m", after=-1, limit=5000)["steps"]] == [0, 1, 2, 3, 4]


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


def test_last_steps_name_each_run_s_newest_closed_step(runs: RunMetrics):
    train(runs, "a", 3)
    train(runs, "b", 1)
    runs.record("c", 1, FORWARD_BACKWARD, 1.0, 0.1, 4, {"loss:sum": 1.0})  # open only: no closed step
    assert runs.last_steps(["a", "b", "c", "missing"]) == {"a": 2, "b": 0}
    assert runs.last_steps([]) == {}


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


def test_non_finite_values_are_served_as_null(runs: RunMetrics):
    runs.record("m", 1, FORWARD_BACKWARD, 1.0, 0.1, 4, {"loss:sum": float("nan"), "ok:mean": 2.0})
    runs.record("m", 2, OPTIM_STEP, 2.0, 0.1, 0, {"grad_norm": float("inf"), "learning_rate": 1e-3})
    [step] = runs.steps("m")["steps"]
    assert step["metrics"] == {"loss:sum": None, "ok:mean": 2.0}
    assert step["optim"] == {"grad_norm": None, "learning_rate": 1e-3}
    assert runs.steps("m", with_open=False)["open_step"] is None
