"""``/metrics``: scraped before and after a short SDK run (2 training steps, a save, a sample),
every counter moved by exactly what the run did, read with prometheus-client's own parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.support.metrics import moved, scrape
from tests.support.server import ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_counters_move_by_what_a_short_run_did(base_url: str):
    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(5, 5 + n))),
            loss_fn_inputs={"target_tokens": list(range(6, 6 + n)), "weights": [1.0] * n},
        )
        for n in (4, 7)
    ]
    before = scrape(base_url)
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        for _ in range(2):
            tc.forward_backward(datums, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        saved = tc.save_state("metrics").result().path
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints([5, 6]), 3, types.SamplingParams(max_tokens=4)).result()
        listed = tinker.RestClient(base_url=base_url).list_checkpoints(tc.get_info().model_id).result().checkpoints
        size = {c.tinker_path: c.size_bytes for c in listed}[saved]
    after = scrape(base_url)

    route = {"route": "/api/v1/forward_backward", "method": "POST", "status": "200"}
    assert moved(before, after, "hosted_tinker_requests_total", **route) == 2
    assert moved(before, after, "hosted_tinker_request_seconds_count", route=route["route"], method="POST") == 2
    assert moved(before, after, "hosted_tinker_job_seconds_count", kind="forward_backward") == 2
    assert moved(before, after, "hosted_tinker_job_seconds_count", kind="optim_step") == 2
    assert moved(before, after, "hosted_tinker_tokens_trained_total", kind="forward_backward") == 2 * (4 + 7)
    sampled = sum(len(s.tokens) for s in out.sequences)
    assert moved(before, after, "hosted_tinker_tokens_sampled_total") == sampled > 0
    assert moved(before, after, "hosted_tinker_checkpoint_bytes_written_total", kind="weights") == size > 0
    assert ("hosted_tinker_worker_restarts_total", ()) in after
    assert after[("hosted_tinker_resident_models", ())] >= 0
    assert ("hosted_tinker_vllm_restarts_total", ()) not in after  # the embedded engine has none


def test_the_grafana_dashboard_plots_only_metrics_the_server_has(base_url: str):
    """``deploy/grafana-dashboard.json``: every series its queries name is one /metrics serves
    (those of vLLM and LoRA syncs are served with vLLM only)."""
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    queried = {
        re.sub(r"_(bucket|count|sum|total)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"hosted_tinker_\w+", target["expr"])
    }
    r = httpx.get(f"{base_url}/metrics", timeout=10)
    served = {family.name for family in text_string_to_metric_families(r.text)}
    assert queried - served == {"hosted_tinker_vllm_restarts", "hosted_tinker_lora_sync_seconds"}
