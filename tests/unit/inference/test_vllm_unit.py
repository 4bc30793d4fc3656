"""The vLLM engine's parts without vLLM: request/response mapping, adapter bookkeeping, LoRA sync,
launch command, and the supervisor's restart loop (against a stand-in server process)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import stat
import sys
from collections.abc import Callable

import httpx
import pytest
import torch

import hosted_tinker.inference.vllm_adapters as vllm_adapters
import hosted_tinker.inference.vllm_process as vllm_process
from hosted_tinker.core.config import ServerConfig, visible_gpu
from hosted_tinker.core.errors import EngineUnavailable
from hosted_tinker.core.sampling import SampleSpec
from hosted_tinker.inference.lora_sync import LiveAdapters
from hosted_tinker.inference.vllm_adapters import AdapterRegistry
from hosted_tinker.inference.vllm_engine import needs_embedded, parse_response, request_body
from hosted_tinker.inference.vllm_process import EngineState, VllmLaunch, VllmSupervisor, free_port

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


# ---- SampleSpec <-> /v1/completions ---------------------------------------------------------


def test_request_body_carries_every_sampling_parameter():
    spec = SampleSpec(
        prompt=[1, 2, 3],
        max_tokens=7,
        num_samples=3,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        seed=11,
        stop_token_ids=frozenset({9, 4}),
        stop_strings=("\n\n",),
        topk_sample_logprobs=2,
    )
    body = request_body("ht-1", spec)
    assert body["model"] == "ht-1" and body["prompt"] == [1, 2, 3] and body["n"] == 3
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["top_p"], body["seed"]) == (
        7,
        0.7,
        20,
        0.9,
        11,
    )
    assert body["stop_token_ids"] == [4, 9] and body["stop"] == ["\n\n"] and body["ignore_eos"] is True
    assert body["logprobs"] == 2 and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert "seed" not in request_body("x", SampleSpec(prompt=[1], max_tokens=1))


def test_greedy_sampling_asks_vllm_for_one_sample():
    # vLLM refuses n > 1 below its greedy temperature; the engine repeats the one answer instead.
    for temperature in (0.0, 1e-6):
        assert request_body("x", SampleSpec(prompt=[1], max_tokens=1, num_samples=4, temperature=temperature))["n"] == 1
    assert request_body("x", SampleSpec(prompt=[1], max_tokens=1, num_samples=4, temperature=1e-4))["n"] == 4


def test_parse_response_orders_choices_and_keeps_the_top_k():
    spec = SampleSpec(prompt=[1], max_tokens=2, num_samples=2, topk_sample_logprobs=2)
    body = {
        "choices": [
            {
                "index": 1,
                "token_ids": [7, 2],
                "finish_reason": "stop",
                "logprobs": {
                    "token_logprobs": [-3.0, -0.1],
                    # the sampled token (7) is not in the top 2: vLLM adds it, we drop it
                    "top_logprobs": [
                        {"token_id:7": -3.0, "token_id:5": -0.5, "token_id:6": -1.0},
                        {"token_id:2": -0.1, "token_id:3": -2.5},
                    ],
                },
            },
            {
                "index": 0,
                "token_ids": [5, 5],
                "finish_reason": "length",
                "logprobs": {
                    "token_logprobs": [-0.5, -0.2],
                    "top_logprobs": [{"token_id:5": -0.5, "token_id:6": -1.0}, {"token_id:5": -0.2, "token_id:1": -2}],
                },
            },
        ]
    }
    out = parse_response(body, spec)
    assert [s.tokens for s in out.sequences] == [[5, 5], [7, 2]]
    assert [s.stop_reason for s in out.sequences] == ["length", "stop"]
    ids, lps = out.sequences[1].topk
    assert ids[0].tolist() == [5, 6] and lps[0].tolist() == [-0.5, -1.0]
    assert out.sequences[1].logprobs == [-3.0, -0.1]


def test_prompt_logprob_requests_stay_with_the_trainer():
    assert needs_embedded(SampleSpec(prompt=[1, 2], max_tokens=1, prompt_logprobs=True))
    assert needs_embedded(SampleSpec(prompt=[1, 2], max_tokens=1, topk_prompt_logprobs=3))
    assert needs_embedded(SampleSpec(prompt=[1, 2], max_tokens=0))
    assert not needs_embedded(SampleSpec(prompt=[1, 2], max_tokens=5, topk_sample_logprobs=3))


# ---- adapter bookkeeping --------------------------------------------------------------------


class FakeVllm:
    """Records load/unload calls; can be told to fail loads."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = False

    async def handler(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.01)  # a load takes time: concurrent callers overlap
        body = json.loads(request.content)
        op = request.url.path.rsplit("/", 1)[-1]
        self.calls.append((op, body["lora_name"]))
        if self.fail:
            return httpx.Response(400, text="bad adapter")
        return httpx.Response(200, text="ok")


