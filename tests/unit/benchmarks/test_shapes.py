"""The FLOPs a trained token costs (``benchmarks/shapes.py``), against the HF model's own parameters."""

from __future__ import annotations

import pytest
import torch

from benchmarks.shapes import SHAPES, latent_flops_per_token

pytestmark = pytest.mark.fast


def test_deepseeks_flops_count_the_parameters_a_token_meets():
    """DeepSeek-V3's make (latent attention, a dense first layer, shared experts): the matmul
    parameters a token meets are the HF model's linear and expert weights, its routed experts'
    top k of them, the output layer's, not the embedding's or the norms'; the released models
    are ~37 B of 671 B (DeepSeek-V3) and ~32 B of 1 T (Kimi-K2), the embedding included."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    shape = dict(SHAPES["deepseek-h512-l4"])
    shape.pop("model_type")
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**shape))
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    counted = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n
    )  # linear and expert weights, routers, the output layer
    moe_layers = shape["num_hidden_layers"] - shape["first_k_dense_replace"]
    assert moe_layers == 3 and routed > 0
    flops = latent_flops_per_token(SHAPES["deepseek-h512-l4"], mean_context=100.0, lora_rank=8)
    assert flops["total_params"] == counted
    top_k_of_routed = routed * shape["num_experts_per_tok"] // shape["n_routed_experts"]
    assert flops["active_params"] == counted - routed + top_k_of_routed
    for name, active, total in (("deepseek-v3", 37.5e9, 671.0e9), ("kimi-k2", 32.9e9, 1026.4e9)):
        got = latent_flops_per_token(SHAPES[name], mean_context=1.0, lora_rank=1)
        embedding = SHAPES[name]["vocab_size"] * SHAPES[name]["hidden_size"]
        assert got["active_params"] + embedding == pytest.approx(active, rel=0.01), name
        assert got["total_params"] + embedding == pytest.approx(total, rel=0.01), name


def test_qwen3_5_moes_flops_count_the_parameters_a_token_meets():
    """Qwen3.5-MoE's make (Gated-DeltaNet and gated attention layers, each with a router, routed
    experts and a gated shared expert): the matmul parameters a token meets are the HF model's
    linear and expert weights (not the convolutions', the embedding's or the norms'), its routed
    experts' top k of them; the released Qwen3.5-35B-A3B's language model is ~35 B, of which a
    token meets ~3 B besides its embedding."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from benchmarks.shapes import hybrid_flops_per_token

    shape = dict(SHAPES["qwen3.5-moe-h512-l4"])
    shape.pop("model_type")
    config = Qwen3_5MoeTextConfig(**shape)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    counted = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n and "conv1d" not in n
    )
    flops = hybrid_flops_per_token(config.to_dict(), mean_context=100.0, lora_rank=8)
    assert routed > 0 and flops["total_params"] == counted
    assert flops["active_params"] == counted - routed + routed * shape["num_experts_per_tok"] // shape["num_experts"]
    released = Qwen3_5MoeTextConfig().to_dict()
    got = hybrid_flops_per_token(released, mean_context=1.0, lora_rank=1)
    embedding = released["vocab_size"] * released["hidden_size"]
    assert got["total_params"] + embedding == pytest.approx(34.7e9, rel=0.02)
    assert got["active_params"] == pytest.approx(3.0e9, rel=0.05)  # "A3B": the output layer in, the embedding out
