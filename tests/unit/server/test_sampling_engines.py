"""Which engine serves a sampling request, and the refusal when none here can: the embedded
sampler runs only where the training plan keeps a model tree it can share
(``Capabilities.sampling``); vLLM serves everything but prompt logprobs and ``max_tokens`` 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hosted_tinker.core.errors import ApiError
from hosted_tinker.core.types import Capabilities
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.serving.sampling import SamplingService

pytestmark = pytest.mark.fast


def service(*, embedded_sampler: bool, vllm: bool) -> SamplingService:
    caps = Capabilities(
        backend="megatron" if not embedded_sampler else "peft",
        arch="Qwen3ForCausalLM",
        losses=("cross_entropy",),
        max_seq_len=64,
        max_tokens_per_batch=1 << 20,
        vocab_size=100,
        sampling=embedded_sampler,
    )
    engine = SimpleNamespace(name="vllm") if vllm else None
    backend = SimpleNamespace(capabilities=caps)
    return SamplingService(backend, None, None, None, None, None, {0}, SimpleNamespace(name="embedded"), None, engine)


def spec(sampling: SamplingService, **kwargs):
    return sampling.spec([1, 2, 3], wire.SamplingParams(max_tokens=kwargs.pop("max_tokens", 4)), **kwargs)


def test_with_an_embedded_sampler_everything_is_served():
    for vllm in (False, True):
        sampling = service(embedded_sampler=True, vllm=vllm)
        assert not sampling.uses_vllm(spec(sampling, prompt_logprobs=True))
        assert not sampling.uses_vllm(spec(sampling, max_tokens=0))
        assert sampling.uses_vllm(spec(sampling)) is vllm


def test_without_one_vllm_serves_what_it_can_and_the_rest_is_refused():
    sampling = service(embedded_sampler=False, vllm=True)
    assert sampling.uses_vllm(spec(sampling, topk_sample_logprobs=2))
    for kwargs in ({"prompt_logprobs": True}, {"topk_prompt_logprobs": 3}, {"max_tokens": 0}):
        with pytest.raises(ApiError) as refused:
            spec(sampling, **kwargs)
        assert refused.value.status == 400 and "'megatron' backend does not run" in refused.value.detail


def test_without_either_sampling_is_refused_naming_the_way_to_sample():
    sampling = service(embedded_sampler=False, vllm=False)
    with pytest.raises(ApiError) as refused:
        spec(sampling)
    assert refused.value.status == 400 and "--inference vllm" in refused.value.detail
