"""Faults, end to end: the training worker is SIGKILLed mid-request, or runs out of memory;
clients hang up mid-poll.

Only the request that was running fails (``category: server``, saying what happened). After a
death the worker is replaced, a model with a saved training state is restored from it, one
without is reported lost; after an out-of-memory error the worker and the model stay as they
were. Either way the next requests succeed.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.faults import HEAVY, SMALL, cpu_seconds, datum, forward_logprobs, health, wait_until_computing  # noqa: F401
from tests.support.server import ALIAS, start_server
from tests.support.wire import Api, fwdbwd_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    srv = start_server(tmp_path_factory.mktemp("faults"))
    yield srv
    srv.stop()


def kill_worker_when_busy(base_url: str) -> int:
    """SIGKILL the worker once it is running a request; its pid."""
    pid = health(base_url)["worker"]["pid"]
    wait_until_computing(base_url, pid)
    os.kill(pid, signal.SIGKILL)
    return pid


def test_sigkill_mid_forward_backward_fails_only_that_request(server):
    service = tinker.ServiceClient(base_url=server.base_url)
    saved = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    unsaved = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=2).result()
    bystander = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
    for tc in (saved, unsaved, bystander):
        tc.forward_backward(SMALL, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    path = saved.save_state("before-crash").result().path
    bystander_path = bystander.save_state("bystander").result().path
    at_save = forward_logprobs(saved)
    saved.forward_backward(SMALL, "cross_entropy").result()
    saved.optim_step(ADAM).result()
    assert not np.array_equal(forward_logprobs(saved), at_save)  # trained on past the checkpoint

    doomed = saved.forward_backward(HEAVY, "cross_entropy")
    pid = kill_worker_when_busy(server.base_url)
    with pytest.raises(tinker.RequestFailedError) as failure:
        doomed.result()
    message = str(failure.value)
    assert failure.value.category == types.RequestErrorCategory.Server
    assert f"pid {pid}) was killed by SIGKILL" in message
    assert f"was restored from {path} (optimizer step 1)" in message

    worker = health(server.base_url)["worker"]
    assert worker["alive"] and worker["restarts"] == 1 and worker["pid"] != pid
    # The saved model is back exactly as checkpointed, and trains on.
    np.testing.assert_array_equal(forward_logprobs(saved), at_save)
    saved.forward_backward(SMALL, "cross_entropy").result()
    assert saved.optim_step(ADAM).result().metrics["optimizer_step"] == 2.0

    # A model that was only a bystander is back at its checkpoint too: its next request says so, once.
    with pytest.raises(tinker.RequestFailedError) as rolled_back:
        bystander.forward_backward(SMALL, "cross_entropy").result()
    assert rolled_back.value.category == types.RequestErrorCategory.Server
    assert "while running another request" in str(rolled_back.value)
    assert f"was restored from {bystander_path}" in str(rolled_back.value)
    bystander.forward_backward(SMALL, "cross_entropy").result()

    # The unsaved model is lost, and says so.
    with pytest.raises(tinker.BadRequestError, match="was lost"):
        unsaved.forward_backward(SMALL, "cross_entropy").result()
    # New models and sampling work on the new worker.
    fresh = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=4).result()
    fresh.forward_backward(SMALL, "cross_entropy").result()
    sampler = service.create_sampling_client(base_model=ALIAS)
    prompt = types.ModelInput.from_ints([1, 2, 3])
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(out.sequences[0].tokens) == 4
    assert health(server.base_url)["status"] == "ok"


def test_sigkill_while_idle_is_repaired_without_failing_anything(server):
    pid = health(server.base_url)["worker"]["pid"]
    restarts = health(server.base_url)["worker"]["restarts"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (worker := health(server.base_url)["worker"])["restarts"] == restarts:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert worker["pid"] != pid and "killed by SIGKILL" in worker["last_death"]
    tc = tinker.ServiceClient(base_url=server.base_url).create_lora_training_client(base_model=ALIAS, rank=4).result()
    tc.forward_backward(SMALL, "cross_entropy").result()


def test_client_that_hangs_up_mid_poll_loses_nothing(server):
    api = Api(server.base_url)
    request_id = api.fwdbwd(fwdbwd_body(api.new_model(), 1, n_datums=16, length=2048))

    def hang_up() -> None:  # give up in the middle of the long poll, as a dropped client would
        with pytest.raises(httpx.ReadTimeout):
            api.http.post("/api/v1/retrieve_future", json={"request_id": request_id}, timeout=0.3)

    threads = [threading.Thread(target=hang_up) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result = api.result(request_id)  # the result was kept for whoever asks next
    assert len(result.loss_fn_outputs) == 16
    assert health(server.base_url)["status"] == "ok"


def test_out_of_memory_fails_only_that_request_and_changes_nothing(tmp_path, tiny_model_dir):
    """The worker's address space is capped (prlimit) just above what it uses, so a heavy batch
    fails to allocate, as on a full GPU: that request fails with a plain out-of-memory message,
    the same worker stays, and the model, its accumulated gradients included, is untouched.
    A server of its own: a worker that has run heavy batches keeps their freed memory mapped."""
    server = start_server(tmp_path)
    try:
        _out_of_memory(server)
    finally:
        server.stop()


def _out_of_memory(server) -> None:
    service = tinker.ServiceClient(base_url=server.base_url)
    victim, twin = (service.create_lora_training_client(base_model=ALIAS, rank=4, seed=7).result() for _ in range(2))
    for tc in (victim, twin):
        tc.forward_backward(SMALL, "cross_entropy").result()  # gradients waiting for optim_step
    worker = health(server.base_url)["worker"]
    used = _address_space_bytes(worker["pid"])
    resource.prlimit(worker["pid"], resource.RLIMIT_AS, (used + (64 << 20), resource.RLIM_INFINITY))
    try:
        doomed = victim.forward_backward(HEAVY, "cross_entropy")
        with pytest.raises(tinker.RequestFailedError) as failure:
            doomed.result()
    finally:
        resource.prlimit(worker["pid"], resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert failure.value.category == types.RequestErrorCategory.Server
    assert "out of memory" in str(failure.value) and "the model is as it was" in str(failure.value)
    after = health(server.base_url)["worker"]
    # the same process, never restarted (its memory, which each answer reports, has moved)
    assert {**after, "ranks": None} == {**worker, "ranks": None}
    assert [r["pid"] for r in after["ranks"]] == [r["pid"] for r in worker["ranks"]] == [worker["pid"]]

    for tc in (victim, twin):
        tc.optim_step(ADAM).result()
    np.testing.assert_array_equal(forward_logprobs(victim), forward_logprobs(twin))


def _address_space_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    return kib << 10
