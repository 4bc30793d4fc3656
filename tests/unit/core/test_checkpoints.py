"""Adapter files in Tinker's names (``core.checkpoints``): what the cookbook's ``weights`` tools
read is what the service writes, and what this server wrote before still reads back."""

from __future__ import annotations

import json

import pytest
import torch

from hosted_tinker.core.checkpoints import adapter_files, adapter_weights, peft_config

pytestmark = pytest.mark.fast

ATTN = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
HEAD = "base_model.model.lm_head.lora_B.weight"
CONFIG = {"r": 1, "target_modules": ["model.layers.0.self_attn.q_proj", "lm_head"]}


def written(family: str) -> tuple[dict, list[str]]:
    files = adapter_files(CONFIG, {ATTN: torch.ones(1, 4), HEAD: torch.zeros(8, 1)}, family)
    from safetensors.torch import load

    return json.loads(files["adapter_config.json"]), sorted(load(files["adapter_model.safetensors"]))


def test_gpt_oss_attention_is_written_attn_as_the_service_names_it_and_reads_back():
    config, keys = written("gpt_oss")
    assert keys == [
        "base_model.model.model.layers.0.attn.q_proj.lora_A.weight",
        "base_model.model.model.unembed_tokens.lora_B.weight",
    ]
    assert config["target_modules"] == ["model.layers.0.attn.q_proj", "lm_head"]
    files = adapter_files(CONFIG, {ATTN: torch.ones(1, 4), HEAD: torch.zeros(8, 1)}, "gpt_oss")
    assert sorted(adapter_weights(files["adapter_model.safetensors"], "gpt_oss")) == sorted([ATTN, HEAD])
    assert peft_config(config, "gpt_oss") == CONFIG


def test_other_families_keep_their_module_names_and_old_files_still_read():
    """``self_attn`` stays for Qwen and Llama (the cookbook's merge expects it there), and an
    ``attn`` module of another family is not renamed; a gpt-oss file this server wrote before
    (``self_attn``) reads as it did."""
    config, keys = written("qwen3")
    assert keys == [ATTN, "base_model.model.model.unembed_tokens.lora_B.weight"]
    assert config == CONFIG
    other = "base_model.model.transformer.blocks.0.attn.Wqkv.lora_A.weight"  # MPT's attention is attn
    files = adapter_files({}, {other: torch.ones(1, 4)}, "mpt")
    assert list(adapter_weights(files["adapter_model.safetensors"], "mpt")) == [other]
    old = adapter_files(CONFIG, {ATTN: torch.ones(1, 4)}, "")
    assert list(adapter_weights(old["adapter_model.safetensors"], "gpt_oss")) == [ATTN]
