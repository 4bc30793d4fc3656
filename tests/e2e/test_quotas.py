"""Per-key limits (``server.quotas``), end to end: set by the operator with ``serve --key-limit``
and ``keys create --limit`` / ``keys limit``, shown by ``keys show``, and enforced on the real
SDK and raw HTTP with a body that names the limit and its value, nothing half-created."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.cli import cli
from tests.support.server import ALIAS, start_server
from tests.support.wire import Api, fwdbwd_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    data = tmp_path_factory.mktemp("quotas")

    def key(name: str, *limits: str) -> str:
        return cli("keys", "create", "--data-dir", str(data), "--name", name, *[f"--limit={x}" for x in limits]).stdout

    keys = {
        "plain": key("plain").strip(),
        "tight": key("tight", "models=1", "lora_rank=8", "metadata_bytes=200", "checkpoint_bytes=1").strip(),
        "slow": key("slow", "requests_per_s=1").strip(),
        "queue": key("queue", "pending=3").strip(),
        "beats": key("beats", "requests_per_s=1").strip(),
        "bytes": key("bytes", "pending_bytes=20000").strip(),
        "ckpt": key("ckpt", "checkpoint_bytes=200000").strip(),
        "ckpt2": key("ckpt2", "checkpoint_bytes=200000").strip(),
        "losses": key("losses", "custom_loss_bytes=20000").strip(),
    }
    srv = start_server(data, "--model", str(tiny_model_dir), "--key-limit", "sessions=2")
    yield srv, keys, data
    srv.stop()


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )


def test_keys_show_and_limit_say_each_limit_and_where_it_comes_from(server):
    _, _, data = server
    shown = cli("keys", "show", "tight", "--data-dir", str(data)).stdout
    assert "models             1  (this key's own)" in shown
    assert "sessions           64  (the server's default" in shown
    assert "pending            --max-pending / 4  (the server's default" in shown
    assert "pending_bytes      --max-pending-bytes / 4  (the server's default" in shown
    changed = cli("keys", "limit", "tight", "sessions=5", "models=default", "--data-dir", str(data)).stdout
    assert "sessions           5  (this key's own)" in changed and "models             16  (the server's" in changed
    cli("keys", "limit", "tight", "sessions=default", "models=1", "--data-dir", str(data))
    bad = cli("keys", "limit", "tight", "colour=3", "--data-dir", str(data), check=False)
    assert bad.returncode != 0 and "NAME one of sessions, models" in bad.stderr
    negative = cli("keys", "create", "--limit", "models=-1", "--data-dir", str(data), check=False)
    assert negative.returncode != 0 and "models" in negative.stderr
    wrong = cli("serve", "--key-limit", "models=many", "--data-dir", str(data), check=False)
    assert wrong.returncode != 0 and "--key-limit: models" in wrong.stderr


def test_live_sessions_are_limited_and_a_finished_one_frees_its_place(server):
    """--key-limit sessions=2 holds every key without its own: the third is a 403 naming it,
    through raw HTTP and the SDK; finishing one frees its place."""
    srv, keys, _ = server
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": keys["plain"]}) as c:
        opened = [c.post("/api/v1/create_session", json={"tags": []}).json()["session_id"] for _ in range(2)]
        r = c.post("/api/v1/create_session", json={"tags": []})
        assert r.status_code == 403, r.text
        assert "limit sessions reached: at most 2 live sessions for this key" in r.json()["detail"]
        with pytest.raises(tinker.PermissionDeniedError, match="limit sessions"):
            with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["plain"]) as sc:
                sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        finished = c.post(f"/api/v1/sessions/{opened[0]}/finish", json={"reason": {"type": "success"}})
        assert finished.status_code == 200, finished.text
        with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["plain"]) as sc:
            sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        c.post(f"/api/v1/sessions/{opened[1]}/finish", json={"reason": {"type": "success"}})


def test_models_rank_and_metadata_are_limited_with_nothing_half_created(server):
    srv, keys, _ = server
    with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["tight"]) as sc:
        with pytest.raises(tinker.BadRequestError, match="limit lora_rank reached: at most 8"):
            sc.create_lora_training_client(base_model=ALIAS, rank=16).result()
        with pytest.raises(tinker.BadRequestError, match="limit metadata_bytes reached: at most 200"):
            sc.create_lora_training_client(base_model=ALIAS, rank=4, user_metadata={"note": "x" * 300}).result()
        with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["plain"]) as other:  # rank 16, published
            big = other.create_lora_training_client(base_model=ALIAS, rank=16).result().save_state("big").result()
            other.create_rest_client().publish_checkpoint_from_tinker_path(big.path).result()
        with pytest.raises(tinker.BadRequestError, match="limit lora_rank reached: at most 8"):
            sc.create_training_client_from_state(big.path).result()  # its rank is the checkpoint's
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8).result()
        with pytest.raises(tinker.PermissionDeniedError, match="limit models reached: at most 1 live training"):
            sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        assert tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"] > 0
        runs = sc.create_rest_client().list_training_runs().result().training_runs
        assert [r.training_run_id for r in runs] == [tc.get_info().model_id]  # the refused ones left nothing


def test_stored_checkpoint_bytes_never_pass_the_limit_however_many_saves_race(server):
    """The audit: checkpoint_bytes=200000 and 60 saves at once stored 29.85 MB (each was checked
    when submitted, against what was stored then). A save now reserves its likely size when
    submitted and settles its true size before it is written, under one lock: of 20 concurrent
    ~93 KB sampler saves exactly two are stored, the others fail naming the limit (nothing of them
    written); once the size is known a new save is refused at once (403); the refused saves used
    up their seq_ids, a sampler snapshot is not stored, and deleting frees the space."""
    srv, keys, _ = server
    with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["ckpt"]) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        rest = tinker.RestClient(base_url=srv.base_url, api_key=keys["ckpt"])
        saved = []
        for future in [tc.save_weights_for_sampler(f"s{i}") for i in range(20)]:
            try:
                saved.append(future.result().path)
            except (tinker.RequestFailedError, tinker.PermissionDeniedError) as e:
                assert "limit checkpoint_bytes reached: at most 200000 bytes" in str(e)
        assert len(saved) == 2
        stored = rest.list_checkpoints(tc.get_info().model_id).result().checkpoints
        assert [c.tinker_path for c in stored] == saved[::-1] and sum(c.size_bytes for c in stored) <= 200000
        with pytest.raises(tinker.PermissionDeniedError, match="limit checkpoint_bytes reached: at most 200000 bytes"):
            tc.save_weights_for_sampler("third").result()
        assert tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"] > 0
        tc.save_weights_and_get_sampling_client().result()  # a sampler's snapshot is not stored
        rest.delete_checkpoint_from_tinker_path(saved[0]).result()
        assert tc.save_weights_for_sampler("again").result().path.endswith("/again")


def test_a_save_that_never_runs_lets_its_reservation_go(server):
    """From a review: a save queued behind a missing seq_id reserved its bytes, and its model's
    unloading dropped it without running it: the reservation stayed until a restart, refusing
    later saves that fit. A request's reservation now goes with it however it ends."""
    srv, keys, _ = server
    api = Api(srv.base_url)
    api.http.headers["X-API-Key"] = keys["ckpt2"]
    model = api.new_model()
    save = {"model_id": model, "seq_id": 1, "path": "first"}
    assert api.result(api.post("save_weights_for_sampler", json=save).json()["request_id"])["path"]
    waiting = api.post("save_weights_for_sampler", json={**save, "seq_id": 3, "path": "never"}).json()
    assert api.result(api.post("unload_model", json={"model_id": model}).json()["request_id"]) is not None
    dropped = api.poll(waiting["request_id"]).json()
    assert "before this request ran" in dropped["error"]
    other = api.new_model()  # its first save: ~93 KB more fits under 200,000 unless the dropped one's is still held
    body = {"model_id": other, "seq_id": 1, "path": "second"}
    stored = api.result(api.post("save_weights_for_sampler", json=body).json()["request_id"])
    assert stored.get("path", "").endswith("/second"), stored


