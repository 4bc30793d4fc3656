"""``AdminClient.get_billing_usage`` through the real SDKs: a key's tokens trained (forward and
forward_backward), sampled (prompt once, every sample's tokens; Tinker and OpenAI /v1),
checkpoints saved and gigabyte-hours stored, per hour and session, its session's metadata
beside; another key's use is not in it; windows off the hour, too long or in the future are
refused by field."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import openai
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS
from tests.support.tenants import datum, serve_two_keys
from tests.support.usage import totals, window

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    # Retention 20 s: the sweep that counts stored checkpoints runs every 5 s.
    srv, key_a, key_b = serve_two_keys(tmp_path_factory.mktemp("usage"), tiny_model_dir, "--result-retention", "20")
    yield srv, key_a, key_b
    srv.stop()


def test_a_keys_use_is_counted_hour_by_hour(metered) -> None:
    srv, key_a, key_b = metered
    with tinker.ServiceClient(
        base_url=srv.base_url, api_key=key_a, project_id="proj-u", user_metadata={"team": "red"}
    ) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=7).result()
        for _ in range(2):
            tc.forward_backward([datum(8)], "cross_entropy").result()
        tc.forward([datum(5)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        tc.save_state("kept").result()
        sampler_path = tc.save_weights_for_sampler("served").result().path
        sampler = sc.create_sampling_client(model_path=sampler_path).result()
        drawn = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=4)).result()
        session_id = sc.holder.get_session_id()
    chat = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key_a).completions.create(
        model=ALIAS, prompt=[9, 10, 11, 12], max_tokens=3, n=2
    )

    admin = tinker.AdminClient(base_url=srv.base_url, api_key=key_a)
    deadline = time.monotonic() + 60
    while "storage" not in totals(usage := admin.get_billing_usage(*window()).result(), session_id):
        assert time.monotonic() < deadline, "the stored checkpoints were never counted"
        time.sleep(0.5)
    mine = totals(usage, session_id)
    assert mine["training"] == 8 + 8 + 5  # forward_backward twice, and the forward
    assert mine["sampling_prefill"] == 3  # once, for both samples
    assert mine["sampling_sample"] == sum(len(s.tokens) for s in drawn.sequences)
    assert mine["checkpoint"] == 2 and mine["storage"] > 0
    v1 = totals(usage, None)
    assert v1["sampling_prefill"] == 4 and v1["sampling_sample"] == chat.usage.completion_tokens
    ours = [e for e in usage.data if e.session_id == session_id]
    assert {(e.project_id, e.base_model, e.user_name) for e in ours} == {("proj-u", ALIAS, "alice")}
    assert usage.sessions[session_id].user_metadata == {"team": "red"}
    assert all(e.estimated_cost_usd is None for e in usage.data)  # nobody is billed
    hours = {(e.bucket_start, e.bucket_end) for e in usage.data}
    assert all(end - start == timedelta(hours=1) and start.minute == 0 for start, end in hours)

    assert tinker.AdminClient(base_url=srv.base_url, api_key=key_b).get_billing_usage(*window()).result().data == []


@pytest.mark.parametrize(
    ("shift", "field"),
    [
        (lambda s, e: (s + timedelta(minutes=30), e), "starting_on"),
        (lambda s, e: (s, e + timedelta(minutes=1)), "ending_before"),
        (lambda s, e: (s, s + timedelta(days=15)), "14 days"),
        (lambda s, e: (s + timedelta(days=2), s + timedelta(days=3)), "future"),
        (lambda s, e: (s, s), "after starting_on"),
    ],
)
def test_a_window_the_service_would_refuse_is_refused(metered, shift, field: str) -> None:
    srv, key_a, _ = metered
    admin = tinker.AdminClient(base_url=srv.base_url, api_key=key_a)
    with pytest.raises(tinker.BadRequestError, match=field):
        admin.get_billing_usage(*shift(*window())).result()
