"""Fixtures of the end-to-end tests (``keyed``: a keyed server and two keys of the module's own,
alice's and bob's), and the modules left out when the test extra is not installed
(``tests.support.extras``)."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import extras
from tests.support.server import ServerProcess, start_server, use_built_in_model, use_zygote
from tests.support.tenants import new_keys


@pytest.fixture(scope="session", autouse=True)
def servers_start_light(tiny_model_dir: Path) -> None:
    """Servers are forked from a zygote that has imported what a server imports (~3.6 s of CPU a
    start saved; ``HOSTED_TINKER_TEST_SPAWN=1`` for a new interpreter each), and those started
    with no --model link the session's tiny model rather than build their own."""
    use_zygote()
    use_built_in_model(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_family(shared_data_dir: Path) -> Callable[[str], Path]:
    """``tiny_family("qwen3_moe")``: that family's tiny random model (hidden size 64), built once
    per test process (~3 s a build) and shared by every module that reads it; nothing writes to it."""
    from hosted_tinker.core.tiny_model import build_tiny_model

    @functools.cache
    def build(family: str) -> Path:
        return build_tiny_model(shared_data_dir / "families" / family, family=family, hidden_size=64)

    return build


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One keyed server for the modules that need no flag of their own (a server start is ~10 s
    of CPU): each module's ``keyed`` keys are its own tenants, so the modules cannot see each
    other's models, checkpoints or sessions, as two real tenants cannot."""
    data = tmp_path_factory.mktemp("keyed")
    new_keys(data, "operator")  # keyed from its start: with no key, a server is open to all
    srv = start_server(data, "--model", str(tiny_model_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(keyed_server: ServerProcess) -> tuple[ServerProcess, str, str]:
    """The shared keyed server, and two new keys (alice's and bob's) for this module alone."""
    key_a, key_b = new_keys(keyed_server.data_dir, "alice", "bob")
    return keyed_server, key_a, key_b


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if (absent := extras.missing(collection_path.name)) and not os.environ.get(extras.REQUIRE):
        warnings.warn(
            f"{collection_path.name} not collected: {', '.join(absent)} missing ({extras.INSTALL})", stacklevel=1
        )
        return True
    return None
