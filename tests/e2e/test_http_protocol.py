"""Raw-HTTP checks of what the SDK does not let a test provoke: seq ordering, de-duplication,
long-poll behaviour, responsiveness during a long step, zstd bodies, and restart durability."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from contextlib import closing

import httpx
import numpy as np
import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from tests.support.server import ALIAS, start_server
from tests.support.wire import (
    HEADERS,  # noqa: F401
    Api,
    fwdbwd_body,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def api(base_url: str) -> Api:
    return Api(base_url)


def test_early_arrivals_wait_and_resends_dedupe(api: Api):
    model = api.new_model()
    # optim_step (seq 2) arrives before the forward_backward (seq 1) it depends on.
    optim = api.post("optim_step", json={"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
    assert optim.status_code == 200
    fb = api.fwdbwd(fwdbwd_body(model, 1))
    assert api.fwdbwd(fwdbwd_body(model, 1)) == fb  # a resend returns the original future
    metrics = api.result(optim.json()["request_id"])["metrics"]
    assert metrics["grad_norm"] > 0  # it ran after the forward_backward, not before
    assert api.result(fb).metrics["loss:sum"] > 0


def test_failed_request_does_not_block_the_next(api: Api):
    model = api.new_model()
    # Sampler logprobs of -1e4 overflow the importance ratio: the gradient is not finite, so
    # optim_step (seq 2) fails with a user error; seq 3 must still run.
    poisoned = pb.ForwardBackwardRequest.FromString(fwdbwd_body(model, 1))
    poisoned.loss_fn = "importance_sampling"
    for d in poisoned.data:
        n = d.loss_fn_inputs["weights"].shape[0]
        del d.loss_fn_inputs["weights"]
        for key, value in (("logprobs", -1e4), ("advantages", 1.0)):
            d.loss_fn_inputs[key].CopyFrom(
                pb.Tensor(dense=np.full(n, value, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[n])
            )
    api.result(api.fwdbwd(poisoned.SerializeToString()))
    bad = api.post("optim_step", json={"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
    ok = api.fwdbwd(fwdbwd_body(model, 3))
    assert api.result(ok).metrics["loss:sum"] > 0
    failure = api.result(bad.json()["request_id"])
    assert failure["category"] == "user" and "gradient norm" in failure["error"]


def test_rejected_submit_consumes_seq_and_reports_failure(api: Api):
    model = api.new_model()
    bad = pb.ForwardBackwardRequest.FromString(fwdbwd_body(model, 1))
    bad.loss_fn = "custom"
    r = api.post(
        "forward_backward", content=bad.SerializeToString(), headers={"Content-Type": "application/x-protobuf"}
    )
    assert r.status_code == 400 and "custom" in r.json()["detail"]
    assert api.result(api.fwdbwd(fwdbwd_body(model, 2))).metrics["loss:sum"] > 0


def test_bad_values_consume_their_seq_and_never_stall_the_model(api: Api):
    model = api.new_model()
    r = api.post("optim_step", json={"model_id": model, "seq_id": 1, "adam_params": {"eps": 0.0}})
    assert r.status_code == 400 and "adam_params.eps" in r.json()["detail"]
    bf16 = pb.ForwardBackwardRequest.FromString(fwdbwd_body(model, 2))
    bf16.data[0].loss_fn_inputs["weights"].dtype = pb.DTYPE_BFLOAT16
    r = api.post(
        "forward_backward", content=bf16.SerializeToString(), headers={"Content-Type": "application/x-protobuf"}
    )
    assert r.status_code == 400 and "data[0].loss_fn_inputs.weights" in r.json()["detail"]
    assert api.result(api.fwdbwd(fwdbwd_body(model, 3))).metrics["loss:sum"] > 0
    for seq_id in (0, -3, 2**31):
        r = api.post("optim_step", json={"model_id": model, "seq_id": seq_id, "adam_params": {}})
        assert r.status_code == 400 and "seq_id" in r.json()["detail"]
    r = api.post("optim_step", json={"model_id": model, "seq_id": 4 + 10_000, "adam_params": {}})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "metrics" in api.result(api.post("optim_step", json={"model_id": model, "seq_id": 4}).json()["request_id"])


def test_oversized_numbers_are_4xx_not_500(api: Api):
    session = api.post("create_session", json={"tags": []}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 2**70, "base_model": ALIAS, "lora_config": {"rank": 4}}
    assert api.post("create_model", json=body).status_code == 422
    body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4, "seed": 2**70}}
    assert api.post("create_model", json=body).status_code == 422
    api.post(f"sessions/{session}/finish", json={"reason": {"type": "success"}})
    r = api.post("create_model", json={**body, "lora_config": {"rank": 4}})
    assert r.status_code == 400 and "finished" in r.json()["detail"]


def test_failures_are_200_with_error_and_category(api: Api):
    model = api.new_model()
    r = api.post("unload_model", json={"model_id": model})
    assert api.result(r.json()["request_id"])["model_id"] == model
    r = api.post("optim_step", json={"model_id": model, "seq_id": 1, "adam_params": {}})
    assert r.status_code == 400 and "unloaded" in r.json()["detail"]
    assert api.poll("req-does-not-exist").status_code == 404


def test_long_poll_is_woken_at_completion(api: Api):
    model = api.new_model()
    request_id = api.fwdbwd(fwdbwd_body(model, 1, n_datums=8, length=256))
    start = time.perf_counter()
    api.result(request_id)
    assert time.perf_counter() - start < 10  # not a fixed sleep or a 30 s poll cap


def test_health_answers_during_a_long_step(api: Api, base_url: str):
    model = api.new_model()
    request_id = api.fwdbwd(fwdbwd_body(model, 1, n_datums=48, length=1024))
    latencies = []
    done = threading.Event()

    def wait():
        api.result(request_id)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    with httpx.Client(base_url=base_url) as health:
        while not done.is_set():
            start = time.perf_counter()
            assert health.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    assert len(latencies) >= 5, "the step was too short to measure responsiveness"
    assert float(np.median(latencies)) < 0.1, latencies


def test_session_lifecycle_and_strict_json(api: Api):
    assert api.post("client/dynamic_config", json={"sdk_version": "0.38.0"}).json() == {"sample_cancel_enabled": True}
    telemetry = {"events": [], "platform": "Linux", "sdk_version": "0.38.0", "session_id": "x", "process_uuid": "y"}
    assert api.post("telemetry", json=telemetry).json() == {"status": "accepted"}
    session = api.post("create_session", json={"tags": ["a"], "sdk_version": "0.38.0"}).json()["session_id"]
    assert api.post("session_heartbeat", json={"session_id": session}).status_code == 200
    body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4}}
    model = api.result(api.post("create_model", json=body).json()["request_id"])["model_id"]
    finish = api.post(f"sessions/{session}/finish", json={"reason": {"type": "success"}, "detail": None})
    assert finish.status_code == 200
    # Finishing a session frees its adapters.
    info = api.post("get_info", json={"model_id": model})
    assert info.status_code == 400 and "unloaded" in info.json()["detail"]
    assert api.post("session_heartbeat", json={"session_id": session}).status_code == 410
    assert api.post("session_heartbeat", json={"session_id": "sess-nope"}).status_code == 404
    # Unknown fields are refused with a body that names them, never silently dropped.
    r = api.post("create_session", json={"tags": [], "colour": "blue"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "colour"
    r = api.post("optim_step", json={"model_id": "m", "adam_params": {"learning_rate": 1e-3}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "seq_id"
    r = api.post("optim_step", json={"model_id": "m", "seq_id": 1, "adam_params": {"lr": 1e-3}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "lr"


def test_create_model_refusals(api: Api):
    session = api.post("create_session", json={"tags": []}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": ALIAS, "lora_config": {"rank": 4}}
    r = api.post("create_model", json={**body, "optimizer_config": {"type": "lion"}})
    assert r.status_code == 400 and "lion" in r.json()["detail"]
    flags = {"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}
    r = api.post("create_model", json={**body, "model_seq_id": 1, "lora_config": flags})
    assert r.status_code == 400 and "train_attn" in r.json()["detail"]
    r = api.post("create_model", json={**body, "session_id": "sess-unknown"})
    assert r.status_code == 404
    # A resent create_model returns the original future and the model id {session}:train:{seq}.
    first = api.post("create_model", json={**body, "model_seq_id": 2}).json()["request_id"]
    assert api.post("create_model", json={**body, "model_seq_id": 2}).json()["request_id"] == first
    assert api.result(first)["model_id"] == f"{session}:train:2"


def test_server_options_zstd_and_poll_cap(tmp_path, tiny_model_dir):
    srv = start_server(tmp_path, "--model", str(tiny_model_dir), "--proto-compress", "--poll-timeout", "0.5")
    try:
        api = Api(srv.base_url)
        assert api.post("client/config", json={"sdk_version": "0.38.0"}).json()["proto_compress_fwdbwd"] is True
        model = api.new_model()
        # A request that cannot run yet (seq 1 missing) is answered try_again at the poll cap.
        waiting = api.fwdbwd(fwdbwd_body(model, 2))
        start = time.perf_counter()
        body = api.poll(waiting).json()
        assert body["type"] == "try_again" and 0.4 < time.perf_counter() - start < 5
        body = zstandard.ZstdCompressor().compress(fwdbwd_body(model, 1))
        assert api.result(api.fwdbwd(body, **{"Content-Encoding": "zstd"})).metrics["loss:sum"] > 0
        assert api.result(waiting).metrics["loss:sum"] > 0  # seq 2 ran once seq 1 arrived
        # one 300 MiB field (the walk of its start finds nothing wrong): refused by its inflated size
        field = pb.ForwardBackwardRequest(model_id="x").SerializeToString()[:1] + _varint(300 << 20)
        bomb = zstandard.ZstdCompressor().compress(field + b"\0" * (300 << 20))
        r = api.post(
            "forward_backward",
            content=bomb,
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
        )
        assert r.status_code == 400 and "exceeds" in r.json()["detail"]
        assert httpx.get(f"{srv.base_url}/healthz").status_code == 200
        # The real SDK against a compressing server.
        import tinker
        from tinker import types

        with tinker.ServiceClient(base_url=srv.base_url) as sc:
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
            d = types.Datum(
                model_input=types.ModelInput.from_ints([5, 6, 7]),
                loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
            )
            assert tc.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0
    finally:
        srv.stop()


def test_restart_keeps_results_and_fails_in_flight(tmp_path, tiny_model_dir):
    srv = start_server(tmp_path, "--model", str(tiny_model_dir))
    api = Api(srv.base_url)
    model = api.new_model()
    finished = api.fwdbwd(fwdbwd_body(model, 1))
    expected = api.result(finished).metrics["loss:sum"]
    in_flight = api.fwdbwd(fwdbwd_body(model, 2, n_datums=64, length=1024))
    waiting = api.fwdbwd(fwdbwd_body(model, 4))  # seq 3 never arrives: it waits forever
    srv.stop(signal.SIGKILL)

    srv = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        api = Api(srv.base_url)
        assert api.result(finished).metrics["loss:sum"] == expected
        for request_id in (in_flight, waiting):
            failure = api.result(request_id)
            assert failure["category"] == "server" and "restarted" in failure["error"]
        r = api.post(
            "forward_backward", content=fwdbwd_body(model, 5), headers={"Content-Type": "application/x-protobuf"}
        )
        assert r.status_code == 400 and "restart" in r.json()["detail"]
    finally:
        srv.stop()


def test_results_are_deleted_after_retention(tmp_path, tiny_model_dir):
    srv = start_server(tmp_path, "--result-retention", "1")
    try:
        api = Api(srv.base_url)
        model_id = api.new_model()
        first = api.fwdbwd(fwdbwd_body(model_id, 1))
        api.result(first)
        deadline = time.monotonic() + 30
        while api.poll(first).status_code != 404:  # swept within a second or two of expiring
            assert time.monotonic() < deadline, "the finished result was never deleted"
            time.sleep(0.25)
        assert "does not exist" in api.poll(first).json()["detail"]
        with closing(sqlite3.connect(tmp_path / "hosted_tinker.sqlite")) as db:  # and its trace's row
            while db.execute("SELECT COUNT(*) FROM timeline WHERE request_id=?", (first,)).fetchone()[0]:
                assert time.monotonic() < deadline, "the finished request's timeline row was never deleted"
                time.sleep(0.25)
        # The model lives on; its old seq_id stays used, though its result is gone.
        assert len(api.result(api.fwdbwd(fwdbwd_body(model_id, 2))).loss_fn_outputs) == 1
        resent = api.result(api.fwdbwd(fwdbwd_body(model_id, 1)))
        assert resent["category"] == "user" and "already used" in resent["error"]
    finally:
        srv.stop()


def test_a_silent_session_ends_after_both_retention_and_session_timeout(tmp_path, tiny_model_dir):
    """A client that stopped heartbeating: its session is ended once it has been silent for
    longer than the retention of results and the session timeout (its model then says so), not
    after the retention alone."""
    srv = start_server(tmp_path, "--result-retention", "1", "--session-timeout", "3")
    try:
        api = Api(srv.base_url)
        model_id = api.new_model()
        started = time.monotonic()
        deadline = started + 60
        seq_id = 0
        while True:  # training calls, but no heartbeat
            seq_id += 1
            headers = {"Content-Type": "application/x-protobuf"}
            answer = api.post("forward_backward", content=fwdbwd_body(model_id, seq_id), headers=headers)
            if answer.status_code != 200:
                break
            api.result(answer.json()["request_id"])
            assert time.monotonic() < deadline, "the silent session never ended"
            time.sleep(0.5)
        assert answer.status_code == 400 and "unloaded" in answer.json()["detail"]
        assert time.monotonic() - started >= 3
    finally:
        srv.stop()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))
