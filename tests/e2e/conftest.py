"""Fixtures of the end-to-end tests (``keyed``: a server with two keys, alice's and bob's), and
the modules left out when the test extra is not installed (``tests.support.extras``)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tests.support import extras
from tests.support.tenants import serve_two_keys


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    srv, key_a, key_b = serve_two_keys(tmp_path_factory.mktemp("tenants"), tiny_model_dir)
    yield srv, key_a, key_b
    srv.stop()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if (absent := extras.missing(collection_path.name)) and not os.environ.get(extras.REQUIRE):
        warnings.warn(
            f"{collection_path.name} not collected: {', '.join(absent)} missing ({extras.INSTALL})", stacklevel=1
        )
        return True
    return None
