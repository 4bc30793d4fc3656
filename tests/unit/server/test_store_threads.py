"""The store's one connection, shared by the event loop and the dispatch thread, beside the
other connections to the same file (``run_metrics``, ``sequences``): a finished result is always
written. A statement whose rows were read outside the store's lock held a read snapshot open, and
the next write after another connection's commit failed at once with "database is locked"
(SQLITE_BUSY_SNAPSHOT), leaving the future pending forever; 1,000 models found it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.serving.run_metrics import FORWARD_BACKWARD, RunMetrics

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]


def test_writes_never_fail_while_reads_and_another_connection_s_commits_interleave(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    metrics = RunMetrics(store.path)
    n = 600
    for i in range(n):
        store.add_future(f"r{i}", kind="forward_backward", model_id=f"m{i % 50}", seq_id=i)
    failures: list[BaseException] = []
    stop = threading.Event()

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # any failure is the test's
                failures.append(e)
                stop.set()

        return run

    def read() -> None:  # the event loop: polls and lookups
        while not stop.is_set():
            for i in range(0, n, 7):
                store.get_future(f"r{i}")
                store.find_future(f"m{i % 50}", i)

    def other_connection() -> None:  # the dispatch thread's metrics, on their own connection
        for i in range(n):
            metrics.record(f"m{i % 50}", i, FORWARD_BACKWARD, time.time(), 0.0, 1, {"loss:sum": 1.0})

    def complete() -> None:  # the dispatch thread: each job's outcome
        for i in range(n):
            store.complete_future(f"r{i}", b"x", "application/json")

    threads = [threading.Thread(target=guarded(f)) for f in (read, read, other_connection, complete)]
    for t in threads:
        t.start()
    for t in threads[2:]:
        t.join(timeout=50)
    stop.set()
    for t in threads[:2]:
        t.join(timeout=10)
    assert not failures, failures[:3]
    assert all(store.get_future(f"r{i}").finished for i in range(n))


def test_a_run_s_samplers_are_its_owner_s_only(tmp_path: Path):
    """Another key sampling a published checkpoint of the run is not the run owner's to see."""
    store = Store(tmp_path / "db.sqlite")
    for session, owner in (("sa", "alice"), ("sb", "bob")):
        store.add_session(
            session, owner=owner, tags=[], user_metadata={}, project_id=None, display_name=None, sdk_version=None
        )
    path = "tinker://sa:train:0/sampler_weights/final"
    store.add_sampler("sa:sample:0", session_id="sa", base_model="m", model_path=None, model_id="sa:train:0")
    store.add_sampler("sa:sample:1", session_id="sa", base_model="m", model_path=path, model_id=None)
    store.add_sampler("sb:sample:0", session_id="sb", base_model="m", model_path=path, model_id=None)
    store.add_sampler(
        "sa:sample:2", session_id="sa", base_model="m", model_path="tinker://sa:train:01/x/y", model_id=None
    )
    mine = {s.sampler_id for s, _ in store.samplers_of_run("sa:train:0", owner="alice")}
    assert mine == {"sa:sample:0", "sa:sample:1"}  # not bob's, not another run's with a longer id
    assert store.samplers_of_run("sa:train:0", owner="bob")[0][0].sampler_id == "sb:sample:0"
