"""Two tenants on one server: their keys (made as `keys create` makes them), a datum, a future's result polled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from tinker import types

from tests.support.server import ServerProcess, start_server


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "hosted_tinker", *args], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def new_keys(data: Path, *names: str) -> list[str]:
    """Keys made in this process, as ``keys create`` makes them (a running server on ``data``
    looks keys up per request, so they work at once): without the CLI's 2 s of imports each."""
    from hosted_tinker.server.keys import create_key
    from hosted_tinker.server.persistence.store import Store

    store = Store.in_data_dir(data)
    try:
        return [create_key(store, name)[1] for name in names]
    finally:
        store.close()


def serve_two_keys(data: Path, model: Path, *extra: str) -> tuple[ServerProcess, str, str]:
    """A server on ``data`` with two keys made first, alice's and bob's."""
    key_a, key_b = new_keys(data, "alice", "bob")
    return start_server(data, "--model", str(model), *extra), key_a, key_b


def result(c: httpx.Client, request_id: str) -> dict:
    while (body := c.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()).get(
        "type"
    ) == "try_again":
        pass
    return body


def datum(n: int = 8) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 10 + n))),
        loss_fn_inputs={"target_tokens": list(range(11, 11 + n)), "weights": [1.0] * n},
    )
