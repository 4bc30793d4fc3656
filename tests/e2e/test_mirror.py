"""``--checkpoint-mirror`` (``server.mirror``) with fsspec's local filesystem standing in for the
bucket: server A's checkpoints are copied up; server B, on an empty disk with a first-boot key of
its own (a new VM), restores them with A's key, so that A's tenant goes on (the next step of a
resumed run equals A's exactly, a published checkpoint is still published, a copy_weights run is
there) and B's key sees nothing of it; a copy that fails its SHA-256 check is refused, and a
deletion on B deletes the mirror's copy."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
    loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
)


def step(tc: tinker.TrainingClient) -> float:
    loss = tc.forward_backward([DATUM], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return loss


def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.1)


def mirror_status(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.base_url}/healthz", timeout=10).json()["checkpoint_mirror"]


def record_of(bucket: Path, path: str) -> str:
    record = bucket / path.removeprefix("tinker://") / "record.json"
    return record.read_text() if record.exists() else ""


def new_key(data_dir: Path) -> str:
    command = [sys.executable, "-m", "hosted_tinker", "keys", "create", "--data-dir", str(data_dir)]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_checkpoints_outlive_the_disk(tmp_path: Path, tiny_model_dir: Path):
    bucket = tmp_path / "bucket"
    mirror = ["--model", str(tiny_model_dir), "--checkpoint-mirror", f"file://{bucket}"]
    key = new_key(tmp_path / "a")
    a = start_server(tmp_path / "a", *mirror)
    try:
        with tinker.ServiceClient(base_url=a.base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
            step(tc)
            state = tc.save_state("kept").result().path
            sampler = tc.save_weights_for_sampler("spoiled").result().path
            expected = step(tc)  # what the step after the checkpoint gives
        rest_a = tinker.RestClient(base_url=a.base_url, api_key=key)
        copy = rest_a.copy_weights(state, destination_project_id="copies").result()
        until(lambda: mirror_status(a)["uploaded"] == 3 and (bucket / "api_keys.json").exists(), "copying up")
        rest_a.publish_checkpoint_from_tinker_path(state).result()
        until(lambda: '"public": true' in record_of(bucket, state), "the copy's record following the publish")
    finally:
        a.stop()
    run = state.removeprefix("tinker://").split("/")[0]
    spoiled = bucket / run / "sampler_weights" / "spoiled" / "adapter_model.safetensors"
    spoiled.write_bytes(spoiled.read_bytes()[:-1] + b"\0")

    other_key = new_key(tmp_path / "b")  # an empty disk and a first-boot key of its own: a new VM
    b = start_server(tmp_path / "b", *mirror)
    try:
        other = tinker.RestClient(base_url=b.base_url, api_key=other_key)
        with pytest.raises(tinker.NotFoundError):  # the new VM's own tenant owns nothing of A's
            other.get_training_run(run).result()
        assert [c.tinker_path for c in other.list_checkpoints(run).result().checkpoints] == [state]  # A published it
        rest = tinker.RestClient(base_url=b.base_url, api_key=key)
        listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
        assert listed.keys() == {state}  # the spoiled copy was not restored
        assert listed[state].public  # as it was when A stopped
        copied = rest.list_checkpoints(copy.removeprefix("tinker://").split("/")[0]).result().checkpoints
        assert [c.tinker_path for c in copied] == [copy]  # copy_weights' run came back too
        assert "fails its SHA-256 check" in b.log_path.read_text()
        with tinker.ServiceClient(base_url=b.base_url, api_key=key) as sc:
            resumed = sc.create_training_client_from_state_with_optimizer(state).result()
            assert step(resumed) == expected
        rest.delete_checkpoint_from_tinker_path(state).result()
        until(lambda: not (bucket / run / "weights" / "kept").exists(), "deleting the mirror's copy")
    finally:
        b.stop()
    assert sampler  # saved on A; its copy is the spoiled one
