"""``inference.vllm_layout``: what each family's adapter becomes for vLLM, checked against the
products Tinker's LoRA computes (float64), and what the server refuses or passes to vLLM.
That vLLM's own loader reads these files as meant is ``tests/e2e/test_vllm_layouts.py``."""

from __future__ import annotations

import json

import pytest
import torch

from hosted_tinker.core.checkpoints import load_safetensors
from hosted_tinker.core.types import Capabilities
from hosted_tinker.inference.vllm_layout import PLAIN, VllmLayout, fuse_qkv, read_hf_config

pytestmark = pytest.mark.fast

GDN = "base_model.model.model.layers.0.linear_attn"
R, ALPHA, H, KD, VD = 4, 8.0, 16, 6, 10  # rank, alpha, hidden, key_dim, value_dim


def caps(**fields) -> Capabilities:
    fields = {"arch": "X"} | fields
    return Capabilities(backend="peft", losses=(), max_seq_len=8, max_tokens_per_batch=8, vocab_size=8, **fields)


def gdn_adapter() -> tuple[dict, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    weights = {}
    for part, out in (("in_proj_q", KD), ("in_proj_k", KD), ("in_proj_v", VD), ("in_proj_z", VD)):
        weights[f"{GDN}.{part}.lora_A.weight"] = torch.randn(R, H, generator=g, dtype=torch.float64)
        weights[f"{GDN}.{part}.lora_B.weight"] = torch.randn(out, R, generator=g, dtype=torch.float64)
    modules = [f"model.layers.0.linear_attn.{p}" for p in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z")]
    return {"r": R, "lora_alpha": ALPHA, "target_modules": modules}, weights


def test_a_fused_qkv_lora_computes_tinkers_three_products_exactly():
    config, weights = gdn_adapter()
    fused_config, fused = fuse_qkv(config, weights)
    a, b = fused[f"{GDN}.in_proj_qkv.lora_A.weight"], fused[f"{GDN}.in_proj_qkv.lora_B.weight"]
    assert a.shape == (3 * R, H) and b.shape == (2 * KD + VD, 3 * R)
    # vLLM scales a module by its alpha_pattern / rank_pattern entry: 3α / 3r = α / r
    rank, alpha = fused_config["rank_pattern"]["in_proj_qkv"], fused_config["alpha_pattern"]["in_proj_qkv"]
    assert (rank, alpha) == (3 * R, 3 * ALPHA)
    got = alpha / rank * b @ a
    products = [
        weights[f"{GDN}.in_proj_{p}.lora_B.weight"] @ weights[f"{GDN}.in_proj_{p}.lora_A.weight"] for p in "qkv"
    ]
    want = ALPHA / R * torch.cat(products)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # z stays its own module; q/k/v are gone, in the tensors and in target_modules
    assert fused[f"{GDN}.in_proj_z.lora_A.weight"] is weights[f"{GDN}.in_proj_z.lora_A.weight"]
    assert not any(".in_proj_q." in k or ".in_proj_k." in k or ".in_proj_v." in k for k in fused)
    assert fused_config["target_modules"] == [
        "model.layers.0.linear_attn.in_proj_qkv",
        "model.layers.0.linear_attn.in_proj_z",
    ]
    assert config["target_modules"][0].endswith("in_proj_q")  # the caller's config is left alone


def test_a_gated_delta_net_lora_without_all_of_q_k_v_is_refused():
    config, weights = gdn_adapter()
    del weights[f"{GDN}.in_proj_k.lora_B.weight"]
    with pytest.raises(ValueError, match=r"lacks \['in_proj_k.lora_B'\]"):
        fuse_qkv(config, weights)


def test_a_vision_language_checkpoints_decoder_is_named_where_vllm_looks():
    layout = VllmLayout.of({"architectures": ["Qwen3VLMoeForConditionalGeneration"]}, caps(routed_experts=8))
    key = "base_model.model.model.layers.3.mlp.experts.w1.lora_A.weight"
    head = "base_model.model.lm_head.lora_A.weight"
    config = {"r": 2, "target_modules": ["model.layers.3.mlp.experts", "lm_head"]}
    assert layout.changes_names({key, head})
    config, weights = layout.adapter(config, {key: torch.zeros(1, 2, 4), head: torch.zeros(2, 4)})
    assert set(weights) == {"base_model.model.model.language_model.layers.3.mlp.experts.w1.lora_A.weight", head}
    assert config["target_modules"] == ["model.language_model.layers.3.mlp.experts", "lm_head"]


def test_expert_tensors_go_to_vllm_as_trained_with_the_shared_lora_flag():
    layout = VllmLayout.of(
        {"architectures": ["Qwen3MoeForCausalLM"]}, caps(routed_experts=8, arch="Qwen3MoeForCausalLM")
    )
    weights = {"base_model.model.model.layers.0.mlp.experts.w2.lora_B.weight": torch.ones(1, 4, 2)}
    files = layout.files({"r": 2, "target_modules": []}, weights)
    assert load_safetensors(files["adapter_model.safetensors"]).keys() == weights.keys()
    assert not layout.changes_names(set(weights))
    assert layout.launch_args() == ["--enable-moe-shared-loras"] and PLAIN.launch_args() == []


@pytest.mark.parametrize(
    ("config", "fields", "on_gpu", "refused"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, {}, False, None),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, {"routed_experts": 8}, True, None),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, {"routed_experts": 8}, False, "X's LoRA on routed experts"),
        ({"architectures": ["Qwen3_5ForCausalLM"]}, {"linear_attention_layers": 3}, True, None),
        ({"architectures": ["Qwen3_5ForCausalLM"]}, {"linear_attention_layers": 3}, False, "X's Gated-DeltaNet"),
        ({"kv_lora_rank": 512}, {"routed_experts": 8}, True, "X has multi-head latent attention"),
        ({"text_config": {"kv_lora_rank": 512}}, {}, True, "X has multi-head latent attention"),
    ],
)
def test_what_vllm_cannot_sample_as_trained_is_refused(config, fields, on_gpu, refused):
    why = VllmLayout.of(config, caps(**fields)).refusal(on_gpu)
    assert why is None if refused is None else why.startswith(refused)


def test_vllm_holds_a_fused_qkv_lora_at_three_times_the_rank():
    gdn = VllmLayout.of({}, caps(linear_attention_layers=1))
    assert [PLAIN.max_lora_rank(64), *(gdn.max_lora_rank(r) for r in (8, 64, 128))] == [64, 32, 256, 512]
    with pytest.raises(ValueError, match="--max-lora-rank 256"):
        gdn.max_lora_rank(256)


def test_the_config_vllm_reads_is_found_for_a_directory_and_for_a_hub_id(tmp_path, monkeypatch):
    """A model served by hub id gets its layout from the cached config.json, as vLLM reads it: a
    Qwen3.5 named ``Qwen/…`` is a vision-language checkpoint whatever class the ranks load."""
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    assert read_hf_config(str(tmp_path / "model")) == config
    # the hub's cache layout: refs/main names the snapshot that holds the files
    repo = tmp_path / "hub" / "models--Qwen--Qwen3.5-4B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert VllmLayout.of(read_hf_config("Qwen/Qwen3.5-4B"), caps(linear_attention_layers=1)).vision_language
    with pytest.raises(OSError):
        read_hf_config("Qwen/not-in-the-cache")
