"""``RestClient.export_session_trace`` and ``tinker session export-trace``: a session's training
and sampling requests as a trace Perfetto opens (Chrome trace-event JSON), behind a signed link
that needs no key, expires and cannot be bent to another session; another key's session is a
404."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.cli import run_cli
from tests.support.server import ALIAS
from tests.support.tenants import datum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_sessions_requests_come_back_as_a_trace(base_url: str, tmp_path: Path) -> None:
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=5).result()
        for _ in range(2):
            tc.forward_backward([datum()], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=4)).result()
        with pytest.raises(tinker.BadRequestError):
            tc.optim_step(types.AdamParams(learning_rate=-1.0)).result()  # a refusal is on the timeline too
        session_id, model_id = sc.holder.get_session_id(), tc.get_info().model_id

    url = tinker.RestClient(base_url=base_url).export_session_trace(session_id).result()
    trace = httpx.get(url, timeout=60).raise_for_status().json()  # no key: the link is its credential
    events = trace["traceEvents"]
    threads = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert model_id in threads and any(":sample:" in name for name in threads)
    runs = sorted((e for e in events if e["ph"] == "X" and e["tid"] == threads[model_id]), key=lambda e: e["ts"])
    kinds = [e["name"] for e in runs]
    assert kinds[:5] == ["create_model", "forward_backward", "optim_step", "forward_backward", "optim_step"]
    assert "optim_step (failed)" in [e["name"] for e in events if e["ph"] in "bX"]
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in pairwise(runs))  # one job at a time
    waits = [e for e in events if e.get("cat") == "queue"]
    assert waits and {e["ph"] for e in waits} == {"b", "e"}
    samples = [e for e in events if e.get("cat") == "request" and e["name"] == "sample"]
    assert len(samples) == 2  # its begin and its end

    # the link names one session: another's, or a changed signature, is refused
    token, signature = url.split("/traces/")[1].split("/")[:2]
    forged = url.replace(signature, "0" * len(signature))
    assert httpx.get(forged, timeout=60).status_code == 403
    assert httpx.get(url.replace(token, token[:-2] + "00"), timeout=60).status_code in (403, 404)

    # the CLI writes the same trace to a file
    out = tmp_path / "session.pftrace"
    run_cli(base_url, "session", "export-trace", session_id, "--output", str(out), cwd=tmp_path)
    assert json.loads(out.read_text())["traceEvents"][0] == events[0]


def test_another_keys_session_has_no_trace(keyed) -> None:
    srv, key_a, key_b = keyed
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key_a) as sc:
        session_id = sc.holder.get_session_id()
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=srv.base_url, api_key=key_b).export_session_trace(session_id).result()
    url = tinker.RestClient(base_url=srv.base_url, api_key=key_a).export_session_trace(session_id).result()
    assert httpx.get(url, timeout=60).status_code == 200  # no key: the CLI fetches it so
    renamed = url.rpartition("/")[0] + "/sess-someone-else.json"
    assert httpx.get(renamed, timeout=60).status_code == 404  # the link serves its own name only