def _loss(k: int):
    """A loss of its own for each ``k`` (the SDK refuses to make the same one twice)."""

    def loss(logprobs):
        return -(logprobs * (k + 1)).sum(), {}

    return loss


def test_custom_losses_are_limited_per_session_and_per_key(server):
    """The audit stored 200 graphs of 1 MiB in 5.4 s (+189 MB of SQLite). A session stores at
    most 64 losses; a key at most custom_loss_bytes over its unfinished sessions (403 naming the
    limit); a finished session's losses go, freeing the key's bytes."""
    srv, keys, _ = server
    with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["plain"]) as sc:
        for k in range(64):
            sc.create_custom_loss(_loss(k), input_ranks={"logprobs": 1}).result()
        with pytest.raises(tinker.PermissionDeniedError, match="stores 64 custom losses, the most a session may"):
            sc.create_custom_loss(_loss(64), input_ranks={"logprobs": 1}).result()
    for _ in range(2):  # the second session may store again: the first one's losses went with it
        with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["losses"]) as sc:
            made = 0
            with pytest.raises(tinker.PermissionDeniedError, match="limit custom_loss_bytes reached: at most 20000"):
                while made < 64:
                    sc.create_custom_loss(_loss(made), input_ranks={"logprobs": 1}).result()
                    made += 1
            assert 0 < made < 64


def test_requests_per_second_are_limited_by_a_429_the_sdk_waits_out(server):
    srv, keys, _ = server
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": keys["slow"]}) as c:
        answers = [c.get("/api/v1/training_runs") for _ in range(15)]  # the burst is 10 s' worth: 10
        refused = [r for r in answers if r.status_code == 429]
        assert refused and all(r.status_code == 200 for r in answers[:10])
        assert "limit requests_per_s reached" in refused[0].json()["detail"] and refused[0].headers["retry-after"]
        assert httpx.get(f"{srv.base_url}/healthz").status_code == 200  # others are not held up
        other = httpx.get(f"{srv.base_url}/api/v1/training_runs", headers={"X-API-Key": keys["plain"]})
        assert other.status_code == 200
    with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["slow"]) as sc:  # retried past the 429s
        sc.create_lora_training_client(base_model=ALIAS, rank=4).result()


