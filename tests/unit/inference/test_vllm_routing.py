"""Routing replay with vLLM as the sampler: what vLLM is started with and asked for on a
mixture-of-experts model, and its routed experts (vLLM 0.32's ``--enable-return-routed-experts``)
turned into the record the embedded sampler keeps (``core.sampling``)."""

from __future__ import annotations

import base64
import dataclasses
import io
import logging

import numpy as np
import pytest

from hosted_tinker.core.routing import NO_EXPERT, RECORD_DTYPE
from hosted_tinker.core.sampling import SampleSpec
from hosted_tinker.core.throttle import Throttle
from hosted_tinker.core.types import Capabilities
from hosted_tinker.inference import vllm_engine
from hosted_tinker.inference.vllm_engine import parse_response, request_body
from hosted_tinker.inference.vllm_layout import NO_ROUTING, Routing, VllmLayout

pytestmark = pytest.mark.fast

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
# four decoder layers, routed experts in layers 1 and 3 (Qwen3-MoE's decoder_sparse_step 2), two of 8 a token
CAPS = Capabilities(
    "peft", "Qwen3MoeForCausalLM", (), 64, 64, 100, routed_experts=8, replay_routing=(2, 2), moe_layers=(1, 3)
)
ROUTING = Routing((1, 3), 2, 8)


def numpy2base64(array: np.ndarray) -> str:
    """As vLLM 0.32 encodes an array in a response (``vllm/utils/serial_utils.py``)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def npz() -> str:
    """An .npz archive in base64: what np.load opens as an archive, not an array."""
    buffer = io.BytesIO()
    np.savez(buffer, routed=np.zeros((6, 4, 2), np.uint8))
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def test_vllm_is_started_to_return_routing_where_it_is_replayed_if_asked():
    layout = VllmLayout.of(CONFIG, CAPS, record_routing=True)  # --vllm-routing record
    assert layout.routing == ROUTING
    assert layout.launch_args() == ["--enable-moe-shared-loras", "--enable-return-routed-experts"]
    off = VllmLayout.of(CONFIG, CAPS)  # the default: every answer would carry it
    assert off.routing == NO_ROUTING and off.launch_args() == ["--enable-moe-shared-loras"]
    # routers this server does not replay (replay_routing (0, 0)), and a dense model: nothing asked
    unknown = VllmLayout.of(CONFIG, dataclasses.replace(CAPS, replay_routing=(0, 0)), record_routing=True)
    assert unknown.routing == NO_ROUTING and "--enable-return-routed-experts" not in unknown.launch_args()
    dense = Capabilities("peft", "Qwen3ForCausalLM", (), 64, 64, 100)
    assert VllmLayout.of({"architectures": ["Qwen3ForCausalLM"]}, dense, record_routing=True).launch_args() == []


def test_a_request_that_records_nothing_asks_for_the_least_routing():
    spec = SampleSpec(prompt=[1, 2, 3], max_tokens=4)
    # vLLM returns routing for every request once started so: from the first sampled token on
    assert request_body("m", spec, ROUTING)["routed_experts_prompt_start"] == 3
    assert "routed_experts_prompt_start" not in request_body(
        "m", dataclasses.replace(spec, record_routing=True), ROUTING
    )
    assert "routed_experts_prompt_start" not in request_body("m", spec)  # vLLM returns none


def choice(index: int, tokens: list[int], routed: str | None) -> dict:
    logprobs = {"token_logprobs": [-1.0] * len(tokens)}
    return {"index": index, "token_ids": tokens, "finish_reason": "length", "logprobs": logprobs} | (
        {"routed_experts": routed} if routed is not None else {}
    )


def test_vllm_routed_experts_become_the_embedded_samplers_record():
    rng = np.random.default_rng(0)
    prompt, samples = [5, 6, 7], [[1, 2, 3, 4], [8, 9]]
    # vLLM's rows: one per token fed in (the prompt, then every sampled token but the last), every
    # decoder layer, the dense ones 0; uint8 below 256 experts
    prompt_rows = rng.integers(0, 8, size=(len(prompt), 4, 2), dtype=np.uint8)
    arrays = [
        np.concatenate([prompt_rows, rng.integers(0, 8, size=(len(t) - 1, 4, 2), dtype=np.uint8)]) for t in samples
    ]
    for array in arrays:
        array[:, [0, 2]] = 0
    body = {"choices": [choice(i, t, numpy2base64(a)) for i, (t, a) in enumerate(zip(samples, arrays, strict=True))]}
    spec = SampleSpec(prompt=prompt, max_tokens=4, num_samples=2, record_routing=True)
    out = parse_response(body, spec, ROUTING)
    assert out.prompt_routing is not None and out.prompt_routing.dtype == np.dtype(RECORD_DTYPE)
    np.testing.assert_array_equal(out.prompt_routing, arrays[0][:3][:, [1, 3]])
    for seq, tokens, array in zip(out.sequences, samples, arrays, strict=True):
        assert seq.routing is not None and seq.routing.shape == (len(tokens), 2, 2)
        np.testing.assert_array_equal(seq.routing[:-1], array[3:][:, [1, 3]])  # token j's, when fed back
        assert (seq.routing[-1] == NO_EXPERT).all()  # the last sampled token is never fed back
    # not asked to record: nothing kept, whatever vLLM sent
    plain = parse_response(body, dataclasses.replace(spec, record_routing=False), ROUTING)
    assert plain.prompt_routing is None and all(s.routing is None for s in plain.sequences)


@pytest.mark.parametrize(
    "routed",
    [
        None,  # vLLM not started with --enable-return-routed-experts (a server at --inference-url)
        "not base64!",
        base64.b64encode(b"\x93NUMPY garbage").decode(),
        numpy2base64(np.zeros((5, 4, 2), np.uint8)),  # rows for another prompt
        numpy2base64(np.zeros((6, 2, 2), np.uint8)),  # fewer decoder layers than the model's
        numpy2base64(np.zeros((6, 4, 4), np.uint8)),  # another top_k
        numpy2base64(np.zeros((6, 4, 2), np.float32)),
        numpy2base64(np.zeros((6, 8), np.uint8)),
        numpy2base64(np.full((6, 4, 2), 8, np.uint8)),  # an expert the model does not have
        numpy2base64(np.full((6, 4, 2), -1, np.int16)),
        npz(),  # an archive, which np.load opens as one
    ],
)
def test_routing_vllm_did_not_send_as_asked_is_not_recorded_and_says_why(routed, caplog, monkeypatch):
    monkeypatch.setattr(vllm_engine, "_refused", Throttle(60.0))
    spec = SampleSpec(prompt=[5, 6, 7], max_tokens=4, record_routing=True)
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        out = parse_response({"choices": [choice(0, [1, 2, 3, 4], routed)]}, spec, ROUTING)
        parse_response({"choices": [choice(0, [1, 2, 3, 4], routed)]}, spec, ROUTING)
    # the sample itself is kept: its record holds tokens and log-probs, no routing
    assert out.sequences[0].tokens == [1, 2, 3, 4] and out.sequences[0].routing is None and out.prompt_routing is None
    warnings = [r.getMessage() for r in caplog.records if "routed experts" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once a minute, not on every sample


def test_routing_for_a_sample_of_no_tokens_is_not_recorded():
    spec = SampleSpec(prompt=[5, 6, 7], max_tokens=4, record_routing=True)
    out = parse_response({"choices": [choice(0, [], numpy2base64(np.zeros((2, 4, 2), np.uint8)))]}, spec, ROUTING)
    assert out.prompt_routing is None and out.sequences[0].routing is None
