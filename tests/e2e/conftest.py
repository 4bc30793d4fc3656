"""Fixtures of the end-to-end tests: ``keyed``, a server with two keys (alice's and bob's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tenants import serve_two_keys


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    srv, key_a, key_b = serve_two_keys(tmp_path_factory.mktemp("tenants"), tiny_model_dir)
    yield srv, key_a, key_b
    srv.stop()
