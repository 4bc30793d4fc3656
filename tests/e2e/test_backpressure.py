"""Queue bounds: over a bound a submit gets 429 + Retry-After (which the SDK honours), the
request a model's queue waits for is always let in, and /healthz shows the bounds."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, start_server
from tests.support.wire import Api, fwdbwd_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    srv = start_server(
        tmp_path_factory.mktemp("tight"),
        "--model",
        str(tiny_model_dir),
        "--max-pending-per-model",
        "2",
        "--max-pending",
        "8",
    )
    yield srv
    srv.stop()


def test_over_the_per_model_bound_is_429_and_the_awaited_request_still_gets_in(tight):
    api = Api(tight.base_url)
    model = api.new_model()
    waiting = [api.fwdbwd(fwdbwd_body(model, seq)) for seq in (2, 3)]  # early: they wait for seq 1
    r = api.post("forward_backward", content=fwdbwd_body(model, 4), headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and "per-model bound" in r.json()["detail"]
    health = httpx.get(f"{tight.base_url}/healthz").json()["queue"]
    assert health["pending"] == 2 and health["max_pending_per_model"] == 2 and health["max_pending"] == 8
    first = api.fwdbwd(fwdbwd_body(model, 1))  # over the bound, but the one the queue waits for
    for request_id in (first, *waiting):
        assert not isinstance(api.result(request_id), dict)  # a ForwardBackwardOutput, not an error
    api.fwdbwd(fwdbwd_body(model, 4))  # room again: the refused seq_id was not used up
    assert httpx.get(f"{tight.base_url}/healthz").json()["status"] == "ok"


def test_the_global_bound_refuses_other_models_too(tight):
    api = Api(tight.base_url)
    models = [api.new_model() for _ in range(5)]
    for m in models[:4]:
        for seq in (2, 3):
            api.fwdbwd(fwdbwd_body(m, seq))  # 8 early arrivals fill the global bound
    r = api.post(
        "forward_backward", content=fwdbwd_body(models[4], 1), headers={"Content-Type": "application/x-protobuf"}
    )
    assert r.status_code == 429 and "global bound" in r.json()["detail"]
    for m in models[:4]:  # each model's awaited request still gets in, and drains its queue
        assert not isinstance(api.result(api.fwdbwd(fwdbwd_body(m, 1))), dict)
    assert not isinstance(api.result(api.fwdbwd(fwdbwd_body(models[4], 1))), dict)


def test_a_request_refused_while_the_server_is_full_gets_429_not_its_422(tight):
    """An invalid ordered request still uses up its seq_id, which needs room in the queue; with
    none, the answer is the 429 (the SDK resends), not the 422 (which it would not, leaving the
    model waiting on that seq_id forever). Resent once there is room, it gets its 422."""
    api = Api(tight.base_url)
    models = [api.new_model() for _ in range(5)]
    for m in models[:4]:
        for seq in (2, 3):
            api.fwdbwd(fwdbwd_body(m, seq))  # 8 early arrivals fill the global bound
    invalid = {"model_id": models[4], "seq_id": 1, "adam_params": {"learning_rate": None}}
    busy = api.post("optim_step", json=invalid)
    assert busy.status_code == 429 and "global bound" in busy.json()["detail"], busy.text
    for m in models[:4]:
        api.result(api.fwdbwd(fwdbwd_body(m, 1)))  # drain
    refused = api.post("optim_step", json=invalid)
    assert refused.status_code == 422 and "learning_rate" in refused.text
    assert not isinstance(api.result(api.fwdbwd(fwdbwd_body(models[4], 2))), dict)  # seq 1 was used up


def test_the_sdk_waits_out_429s(tight):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 40))),
        loss_fn_inputs={"target_tokens": list(range(11, 41)), "weights": [1.0] * 30},
    )
    refused_before = httpx.get(f"{tight.base_url}/healthz").json()["queue"]["refused"]
    with tinker.ServiceClient(base_url=tight.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        # Nine requests submitted at once on a model allowed two pending: some are refused and resent.
        futures = [tc.forward_backward([datum], "cross_entropy") for _ in range(8)]
        futures.append(tc.optim_step(types.AdamParams(learning_rate=1e-3)))
        losses = [f.result().metrics["loss:sum"] for f in futures[:-1]]
        futures[-1].result()
    assert losses == [losses[0]] * 8  # all ran, in order, on the same weights
    assert httpx.get(f"{tight.base_url}/healthz").json()["queue"]["refused"] > refused_before


def test_openai_requests_hold_a_place_under_the_bounds(tight):
    """/v1 completions have no future, but each holds a place under the bounds while it samples
    (streamed or not): over the per-model bound, 429 in OpenAI's shape, which its SDK waits out."""
    body = {"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 128, "temperature": 1.0}

    def post(stream: bool) -> httpx.Response:
        return httpx.post(f"{tight.base_url}/v1/completions", json=body | {"stream": stream}, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(post, [False, True] * 4))
    statuses = [r.status_code for r in replies]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert "per-model bound" in refused.json()["error"]["message"]

    client = openai.OpenAI(base_url=f"{tight.base_url}/v1", api_key="tml-test", max_retries=10)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: client.completions.create(**body), range(8)))
    assert all(a.usage.completion_tokens > 0 for a in answers)
    queue = httpx.get(f"{tight.base_url}/healthz").json()["queue"]
    assert queue["pending"] == 0 and queue["pending_busiest_model"] == 0
