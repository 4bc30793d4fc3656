"""Routing replay on the HF path (``rank.routing_replay``): every mixture-of-experts family's
router is known and weighted as the family weights it; a replayed routing is the one the model
runs, checked against an independent float64 reference (transformers' own model in float64
whose routers are made to choose the given experts, weighted by the formulas of the family's
modeling code); the embedded sampler records the experts of every token it feeds, and the
learner replaying that record routes every token as the sampler did."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch
from torch import Tensor

from hosted_tinker.core.routing import NO_EXPERT
from hosted_tinker.core.sampling import SampleSpec
from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.core.types import DatumInput, LoraSpec
from hosted_tinker.rank.model import HfLoraModel
from hosted_tinker.rank.routing_replay import find_routers
from hosted_tinker.rank.serve import Rank, local_rank
from tests.support.lora_reference import assert_close_in_float32, datum

pytestmark = [pytest.mark.fast, pytest.mark.timeout(300)]

FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen3_5_moe", "gpt_oss", "qwen3_vl_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def rank(request, tmp_path_factory) -> Rank:
    path = build_tiny_model(tmp_path_factory.mktemp("models") / request.param, family=request.param, hidden_size=64)
    return local_rank(str(path))


def reference_weights(router: torch.nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """The weights transformers' routers give experts ``indices``, in float64: Qwen3-MoE's family
    a softmax over all experts (renormalised over the chosen under ``norm_topk_prob``), gpt-oss a
    softmax over the chosen logits, DeepSeek-V3 sigmoid scores (renormalised, scaled)."""
    logits = logits.double()
    if hasattr(router, "e_score_correction_bias"):
        w = logits.sigmoid().gather(1, indices)
        if router.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    if type(router).__name__ == "GptOssTopKRouter":
        return logits.gather(1, indices).softmax(-1)
    w = logits.softmax(-1).gather(1, indices)
    return w / w.sum(-1, keepdim=True) if getattr(router, "norm_topk_prob", True) else w  # Qwen3.5, VL: always


def test_every_family_s_router_replays_its_own_choice_to_its_own_weights(rank: Rank):
    adapters = rank.trainer.model.adapters
    routers = find_routers(adapters.lm, list(adapters.experts))
    assert routers is not None and len(routers) == len(adapters.experts) == adapters.replay.layers
    # which decoder layers a record's are (vLLM returns every decoder layer's): DeepSeek's first dense
    config = rank.trainer.model.base.config
    assert rank.capabilities.moe_layers == tuple(
        range(getattr(config, "first_k_dense_replace", 0), config.num_hidden_layers)
    )
    torch.manual_seed(0)
    for router, weigh in routers:
        x = torch.randn(9, router.weight.shape[1])
        logits, weights, indices = router(x)
        assert torch.equal(weigh(router, logits, indices), weights)  # bit for bit
        torch.testing.assert_close(weights.double(), reference_weights(router, logits, indices))


def test_a_replayed_routing_is_the_one_the_model_runs(rank: Rank):
    """Forced experts (distinct, random; the first positions left to the router) against
    transformers' float64 model routed the same; the counts say what was replayed and changed."""
    model: HfLoraModel = rank.trainer.model
    replay = model.adapters.replay
    tokens = list(range(4, 30))
    d = datum(tokens)
    n, layers, k = d.num_tokens, replay.layers, replay.top_k
    g = torch.Generator().manual_seed(1)
    forced = torch.stack([torch.randperm(model.routed_experts, generator=g)[:k] for _ in range(n * layers)])
    forced = forced.view(n, layers, k).to(torch.int16)
    forced[:3] = NO_EXPERT
    d.routing = forced

    handle = model.add_adapter(LoraSpec(rank=4, seed=1))
    try:
        with replay.recording(
            lambda chosen: chosen
        ) as taken:  # what each router chose itself, on the replayed run's states
            got = model.logprobs([handle], [d])[0].detach()
            own = taken().permute(1, 0, 2)
        routed = model.take_routed()[handle.name]
    finally:
        model.remove_adapter(handle)
    want = forced_reference(model, d)
    assert_close_in_float32(got, want)

    differs = (forced.sort(-1).values != own.sort(-1).values).any(-1)[3:]
    assert routed.routings == n * layers
    assert routed.replayed == (n - 3) * layers
    assert routed.changed == int(differs.sum()) > 0