def test_one_key_cannot_fill_the_servers_queue(server):
    """pending=3: requests of a key that wait for a seq_id it has not sent hold at most 3 places
    (else one key could take all of --max-pending, for good); the next is a 429 naming the limit
    while another key trains; the awaited request still gets in, and runs the rest."""
    srv, keys, _ = server
    api = Api(srv.base_url)
    api.http.headers["X-API-Key"] = keys["queue"]
    model = api.new_model()
    waiting = [api.fwdbwd(fwdbwd_body(model, seq)) for seq in (2, 3, 4)]  # each waits for seq 1
    proto = {"Content-Type": "application/x-protobuf"}
    refused = api.post("forward_backward", content=fwdbwd_body(model, 5), headers=proto)
    assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
    assert "limit pending reached: this key has 3 requests pending" in refused.json()["detail"]
    assert httpx.get(f"{srv.base_url}/healthz").json()["queue"]["pending_busiest_key"] == 3
    with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["plain"]) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        assert tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"] > 0
    for request_id in (api.fwdbwd(fwdbwd_body(model, 1)), *waiting):  # over the limit, but awaited
        assert not isinstance(api.result(request_id), dict)  # a ForwardBackwardOutput, not an error
    assert not isinstance(api.result(api.fwdbwd(fwdbwd_body(model, 5))), dict)  # seq 5 was not used up


def test_heartbeats_are_rated_in_a_bucket_of_their_own(server):
    """A flood of heartbeats (each a database write) is held to the key's rate, in its own bucket:
    the key's other calls go on, and a busy key's heartbeats are not refused for its other calls."""
    srv, keys, _ = server
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": keys["beats"]}) as c:
        session = c.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        beats = [c.post("/api/v1/session_heartbeat", json={"session_id": session}) for _ in range(15)]
        assert all(r.status_code == 200 for r in beats[:10]), [r.text for r in beats[:10]]
        assert any(r.status_code == 429 and "requests_per_s" in r.json()["detail"] for r in beats[10:])
        assert c.get("/api/v1/training_runs").status_code == 200  # the other bucket is untouched


def test_one_key_cannot_fill_the_servers_memory_with_waiting_batches(server):
    """pending_bytes: the batches of a key's pending forward_backward requests hold at most that
    many bytes (an early arrival keeps its decoded batch until its turn); past it a 429 names the
    limit; the awaited request still gets in, and the refused seq_id is not used up."""
    srv, keys, _ = server
    api = Api(srv.base_url)
    api.http.headers["X-API-Key"] = keys["bytes"]
    model = api.new_model()
    bodies = {seq: fwdbwd_body(model, seq, n_datums=4, length=128) for seq in range(1, 5)}
    assert 6000 < len(bodies[2]) < 10000  # two fit in 20,000 bytes, three do not
    waiting = [api.fwdbwd(bodies[seq]) for seq in (2, 3)]
    proto = {"Content-Type": "application/x-protobuf"}
    refused = api.post("forward_backward", content=bodies[4], headers=proto)
    assert refused.status_code == 429 and "limit pending_bytes reached" in refused.json()["detail"], refused.text
    assert httpx.get(f"{srv.base_url}/healthz").json()["queue"]["pending_bytes"] == len(bodies[2]) + len(bodies[3])
    for request_id in (api.fwdbwd(bodies[1]), *waiting):  # over the limit, but awaited: it runs the others
        assert not isinstance(api.result(request_id), dict)  # a ForwardBackwardOutput, not an error
    assert not isinstance(api.result(api.fwdbwd(bodies[4])), dict)  # room again; seq 4 was not used up


def test_a_keys_adapters_are_limited_by_the_worker_memory_they_take(server):
    """``adapter_bytes``: what a key's live models' LoRA take on the workers (weights, gradients,
    AdamW's moments, float32), sized from the served model's per-rank counts (``/healthz``): a
    rank-4 adapter and an attention-only one fit in twice a rank-4 one's bytes, a second full
    rank-4 one does not; the refusal names the limit and the sizes; the models made still train."""
    srv, _, data = server
    caps = httpx.get(f"{srv.base_url}/healthz", timeout=10).raise_for_status().json()["capabilities"]
    per_rank = caps["lora_params_per_rank"]
    assert set(per_rank) == set(caps["lora_groups"]) and all(v > 0 for v in per_rank.values())
    full = 4 * sum(per_rank.values()) * 16
    key = cli("keys", "create", "--data-dir", str(data), "--limit", f"adapter_bytes={2 * full}").stdout.strip()
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        sc.create_lora_training_client(base_model=ALIAS, rank=4, train_mlp=False, train_unembed=False).result()
        with pytest.raises(tinker.PermissionDeniedError) as refused:
            sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        message = str(refused.value)
        assert f"limit adapter_bytes reached: at most {2 * full}" in message and f"this one takes {full}" in message
        tc.forward_backward([datum()], "cross_entropy").result()