def registry(fake: FakeVllm) -> AdapterRegistry:
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
    return AdapterRegistry(client, lambda: "http://vllm")


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``condition`` on the event loop until it holds; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not true after {timeout}s"
        await asyncio.sleep(0.005)


async def settled(timeout: float = 10.0) -> None:
    """Wait, up to ``timeout``, until the background work (unloads, their cleanups, LoRA syncs)
    started so far has finished, and whatever it started in turn: nothing is left running."""
    deadline = asyncio.get_running_loop().time() + timeout
    while pending := set(vllm_adapters._background):
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"background work still running after {timeout}s: {pending}"
        await asyncio.wait(pending, timeout=left)


def test_concurrent_users_share_one_load_and_retired_versions_unload_after_use(tmp_path):
    async def run() -> None:
        fake = FakeVllm()
        reg = registry(fake)
        cleaned = []
        held = await asyncio.gather(*(reg.acquire("v1", tmp_path, lambda: cleaned.append(1)) for _ in range(5)))
        assert len({a.name for a in held}) == 1 and fake.calls == [("load_lora_adapter", held[0].name)]
        assert reg.retire("v1") is True
        for adapter in held[:4]:
            reg.release(adapter)
        await settled()
        assert len(fake.calls) == 1 and not cleaned  # still one user
        reg.release(held[4])
        await settled()
        assert fake.calls[-1] == ("unload_lora_adapter", held[0].name) and cleaned == [1]
        assert reg.retire("never-loaded") is False
        again = await reg.acquire("v1", tmp_path)  # a retired key loads again under a new name
        assert again.name != held[0].name

    asyncio.run(run())


def test_idle_eviction_unloads_without_deleting_and_restarts_keep_counts_apart(tmp_path, monkeypatch):
    import hosted_tinker.inference.vllm_adapters as adapters

    monkeypatch.setattr(adapters, "MAX_IDLE_ADAPTERS", 1)

    async def run() -> None:
        fake = FakeVllm()
        reg = registry(fake)
        cleaned = []
        names = {}
        for key in ("a", "b"):
            adapter = await reg.acquire(key, tmp_path, lambda k=key: cleaned.append(k))
            names[key] = adapter.name
            reg.release(adapter)
        await settled()
        assert fake.calls[-1] == ("unload_lora_adapter", names["a"])
        assert cleaned == [] and reg.loaded() == 1  # evicted, not deleted: it reloads on demand
        assert reg.retire("a") is False  # not in vLLM: the caller deletes its files

        old = await reg.acquire("b", tmp_path)
        reg.forget()  # vLLM restarted while `old` was in use
        new = await reg.acquire("b", tmp_path, lambda: cleaned.append("b"))
        reg.release(old)  # the old holder's release must not count against the new load
        assert new.users == 1 and reg.retire("b") is True
        await settled()
        assert ("unload_lora_adapter", new.name) not in fake.calls  # still in use
        reg.release(new)
        await settled()
        assert fake.calls[-1] == ("unload_lora_adapter", new.name) and cleaned == ["b"]

    asyncio.run(run())


