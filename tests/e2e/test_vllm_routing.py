"""Routing replay with vLLM as the sampler, through the front door: the server at
``--inference-url`` of a stand-in vLLM that answers as vLLM 0.32 started with
``--enable-return-routed-experts`` does (its routed experts in each choice: base64 of an ``.npy``
array, a row per token fed in, every decoder layer; ``tests/unit/inference/test_vllm_routing.py``
pins the format). vLLM's CPU build samples no expert LoRA, so no real vLLM can stand here.

The stand-in answers the routing transformers' model chooses for the tokens it returns: a fresh
adapter (B = 0) is the base model, so a learner that replays the record where it belongs (each
position, each MoE layer, past the model's dense first layer) changes no routing at all, where a
record one row or one layer off would change most of them."""

from __future__ import annotations

import base64
import io
import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import openai
import pytest
import tinker
import torch
from tinker import types

from hosted_tinker.core.tiny_model import tiny_config
from tests.support.sdk import rl_datum
from tests.support.server import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ALIAS = "tiny-moe"
PROMPT = [5, 6, 7, 8, 9]
SAMPLED = [20, 21, 22, 23]  # what the stand-in "samples", every time
LAYERS, DENSE = 3, (0,)  # Qwen3-MoE with mlp_only_layers=[0]: routed experts in layers 1 and 2


def moe_with_a_dense_layer(to: Path, tiny_model_dir: Path) -> Path:
    """The tiny Qwen3-MoE (``core.tiny_model``'s) with a dense MLP in its first layer, so that which
    of vLLM's decoder layers are the record's matters."""
    from transformers import AutoConfig, AutoTokenizer, Qwen3MoeForCausalLM

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    shape = dict(vocab_size=vocab, hidden_size=64, num_layers=LAYERS, initializer_range=0.1)
    config = tiny_config("qwen3_moe", **shape, tok=tok)
    config.mlp_only_layers = list(DENSE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        Qwen3MoeForCausalLM(config).save_pretrained(to)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, to / name)
    return to


def routing_of(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """What transformers' model routes each of ``tokens`` to, as vLLM returns it: ``(tokens,
    decoder layers, top_k)`` uint8, zeros in a dense layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = np.zeros((len(tokens), LAYERS, 2), dtype=np.uint8)
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: rows.__setitem__((slice(None), i), out[2]))
        for i, layer in enumerate(model.model.layers)
        if i not in DENSE
    ]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return rows


def numpy2base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


class StandIn(ThreadingHTTPServer):
    """vLLM's routes the server uses; every completion samples ``SAMPLED`` with ``routed``."""

    def __init__(self, routed: np.ndarray) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routed, self.completions = routed, []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args) -> None:  # quiet
        pass

    def _answer(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"data": [{"id": "base", "parent": None}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path != "/v1/completions":  # load / unload an adapter
            return self._answer({})
        self.server.completions.append(request)
        start = request.get("routed_experts_prompt_start", 0)
        n = request.get("n", 1)
        choice = {
            "text": "",
            "token_ids": SAMPLED,
            "finish_reason": "length",
            "logprobs": {"token_logprobs": [-1.0] * len(SAMPLED), "top_logprobs": None},
            "routed_experts": numpy2base64(self.server.routed[start:]),
        }
        usage = {"prompt_tokens": len(PROMPT), "completion_tokens": len(SAMPLED) * n, "total_tokens": 0}
        self._answer({"id": "c", "choices": [choice | {"index": i} for i in range(n)], "usage": usage})


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir: Path) -> Iterator[tuple[str, StandIn]]:
    model = moe_with_a_dense_layer(tmp_path_factory.mktemp("moe"), tiny_model_dir)
    vllm = StandIn(routing_of(model, PROMPT + SAMPLED[:-1]))
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    # --vllm-gpus: the vLLM there runs on a GPU, as vLLM with expert LoRA must
    flags = ("--model", str(model), "--inference-url", vllm.url, "--vllm-gpus", "0", "--vllm-routing", "record")
    server = start_server(tmp_path_factory.mktemp("data"), *flags, alias=ALIAS)
    try:
        yield server.base_url, vllm
    finally:
        server.stop()
        vllm.shutdown()


def test_vllms_routing_is_recorded_and_replayed_where_it_belongs(served):
    base_url, vllm = served
    tc = tinker.ServiceClient(base_url=base_url).create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=len(SAMPLED), temperature=1.0, seed=5, stop=[])
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result().sequences
    assert [s.tokens for s in seqs] == [SAMPLED, SAMPLED]
    assert "routed_experts_prompt_start" not in vllm.completions[-1]  # the prompt's rows too
    data = [rl_datum(s, 1.0, PROMPT) for s in seqs]
    metrics = tc.forward(data, "importance_sampling").result().metrics
    # every position of both datums, each MoE layer, from vLLM's record: the learner's own choices
    assert metrics["routing_replayed:mean"] == 1.0 and metrics["routing_replay_changed:mean"] == 0.0

    # a sampler that records nothing asks vLLM for the least routing: its sampled tokens'
    tinker.ServiceClient(base_url=base_url).create_sampling_client(base_model=ALIAS).result().sample(
        types.ModelInput.from_ints(PROMPT), 1, params
    ).result()
    assert vllm.completions[-1]["routed_experts_prompt_start"] == len(PROMPT)


def test_the_openai_door_passes_routing_on_only_to_a_client_that_asks_for_it(served):
    base_url, vllm = served
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="tml-unused")
    plain = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=len(SAMPLED))
    assert "routed_experts" not in (plain.choices[0].model_extra or {})
    assert vllm.completions[-1]["routed_experts_prompt_start"] == len(PROMPT)  # the least vLLM sends
    asked = client.completions.create(
        model=ALIAS, prompt=PROMPT, max_tokens=len(SAMPLED), extra_body={"routed_experts_prompt_start": 0}
    )
    assert isinstance((asked.choices[0].model_extra or {}).get("routed_experts"), str)


def test_routing_asked_of_a_model_without_experts_is_said_to_be_off(tmp_path, tiny_model_dir: Path):
    vllm = StandIn(np.zeros((0, 1, 1), np.uint8))
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    flags = ("--model", str(tiny_model_dir), "--inference-url", vllm.url, "--vllm-routing", "record")
    server = start_server(tmp_path, *flags, alias=ALIAS)
    try:
        log = server.log_path.read_text()
        assert "--vllm-routing record: Qwen3ForCausalLM has no routed experts; vLLM is asked for no routing" in log
    finally:
        server.stop()
        vllm.shutdown()
