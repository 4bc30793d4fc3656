"""The sampling side of SDK 0.38's futures: ``retrieve_futures`` (one completions long-poll per
sampling client), ``join_sampling_session`` (numbers for unpickled clients) and
``cancel_future``, as raw HTTP and through the real SDK, which the server tells to use all
three (``client/config``, ``client/dynamic_config``)."""

from __future__ import annotations

import pickle
import threading
import time

import httpx
import pytest
import tinker
from tinker import types

from tests.support.sampling import (
    LONG,
    PROMPT,  # noqa: F401
    _asample,
    _sampler,
)
from tests.support.server import ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 1_000_000_000
SHORT = {"max_tokens": 4, "temperature": 0.0, "stop": []}


def _poll(http: httpx.Client, sampler: str, clone: int = 0, cursor: int = 0, **extra) -> dict:
    target = {"type": "sampling_session", "sampling_session_id": sampler, "cloned_sampler_id": clone}
    r = http.post("/api/v1/retrieve_futures", json={"target": target, "prev_cursor": cursor, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_server_advertises_what_it_serves(base_url):
    with httpx.Client(base_url=base_url) as http:
        config = http.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}).json()
        assert config["sample_use_retrieve_futures"] and config["sample_join_sampling_session"]
        assert http.post("/api/v1/client/dynamic_config", json={"sdk_version": "0.38.0"}).json()[
            "sample_cancel_enabled"
        ]


def test_completions_per_client_in_finishing_order_with_a_cursor(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        sampler = _sampler(http)
        mine = _asample(http, sampler, 1, SHORT)
        clone = _asample(http, sampler, 3 * BLOCK + 1, SHORT)
        first = _poll(http, sampler)  # the server's long-poll: waits for the result
        assert [c["request_id"] for c in first["completions"]] == [mine]
        assert first["completions"][0]["state"] == "finished"
        assert first["completions"][0]["response_payload_uncompressed_size"] > 0
        assert _poll(http, sampler, cursor=first["cursor"], timeout=0) == {"completions": [], "cursor": first["cursor"]}
        assert [c["request_id"] for c in _poll(http, sampler, clone=3)["completions"]] == [clone]
        # A poll that waits is woken by the next result, well before its timeout.
        woke: dict = {}
        poller = threading.Thread(target=lambda: woke.update(_poll(http, sampler, cursor=first["cursor"], timeout=25)))
        poller.start()
        later = _asample(http, sampler, 2, SHORT)
        started = time.monotonic()
        poller.join(30)
        assert [c["request_id"] for c in woke["completions"]] == [later] and time.monotonic() - started < 20
        # Results the client reports as retrieved are deleted.
        _poll(http, sampler, cursor=woke["cursor"], timeout=0, retrieved_request_ids=[mine, later])
        assert http.post("/api/v1/retrieve_future", json={"request_id": mine}).status_code == 404
        assert http.post("/api/v1/retrieve_future", json={"request_id": clone}).status_code == 200


def test_join_numbers_the_clients_and_checks_the_session(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        sampler = _sampler(http)
        numbers = [http.post("/api/v1/join_sampling_session", json={"sampling_session_id": sampler}) for _ in range(2)]
        assert [r.json()["client_counter"] for r in numbers] == [1, 2]
        r = http.post("/api/v1/join_sampling_session", json={"sampling_session_id": "samp-nope"})
        assert r.status_code == 404 and "sampling_session_id" in r.text


def test_cancel_stops_a_sample_and_frees_the_engine(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        sampler = _sampler(http)
        doomed = _asample(http, sampler, 1, LONG, num_samples=8)
        cancelled_before = http.get("/healthz").json()["queue"]["cancelled"]
        r = http.post("/api/v1/cancel_future", json={"request_id": doomed})
        assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
        result = http.post("/api/v1/retrieve_future", json={"request_id": doomed}).json()
        assert result["category"] == "user" and "cancelled" in result["error"]
        assert [c["state"] for c in _poll(http, sampler)["completions"]] == ["failed"]
        assert http.get("/healthz").json()["queue"]["cancelled"] == cancelled_before + 1
        # The engine is free: a short sample does not wait behind 8 × 4000 tokens.
        quick = _asample(http, sampler, 2, SHORT)
        done = http.post("/api/v1/retrieve_future", json={"request_id": quick}, timeout=60)
        assert done.headers["content-type"] == "application/x-protobuf"  # a result, not try_again
        # Finished: nothing to cancel. Training requests cannot be cancelled.
        again = http.post("/api/v1/cancel_future", json={"request_id": quick}).json()
        assert again["cancelled"] is False
        r = http.post("/api/v1/cancel_future", json={"request_id": "req-nope"})
        assert r.status_code == 404 and "request_id" in r.text


def test_training_requests_are_not_cancellable(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(list(range(10, 20))),
            loss_fn_inputs={"target_tokens": list(range(11, 21)), "weights": [1.0] * 10},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        with httpx.Client(base_url=base_url, timeout=60) as http:
            body = {"model_id": tc.get_info().model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
            request_id = http.post("/api/v1/optim_step", json=body).json()["request_id"]
            r = http.post("/api/v1/cancel_future", json={"request_id": request_id})
            assert r.status_code == 400 and "only sampling requests can be cancelled" in r.text


def test_sdk_clients_sample_through_the_completions_poll_and_clones_do_not_collide(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc:
        client = sc.create_sampling_client(base_model=ALIAS).result()
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        prompts = [types.ModelInput.from_ints(list(range(start, start + 12))) for start in (40, 90, 140)]
        alone = [client.sample(p, 1, greedy).result().sequences[0].tokens for p in prompts]
        # Unpickled clients (as a process pool gets them) join the session for their own numbers;
        # their seq_ids then never name another client's requests.
        clones = [pickle.loads(pickle.dumps(client)) for _ in range(2)]
        futures = [c.sample(p, 1, greedy) for c in (client, *clones) for p in prompts]
        got = [f.result().sequences[0].tokens for f in futures]
        assert got == alone * 3
        with httpx.Client(base_url=base_url) as http:  # the two clones were numbered 1 and 2
            body = {"sampling_session_id": client._sampling_session_id}
            assert http.post("/api/v1/join_sampling_session", json=body).json()["client_counter"] == 3


def test_sdk_abandoned_sample_is_cancelled_on_the_server(base_url):
    with tinker.ServiceClient(base_url=base_url) as sc, httpx.Client(base_url=base_url) as http:
        client = sc.create_sampling_client(base_model=ALIAS).result()
        before = http.get("/healthz").json()["queue"]["cancelled"]
        future = client.sample(
            types.ModelInput.from_ints(list(range(30, 40))),
            8,
            types.SamplingParams(max_tokens=4000, temperature=1.0, seed=3, stop=[]),
        )
        with pytest.raises(TimeoutError):
            future.result(timeout=1.0)
        future.future().cancel()
        deadline = time.monotonic() + 60
        while http.get("/healthz").json()["queue"]["cancelled"] == before:
            assert time.monotonic() < deadline, "the SDK's cancel never reached the server"
            time.sleep(0.2)
