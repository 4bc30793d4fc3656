"""Shared fixtures: one server for the session (``tests.support.server``), the tiny model.

Layout: ``tests/unit/`` mirrors ``hosted_tinker/`` (no server, no network), ``tests/e2e/``
starts servers, workers and real clients, ``tests/support/`` holds what tests share (references,
data builders, the server process); a test module imports no other test module
(``tests/unit/test_import_graph.py``).

The loop after every change is ``pytest tests/unit`` (its budget: 60 s on 2 cores); markers
(pyproject.toml): ``fast`` is that plus the SDK smoke test, ``slow`` marks the end-to-end tests
that start servers, worker processes, ranks, vLLM or real clients. CI runs everything
(``scripts/test.sh``: tests/unit within its budget, then tests/e2e on two processes).
Tests wait for what they need by polling an observable condition with a deadline, never by a
fixed sleep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProcess, start_server  # first: it sets the tests' environment

# In a test process of xdist's (CI: two of them on two cores), torch computes on one thread, in
# the servers and ranks it starts too (they inherit it): two threads each would be four or more on
# two cores, and OpenMP's threads spin while they wait for a core, burning CPU that does nothing.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The modules that take longest, longest first (CI's durations). CI runs the suite on two
# processes, a module on one (``-n 2 --dist loadfile --no-loadscope-reorder``), handing out
# modules in this order: the long ones start at once, and the many short ones fill in at the end
# (in collection order, xdist would start test_vllm's 4 minutes among the last, and wait on it alone).
LONGEST_FIRST = (  # the sum of each module's test times in a two-process run of 2026-12-06 (stop 56)
    "test_plans.py",  # 197 s
    "test_vllm.py",  # 192 s
    "test_moe_sdk.py",  # 104 s
    "test_nodes.py",
    "test_megatron.py",
    "test_ddp_server.py",
    "test_fuzz.py",
    "test_deploy.py",
    "test_ddp.py",
    "test_residency.py",
    "test_http_protocol.py",
    "test_bad_input.py",
    "test_sdk_training.py",
    "test_quotas.py",
    "test_custom_loss_sdk.py",
    "test_cookbook_rl_loop.py",
    "test_faults.py",
    "test_startup_checks.py",
    "test_console.py",
    "test_fair_sampling.py",
    "test_hostile_ops.py",
    "test_checkpoints.py",
    "test_hostile_bodies.py",
    "test_backpressure.py",
    "test_tinker_cli.py",
    "test_tenants.py",  # 12 s; the rest, under 12 s each, in collection order
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest as collected


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def tiny_model_dir(shared_data_dir: Path) -> Path:
    from hosted_tinker.core.config import built_in_model_dir
    from hosted_tinker.core.tiny_model import build_tiny_model

    return build_tiny_model(built_in_model_dir(shared_data_dir))  # where the session's server looks for it


@pytest.fixture(scope="session")
def server(shared_data_dir: Path, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One server for the whole session (tests use their own sessions and models)."""
    srv = start_server(shared_data_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.base_url


@pytest.fixture
def service_client(base_url: str):
    import tinker

    with tinker.ServiceClient(base_url=base_url) as client:  # exit finishes the session
        yield client
