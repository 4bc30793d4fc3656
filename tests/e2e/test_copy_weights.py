"""``copy_weights`` through the real SDK: a checkpoint copied into a new run that shares its files,
loads and samples exactly like the source, cannot be trained on, and is made once per
idempotency key."""

from __future__ import annotations

import os
import uuid

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, ServerProcess
from tests.support.training import assert_identical, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def files_of(server: ServerProcess, path: str) -> dict[str, os.stat_result]:
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    directory = server.data_dir / "checkpoints" / run_id / kind / name
    return {p.name: p.stat() for p in directory.iterdir()}


def test_a_copy_is_the_same_checkpoint_in_a_run_of_its_own(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=4).result()
        train(tc, 2)
        state = tc.save_state("to-copy").result().path
        sampler = tc.save_weights_for_sampler("to-copy").result().path
        expected = train(tc, 2)
        rest = sc.create_rest_client()

        copied = rest.copy_weights(state, "proj-archive", ttl_seconds=7200).result()
        assert copied != state and copied.endswith("/weights/to-copy")
        run_id = copied.removeprefix("tinker://").split("/")[0]
        # the same files, not new bytes: hard links to the source's
        src, dst = files_of(server, state), files_of(server, copied)
        assert src.keys() == dst.keys() and all(src[n].st_ino == dst[n].st_ino for n in src)
        info = rest.get_weights_info_by_tinker_path(copied).result()
        assert info.base_model == ALIAS and info.lora_rank == 8
        (ckpt,) = rest.list_checkpoints(run_id).result().checkpoints
        assert ckpt.expires_at is not None  # its own TTL, not the source's

        # it resumes exactly as the source does, and its run cannot be trained on
        resumed = sc.create_training_client_from_state_with_optimizer(copied).result()
        assert_identical(train(resumed, 2), expected)
        r = httpx.post(
            f"{server.base_url}/api/v1/optim_step",
            json={"model_id": run_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
            headers={"X-API-Key": "tml-x"},
        )
        assert r.status_code == 400 and "cannot be trained on" in r.json()["detail"]

        # a sampler checkpoint, copied by ServiceClient into its own project, samples the same
        archive = tinker.ServiceClient(base_url=server.base_url, project_id="proj-archive")
        try:
            sampler_copy = archive.copy_weights(sampler).result()
        finally:
            archive.close("success").result()
        prompt = types.ModelInput.from_ints(list(range(10, 20)))
        greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        a = sc.create_sampling_client(model_path=sampler).result().sample(prompt, 1, greedy).result()
        b = sc.create_sampling_client(model_path=sampler_copy).result().sample(prompt, 1, greedy).result()
        assert a.sequences[0].tokens == b.sequences[0].tokens

        # deleting the source leaves the copy whole
        rest.delete_checkpoint_from_tinker_path(sampler).result()
        sc.create_sampling_client(model_path=sampler_copy).result().sample(prompt, 1, greedy).result()


def test_retries_and_destinations(server: ServerProcess) -> None:
    headers = {"X-API-Key": "tml-x"}
    with tinker.ServiceClient(base_url=server.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        state = tc.save_state("retry").result().path
        session_id = tc.get_info().model_id.split(":")[0]

        def post(body: dict, key: str | None = None) -> httpx.Response:
            extra = {"X-Idempotency-Key": key} if key else {}
            return httpx.post(f"{server.base_url}/api/v1/copy_weights", json=body, headers={**headers, **extra})

        key = str(uuid.uuid4())
        body = {"source_path": state, "destination_project_id": "proj-b"}
        first, again = post(body, key), post(body, key)
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json()  # a retry with the same key: the same copy
        assert post(body, str(uuid.uuid4())).json() != first.json()  # another key, another copy

        into = {"source_path": state, "session_id": session_id, "model_seq_id": 9}
        made = post(into)
        assert made.status_code == 200 and made.json()["tinker_path"] == f"tinker://{session_id}:train:9/weights/retry"
        assert post(into).json() == made.json()
        taken = post({**into, "model_seq_id": 0})  # the training client's own run
        assert taken.status_code == 409 and "already exists" in taken.json()["detail"]

        for bad, status, field in [
            ({"source_path": state}, 400, "destination_project_id"),
            ({"source_path": state, "session_id": session_id}, 400, "model_seq_id"),
            ({**body, "ttl_seconds": 5}, 400, "ttl_seconds"),
            ({**body, "source_path": "tinker://nope:train:0/weights/x"}, 404, "source_path"),
            ({**body, "source_path": "not-a-path"}, 400, "path"),
            ({**body, "weights_access_token": "t"}, 400, "weights_access_token"),
        ]:
            r = post(bad)
            assert r.status_code == status and field in r.json()["detail"], (bad, r.text)
