"""What the server hands vLLM for each mixture-of-experts and hybrid family, read by vLLM's own
LoRA loader (``tests/support/vllm_lora_loader.py``, in the vLLM environment): every module it
builds adds, per expert and per slice, exactly the product the server trained (Tinker's
layout: one A of gate/up and one B of down for all experts). vLLM's CPU build cannot run these
adapters (no kernels), so this is the CPU twin of ``scripts/gpu_checks.sh``'s vLLM MoE check,
which samples them on a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hosted_tinker.core.types import LoraSpec
from hosted_tinker.inference.vllm_layout import VllmLayout, read_hf_config
from hosted_tinker.rank.serve import local_rank
from tests.support.lora_reference import trained_looking
from tests.support.vllm_env import REPO, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The LoRA-capable leaf modules of vLLM's model classes (vllm/model_executor/models/: qwen3_moe.py,
# gpt_oss.py, qwen3_5.py, qwen3_vl_moe.py), as ``get_supported_lora_modules`` finds them.
ATTENTION, HYBRID = ["qkv_proj", "o_proj", "lm_head"], ["in_proj_qkvz", "in_proj_ba", "out_proj"]
SUPPORTED = {
    "qwen3_moe": [*ATTENTION, "experts", "gate"],
    "gpt_oss": [*ATTENTION, "experts", "router"],
    "qwen3_5": [*ATTENTION, *HYBRID, "gate_up_proj", "down_proj"],
    "qwen3_5_moe": [*ATTENTION, *HYBRID, "gate_up_proj", "down_proj", "experts", "gate", "shared_expert_gate"],
    "qwen3_vl_moe": [*ATTENTION, "experts", "gate"],
}
# vLLM's CPU wheel cannot import these classes (their modules import torchvision, which it leaves
# out): their attributes as vLLM 0.32 declares them (qwen3_vl.py Qwen3VLForConditionalGeneration,
# qwen3_5.py Qwen3_5ForConditionalGeneration, qwen3_vl_moe.py Qwen3VLMoeForConditionalGeneration)
QKV_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
VL_PREFIXES = {
    "model.visual.": "visual.",
    "lm_head.": "language_model.lm_head.",
    "model.language_model.": "language_model.model.",
}
QWEN3_5_VL = {
    "packed_modules_mapping": QKV_PACKED
    | {"gate_up_proj": ["gate_proj", "up_proj"], "qkv": ["qkv"]}
    | {"in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]},
    "orig_to_new_prefix": VL_PREFIXES | {"mtp.": None},
}
CLASS_ATTRIBUTES = {
    "qwen3_5": QWEN3_5_VL,
    "qwen3_5_moe": QWEN3_5_VL,
    "qwen3_vl_moe": {"packed_modules_mapping": QKV_PACKED, "orig_to_new_prefix": VL_PREFIXES},
}
# a module of ours -> (vLLM's module, slice): vLLM fuses these projections
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "in_proj_q": ("in_proj_qkvz", 0),
    "in_proj_k": ("in_proj_qkvz", 1),
    "in_proj_v": ("in_proj_qkvz", 2),
    "in_proj_z": ("in_proj_qkvz", 3),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def vllm_name(module: str, layout: VllmLayout, family: str) -> str:
    """Where vLLM keeps one of our (PEFT-named) modules, with its slice (``#i``) if packed."""
    name = module.removeprefix("base_model.model.")
    if layout.vision_language:  # vLLM's multimodal classes hold the text model as language_model
        name = "language_model." + name
    if family == "gpt_oss":
        name = name.replace(".self_attn.", ".attn.")
    stem, _, leaf = name.rpartition(".")
    if leaf in PACKED:
        fused, i = PACKED[leaf]
        return f"{stem}.{fused}#{i}"
    return name


def products(weights: dict[str, torch.Tensor], scale: float, layout: VllmLayout, family: str) -> dict:
    """What each of our modules adds (ΔW = scale · B A), per expert, under vLLM's names."""
    out = {}
    for key in (k for k in weights if ".lora_A." in k):
        module = key.removesuffix(".lora_A.weight")
        a, b = weights[key].double(), weights[f"{module}.lora_B.weight"].double()
        if a.dim() == 3:  # experts: a factor of one row is every expert's
            stem, _, proj = module.rpartition(".")
            for e in range(max(a.shape[0], b.shape[0])):
                delta = scale * b[min(e, b.shape[0] - 1)] @ a[min(e, a.shape[0] - 1)]
                out[f"{vllm_name(stem, layout, family)}#{proj}.{e}"] = delta
        else:
            out[vllm_name(module, layout, family)] = scale * b @ a
    return out


def test_vllm_reads_every_expert_and_linear_attention_lora_as_trained(tmp_path: Path, tiny_family):
    jobs, expected = [], {}
    for family in SUPPORTED:
        model_dir = tiny_family(family)
        rank = local_rank(str(model_dir))
        handle = trained_looking(rank.trainer.model, LoraSpec(rank=4, seed=3))
        weights = {k: p.detach().clone() for k, p in zip(handle.keys, handle.params, strict=True)}
        config = rank.trainer.model.adapter_config(handle)
        hf = read_hf_config(str(model_dir))
        layout = VllmLayout.of(hf, rank.capabilities)
        adapter = tmp_path / f"{family}-adapter"
        adapter.mkdir()
        for name, data in layout.files(config, weights).items():
            (adapter / name).write_bytes(data)
        text = hf.get("text_config", hf)
        key_dim = text.get("linear_num_key_heads", 0) * text.get("linear_key_head_dim", 0)
        value_dim = text.get("linear_num_value_heads", 0) * text.get("linear_value_head_dim", 0)
        experts = text.get("num_experts") or text.get("num_local_experts")
        jobs.append(
            {
                "dir": str(adapter),
                "arch": hf["architectures"][0],
                "supported": SUPPORTED[family],
                "shared_experts": layout.launch_args() == ["--enable-moe-shared-loras"],
                "max_lora_rank": layout.max_lora_rank(8),
                "vocab": rank.capabilities.vocab_size,
                "experts": {"E": experts, "H": 64, "I": text.get("moe_intermediate_size") or text["intermediate_size"]},
                "output_sizes": {"in_proj_qkvz": [key_dim, key_dim, value_dim, value_dim]},
                "out": str(tmp_path / f"{family}-products.safetensors"),
            }
            | ({"class_attributes": CLASS_ATTRIBUTES[family]} if family in CLASS_ATTRIBUTES else {})
        )
        expected[family] = products(weights, config["lora_alpha"] / config["r"], layout, family)
        assert layout.routed_experts == (experts is not None) and layout.linear_attention == family.startswith(
            "qwen3_5"
        )
    done = subprocess.run(
        [vllm_python(), str(REPO / "tests" / "support" / "vllm_lora_loader.py")],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for family, job in zip(SUPPORTED, jobs, strict=True):
        got = load_file(job["out"])
        assert set(got) == set(expected[family]), family  # every module, slice and expert; nothing else
        for name, want in expected[family].items():
            torch.testing.assert_close(got[name].double(), want, rtol=0, atol=1e-5, msg=f"{family} {name}")