def test_a_failed_load_reaches_every_waiter_and_is_retried(tmp_path):
    async def run() -> None:
        fake = FakeVllm()
        fake.fail = True
        reg = registry(fake)
        results = await asyncio.gather(*(reg.acquire("v1", tmp_path) for _ in range(3)), return_exceptions=True)
        assert all("refused" in str(r) for r in results) and len(fake.calls) == 1
        fake.fail = False
        assert (await reg.acquire("v1", tmp_path)).name
        reg.forget()  # vLLM restarted
        assert reg.loaded() == 0

    asyncio.run(run())


def test_live_sync_coalesces_steps_and_readers_wait_for_it(tmp_path):
    async def run() -> None:
        fake = FakeVllm()
        reg = registry(fake)
        live = LiveAdapters(reg, lambda: True, tmp_path)
        live.bind_loop(asyncio.get_running_loop())
        config = {"peft_type": "LORA", "r": 1, "target_modules": ["q_proj"]}
        for step in range(1, 6):  # five steps published back to back, before any sync ran
            live.publish("run:train:0", step, config, {"w.lora_A.weight": torch.full((1, 2), float(step))})
        await until(lambda: "run:train:0" in live._runs)  # publish hands over to the loop: queued
        key, directory = await live.current("run:train:0")
        assert directory.name.startswith("step5-")
        loads = [c for c in fake.calls if c[0] == "load_lora_adapter"]
        assert len(loads) <= 2  # the first, then only the newest pending one
        assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert not list(directory.parent.glob(".writing-*"))
        stats = live.stats()
        assert stats["synced_versions"] == len(loads) and stats["latency_ms_last"] is not None
        live.drop("run:train:0")
        await settled()
        assert fake.calls[-1][0] == "unload_lora_adapter" and not directory.exists()
        with pytest.raises(Exception, match="no adapter"):
            await live.current("run:train:0")

    asyncio.run(run())


# ---- launching ------------------------------------------------------------------------------


