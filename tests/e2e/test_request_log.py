"""The request log: one JSON line per request, naming the tenant's key id (never the key), the
route, model, seq_id, loss and optimizer of training calls, status, duration and bytes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.logs import lines
from tests.support.server import ALIAS, start_server
from tests.support.tenants import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_every_request_is_a_line_naming_what_an_operator_needs(tmp_path: Path, tiny_model_dir: Path):
    key = cli("keys", "create", "--data-dir", str(tmp_path), "--name", "alice")
    key_id = cli("keys", "list", "--data-dir", str(tmp_path)).split()[0]
    server = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        with tinker.ServiceClient(base_url=server.base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(
                base_model=ALIAS, rank=4, optimizer=types.DimuonOptimizerConfig()
            ).result()
            model_id = tc.get_info().model_id
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(list(range(10, 20))),
                loss_fn_inputs={"target_tokens": list(range(11, 21)), "weights": [1.0] * 10},
            )
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.DimuonParams(learning_rate=0.01)).result()
            with pytest.raises(tinker.BadRequestError):
                tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        assert httpx.post(f"{server.base_url}/api/v1/create_session", json={"tags": []}).status_code == 401
        # A request's line is written as it ends, which may be just after its client has the answer.
        deadline = time.monotonic() + 10
        log = lines(tmp_path / "requests.jsonl")
        while not any(x["status"] == 401 for x in log):
            assert time.monotonic() < deadline, "the refused request's line was never written"
            time.sleep(0.05)
            log = lines(tmp_path / "requests.jsonl")
        assert key not in (tmp_path / "requests.jsonl").read_text()
        fb = next(x for x in log if x.get("route") == "/api/v1/forward_backward")
        assert fb["key_id"] == key_id and fb["model_id"] == model_id and fb["seq_id"] == 1
        assert fb["loss_fn"] == "cross_entropy" and fb["status"] == 200 and fb["bytes_in"] > 0 and fb["ms"] > 0
        steps = [x for x in log if x.get("route") == "/api/v1/optim_step"]
        assert [(x["seq_id"], x["optimizer"], x["status"]) for x in steps] == [(2, "dimuon", 200), (3, "adamw", 400)]
        create = next(x for x in log if x.get("route") == "/api/v1/create_model")
        assert create["optimizer"] == "dimuon" and create["lora_rank"] == 4 and create["model_id"] == model_id
        refused = [x for x in log if x["status"] == 401]
        assert refused and all("key_id" not in x for x in refused)
        assert all(x.get("request_id", "req-").startswith("req-") for x in log)
    finally:
        server.stop()
