"""The multi-rank backends behind the real server (issues #7, #16): ddp on two gloo ranks and
megatron at tp=2. Start-up checks of devices and options, bit-identical resume, sampling and
sampler weights from rank 0, and a rank killed mid-step.

The core SDK suite runs on both too (``test_sdk_training.py``); the math against one process is
pinned in ``test_plans.py`` and ``test_ddp.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import tinker
from tinker import types

from tests.support.faults import (
    SMALL,
    forward_logprobs,
    kill_a_rank_mid_step,
    serve_fails,  # noqa: F401
)
from tests.support.server import ALIAS, start_server
from tests.support.training import assert_identical, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ADAM = types.AdamParams(learning_rate=1e-2)


# backend -> its extra options, and every option as /healthz then shows it
BACKENDS = {
    "ddp": (
        (),
        {
            "microbatch_tokens": 4096,
            "recompute_above_tokens": 8192,
            "activation_memory_gib": None,
            "collective_timeout_s": 1800.0,
        },
    ),
    # megatron under a memory budget (rank.activations: a first pass stores one layer and measures
    # it, then the budget decides): its tensor-parallel ranks must agree on what they recompute
    "megatron": (
        ("--backend-option", "tp=2", "--backend-option", "activation_memory_gib=0.0005"),
        {
            "microbatch_tokens": 4096,
            "recompute_above_tokens": 8192,
            "activation_memory_gib": 0.0005,
            "collective_timeout_s": 1800.0,
            "tp": 2,
            "ep": 1,
            "sequence_parallel": False,
            "layers": "auto",
            "embedded_sampler": True,
        },
    ),
}


@pytest.fixture(scope="module", params=list(BACKENDS))
def server(request, tmp_path_factory, tiny_model_dir):
    extra, _ = BACKENDS[request.param]
    srv = start_server(
        tmp_path_factory.mktemp(f"{request.param}-server"),
        "--backend",
        request.param,
        "--train-devices",
        "cpu:2",
        "--backend-option",
        "microbatch_tokens=4096",
        *extra,
    )
    srv.backend = request.param
    yield srv
    srv.stop()


def health(base_url: str) -> dict:
    return httpx.get(f"{base_url}/healthz", timeout=5).json()


def test_devices_and_options_are_checked_at_start_up(tmp_path):
    assert "peft backend trains on one device" in serve_fails(tmp_path, "--train-devices", "cpu:2")
    said = serve_fails(tmp_path, "--backend", "ddp", "--train-devices", "cpu:2", "--backend-option", "bucket_mb=25")
    assert "bucket_mb" in said and "collective_timeout_s" in said  # the unknown one, and what it accepts
    assert "expected KEY=VALUE" in serve_fails(tmp_path, "--backend", "ddp", "--backend-option", "nothing")
    assert "train devices 'gpu:1'" in serve_fails(tmp_path, "--backend", "ddp", "--train-devices", "gpu:1")
    said = serve_fails(tmp_path, "--backend-option", "microbatch_tokens=many")
    assert "microbatch_tokens" in said
    said = serve_fails(tmp_path, "--backend-option", "activation_memory_gib=auto")
    assert "activation_memory_gib=auto needs GPU ranks" in said
    said = serve_fails(
        tmp_path, "--backend-option", "activation_memory_gib=4", "--backend-option", "recompute_above_tokens=0"
    )
    assert "activation_memory_gib or recompute_above_tokens, not both" in said
    said = serve_fails(tmp_path, "--backend", "ddp", "--train-devices", "cpu:2", "--worker-timeout", "600")
    assert "collective_timeout_s=1800 must be below --worker-timeout (600 s)" in said
    megatron = ("--backend", "megatron", "--train-devices")
    said = serve_fails(tmp_path, *megatron, "cpu:3", "--backend-option", "tp=2")
    assert "tp=2 does not divide the 3 ranks" in said
    said = serve_fails(tmp_path, *megatron, "cpu:2", "--backend-option", "sequence_parallel=true")
    assert "sequence_parallel=true needs tp > 1" in said
    said = serve_fails(tmp_path, *megatron, "cpu:2", "--backend-option", "tp=2", "--backend-option", "layers=te")
    assert "layers=te needs GPU ranks" in said


def test_tp_must_divide_the_model(tmp_path, tiny_model_dir):
    """The tiny model has 4 heads and 2 kv heads: tp=4 is refused at start-up, naming them."""
    said = serve_fails(
        tmp_path,
        "--model",
        str(tiny_model_dir),
        "--backend",
        "megatron",
        "--train-devices",
        "cpu:4",
        "--backend-option",
        "tp=4",
    )
    assert "tp=4 does not divide the model's kv heads (2)" in said


def test_backends_command_lists_the_backends_and_their_options():
    out = subprocess.run(
        [sys.executable, "-m", "hosted_tinker", "backends"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert '"ddp"' in out and "collective_timeout_s" in out and "--train-devices" in out
    assert '"megatron"' in out and "tensor-parallel size" in out and "embedded_sampler" in out
    assert "expert-parallel size" in out
    info = json.loads(out)  # every backend runs the shared trainer: the same losses and optimizers
    for backend in ("peft", "ddp", "megatron"):
        assert "stable_reinforce" in info[backend]["losses"] and info[backend]["custom_losses"]
        assert info[backend]["optimizers"] == ["adamw", "dimuon"]
    assert "Qwen3MoeForCausalLM" in info["megatron"]["models"] and "ep > 1" in info["megatron"]["models"]
    assert "mixture of experts" in info["peft"]["models"] and info["ddp"]["models"] == info["peft"]["models"]


def test_health_shows_the_ranks_and_options(server):
    h = health(server.base_url)
    assert h["capabilities"]["backend"] == server.backend and h["capabilities"]["devices"] == ["cpu", "cpu"]
    assert h["backend_options"] == BACKENDS[server.backend][1]
    assert len(h["worker"]["pids"]) == 2 and h["worker"]["alive"]


def test_resume_with_optimizer_is_bit_identical(server):
    with tinker.ServiceClient(base_url=server.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=0).result()
        train(tc, 2)
        path = tc.save_state("ddp-resume").result().path
        uninterrupted = train(tc, 3)
        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        assert_identical(train(resumed, 3), uninterrupted)


def test_sampling_and_sampler_weights(server):
    with tinker.ServiceClient(base_url=server.base_url) as sc:
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=3).result()
        train(tc, 2)
        sampler = tc.save_weights_and_get_sampling_client("ddp-sampler")
        prompt = types.ModelInput.from_ints([11, 12, 13])
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, temperature=1.0, seed=4)).result()
        assert [len(s.tokens) for s in out.sequences] == [5, 5]
        # The sampled tokens' logprobs are the trainer's (rank 0's adapter, which every rank shares).
        seq = out.sequences[0]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([11, 12, 13, *seq.tokens[:-1]]),
            loss_fn_inputs={"target_tokens": [12, 13, *seq.tokens], "weights": [1.0] * (2 + len(seq.tokens))},
        )
        trainer = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert max(abs(a - b) for a, b in zip(trainer[2:], seq.logprobs, strict=True)) < 1e-4


def test_a_rank_killed_mid_step_fails_that_request_and_the_group_comes_back(server):
    service = tinker.ServiceClient(base_url=server.base_url)
    tc = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    tc.forward_backward(SMALL, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    path = tc.save_state("before-the-kill").result().path
    at_save = forward_logprobs(tc)

    failure, old = kill_a_rank_mid_step(tc, server.base_url, rank=1)
    assert failure.category == types.RequestErrorCategory.Server
    assert f"training rank 1 (pid {old[1]}) was killed by SIGKILL" in str(failure)
    assert f"was restored from {path}" in str(failure)

    worker = health(server.base_url)["worker"]
    assert worker["alive"] and worker["restarts"] == 1 and not set(worker["pids"]) & set(old)
    assert forward_logprobs(tc).tolist() == at_save.tolist()  # back at its checkpoint, on both ranks
    tc.forward_backward(SMALL, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["optimizer_step"] == 2.0
    assert health(server.base_url)["status"] == "ok"