def test_launch_command_and_environment():
    launch = VllmLaunch(
        python="/venv/bin/python",
        model="/m",
        served_names=["a", "b"],
        port=1234,
        dtype="bfloat16",
        max_lora_rank=32,
        gpus="1,2",
        gpu_memory_utilization=0.45,
        extra_args=["--tensor-parallel-size", "2"],
    )
    cmd = launch.command()
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--served-model-name") + 1 : cmd.index("--served-model-name") + 3] == ["a", "b"]
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "32"
    assert cmd[cmd.index("--max-logprobs") + 1] == "64" and cmd[cmd.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.45" and cmd[-2:] == ["--tensor-parallel-size", "2"]
    env = launch.env()
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    mine = VllmLaunch("p", "/m", ["a"], 1, gpu_memory_utilization=0.45, extra_args=["--gpu-memory-utilization", "0.9"])
    assert mine.command().count("--gpu-memory-utilization") == 1  # the user's value wins


STAND_IN = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def stand_in_python(tmp_path, server: str):
    """A "python" that runs ``server`` as vLLM's server module."""
    package = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for d in (package, package.parent, package.parent.parent):
        (d / "__init__.py").write_text("")
    (package / "api_server.py").write_text(server)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


def test_supervisor_restarts_a_killed_server_and_stops_it(tmp_path, monkeypatch):
    """A stand-in for vLLM's server module, launched through a wrapper "python"."""
    monkeypatch.setattr(vllm_process, "BACKOFF_S", (0.1,))  # the pause before a restart
    wrapper = stand_in_python(tmp_path, STAND_IN)

    async def run() -> None:
        restarted = []
        launch = VllmLaunch(str(wrapper), "/m", ["m"], free_port(), log_path=tmp_path / "vllm.log")
        sup = VllmSupervisor(launch, on_restart=lambda: restarted.append(1))
        sup.start()
        with pytest.raises(EngineUnavailable, match="starting"):
            sup.check_ready()
        assert await sup.wait_ready(30)
        first = sup.pid
        os.kill(first, signal.SIGKILL)
        await until(lambda: sup.state is not EngineState.READY, timeout=5)  # it noticed the death
        with pytest.raises(EngineUnavailable, match="restarting after: was killed by signal 9"):
            sup.check_ready()
        await until(lambda: sup.state is EngineState.READY, timeout=30)
        assert sup.state is EngineState.READY and sup.pid != first and sup.restarts == 1 and restarted == [1]
        second = sup.pid
        await sup.stop()
        assert sup.state is EngineState.STOPPED
        with pytest.raises(ProcessLookupError):
            os.kill(second, 0)

    asyncio.run(run())


def test_a_vllm_that_refuses_to_return_routing_says_which_flag_asked_for_it(tmp_path, monkeypatch):
    """vLLM refuses --enable-return-routed-experts where it cannot capture routing; the error the
    server shows (``/healthz``) names the server flag that added it."""
    monkeypatch.setattr(vllm_process, "BACKOFF_S", (0.1,))
    refusing = 'import sys\nprint("ValueError: AuxOutput Connector requires prefix caching.")\nsys.exit(1)\n'
    wrapper = stand_in_python(tmp_path, refusing)

    async def run() -> None:
        flag = ["--enable-return-routed-experts"]
        launch = VllmLaunch(str(wrapper), "/m", ["m"], free_port(), extra_args=flag, log_path=tmp_path / "vllm.log")
        sup = VllmSupervisor(launch)
        sup.start()
        await until(lambda: "its log" in (sup.last_error or ""), timeout=30)
        assert "requires prefix caching" in sup.last_error and "--vllm-routing off leaves out" in sup.last_error
        await sup.stop()

    asyncio.run(run())


def test_setup_vllm_checks_its_arguments_and_the_interpreter(tmp_path):
    from hosted_tinker.inference.vllm_setup import check_vllm_python, setup_vllm

    with pytest.raises(ValueError, match="variant"):
        setup_vllm(tmp_path / "env", "rocm")
    assert not (tmp_path / "env").exists()  # refused before creating anything
    if importlib.util.find_spec("vllm") is None:  # the training venv has no vllm
        with pytest.raises(RuntimeError, match="cannot import vllm"):
            check_vllm_python(sys.executable)


def test_max_lora_rank_must_be_a_size_vllm_accepts():
    from pydantic import ValidationError

    assert ServerConfig(max_lora_rank=32).max_lora_rank == 32
    with pytest.raises(ValidationError, match="max_lora_rank must be one of"):
        ServerConfig(max_lora_rank=48)


def test_whether_a_launched_vllm_shares_a_training_gpu():
    """By default vLLM takes rank 0's GPU; given GPUs, it shares where they name a training GPU
    (as this process's CUDA_VISIBLE_DEVICES numbers them); an external vLLM or CPU ranks share none."""

    def shares(visible: str | None = None, **settings) -> bool:
        return ServerConfig(**{"inference": "vllm", "device": "cuda", **settings}).vllm_shares_training_gpu(visible)

    assert shares() and shares(train_devices="cuda:0,1", backend="ddp")
    assert not shares(vllm_gpus="1") and shares(vllm_gpus="1, 0")
    assert shares(vllm_gpus="3", visible="2,3", device="cuda:1") and not shares(
        vllm_gpus="2", visible="2,3", device="cuda:1"
    )
    assert not shares(inference_url="http://127.0.0.1:8000") and not shares(device="cpu")
    assert not ServerConfig(device="cuda").vllm_shares_training_gpu(None)  # the embedded sampler


def test_vllm_shares_rank_0s_gpu_as_this_process_numbers_it():
    """``cuda:N`` counts within this process's CUDA_VISIBLE_DEVICES; vLLM's own must name that GPU."""

    assert visible_gpu("cuda:1", None) == "1" and visible_gpu("cuda", "") == "0"
    assert visible_gpu("cuda:0", "2,3") == "2" and visible_gpu("cuda:1", "2, 3") == "3"
    assert visible_gpu("cuda:0", "GPU-8f1c,GPU-77aa") == "GPU-8f1c"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=2 makes 1 GPU"):
        visible_gpu("cuda:1", "2")