def test_the_sampler_records_every_fed_token_and_the_learner_replays_it_as_sampled(rank: Rank):
    prompt = list(range(7, 19))
    spec = SampleSpec(prompt=prompt, max_tokens=6, num_samples=2, seed=3, record_routing=True)
    output = rank.sampler.generate(None, [spec])[0]
    replay = rank.trainer.model.adapters.replay
    assert output.prompt_routing.shape == (len(prompt), replay.layers, replay.top_k)
    model: HfLoraModel = rank.trainer.model
    handle = model.add_adapter(LoraSpec(rank=4, seed=1))
    try:
        for seq in output.sequences:
            assert seq.routing.shape == (len(seq.tokens), replay.layers, replay.top_k)
            assert (seq.routing[-1] == NO_EXPERT).all() and (seq.routing[:-1] >= 0).all()  # the last is never fed
            d = DatumInput(
                tokens=torch.tensor(prompt + seq.tokens[:-1]),
                target_tokens=torch.tensor(prompt[1:] + seq.tokens),
                routing=torch.from_numpy(np.concatenate([output.prompt_routing, seq.routing[:-1]])),
            )
            own = own_routing(model, d)
            # the record is what the learner's routers choose at the same positions (same weights)
            np.testing.assert_array_equal(np.sort(d.routing.numpy(), -1), np.sort(own.numpy(), -1))
            lps = model.logprobs([handle], [d])[0].detach()
            routed = model.take_routed()[handle.name]
            assert routed.replayed == d.num_tokens * replay.layers and routed.changed == 0
            np.testing.assert_allclose(lps[len(prompt) - 1 :].numpy(), seq.logprobs, rtol=0, atol=1e-4)
    finally:
        model.remove_adapter(handle)


# ---- helpers -------------------------------------------------------------------------------------


def own_routing(model: HfLoraModel, d: DatumInput) -> Tensor:
    """The experts the base model's routers choose for ``d``'s tokens, ``(N, layers, top_k)``."""
    replay = model.adapters.replay
    saved, replay.target = replay.target, None
    try:
        with replay.recording(lambda chosen: chosen) as taken, torch.no_grad():
            lm = model.adapters.lm
            getattr(lm, lm.base_model_prefix)(input_ids=d.tokens[None], use_cache=False)
            return taken().permute(1, 0, 2)
    finally:
        replay.target = saved


def forced_reference(model: HfLoraModel, d: DatumInput) -> Tensor:
    """``d``'s log-probs from transformers' model in float64 (its own experts code), each
    router's choice replaced where ``d.routing`` names experts."""
    from hosted_tinker.rank.experts import experts_modules

    ref = copy.deepcopy(model.shareable_base).to(torch.float64).eval()  # the clean tree: none of our hooks
    ref.set_experts_implementation("eager")  # transformers' loop over experts (its grouped GEMM takes no float64)
    names = list(experts_modules(ref))
    routers = find_routers(ref, names)
    assert routers is not None
    for layer, (router, _) in enumerate(routers):
        original = router.forward

        def forward(self, x, layer=layer, original=original):
            logits, weights, indices = original(x)
            wanted = d.routing[:, layer].long()
            on = wanted[:, 0] != NO_EXPERT
            indices = torch.where(on[:, None], wanted, indices)
            weights = torch.where(on[:, None], reference_weights(self, logits, indices).to(weights.dtype), weights)
            return logits, weights, indices

        router.forward = types.MethodType(forward, router)
    with torch.no_grad():
        logits = ref(input_ids=d.tokens[None]).logits[0]
    return logits.log_softmax(-1).gather(-1, d.target_tokens[:, None])[:, 0]
