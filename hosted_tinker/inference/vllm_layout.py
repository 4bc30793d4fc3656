"""What an adapter this server trains becomes for vLLM, per family, and what vLLM must be
started with to read it (vLLM 0.32 / 0.33's LoRA loader: ``vllm/lora/``).

- **Routed experts**: Tinker's layout (``experts.w1`` / ``w3``: one A for every expert
  ``(1, r, H)``, a B per expert ``(E, I, r)``; ``experts.w2``: an A per expert, one B) is the
  one vLLM reads when started with ``--enable-moe-shared-loras`` (``config/lora.py``,
  ``lora_weights.pack_moe_stacked``): the tensors go as they are. gpt-oss's gate and up stay
  apart: its kernel interleaves their LoRA outputs itself.
- **Gated-DeltaNet** (Qwen3.5 / 3.6): vLLM gives the fused ``in_proj_qkv`` one LoRA (its A is
  repeated over the q, k and v slices, ``expand_packed_lora``); Tinker gives q, k and v each
  their own. The same products, exactly: A = [A_q; A_k; A_v] (3r rows), B = blockdiag(B_q, B_k,
  B_v), with ``rank_pattern`` / ``alpha_pattern`` keeping the scale α/r; vLLM's
  ``--max-lora-rank`` must then hold 3r.
- **Vision-language checkpoints** (``…ForConditionalGeneration``: Qwen3-VL, Qwen3.5 as
  published): vLLM finds the decoder under ``model.language_model.``; ``model.layers.`` would
  load and then apply to nothing, silently.

- **Routing** (mixture of experts, for routing replay; ``--vllm-routing record``): started with
  ``--enable-return-routed-experts``, vLLM answers each choice with the experts every token
  chose where it was fed in (``routing``, ``vllm_engine.parse_response``).

Refused (``refusal``): DeepSeek-V3 / Kimi's multi-head latent attention, whose decode in vLLM
uses matrices folded from ``kv_b_proj``'s base weight, so its LoRA would shape the prompt and
not the sampled tokens; and experts or Gated-DeltaNet on vLLM's CPU build, which has no
kernels for either (``PunicaWrapperCPU`` lacks the fused-MoE LoRA ops; the delta rule is
flash-linear-attention's Triton kernel).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hosted_tinker.core.checkpoints import peft_adapter_files
from hosted_tinker.core.config import VLLM_LORA_RANKS
from hosted_tinker.core.types import Capabilities

QKV = ("in_proj_q", "in_proj_k", "in_proj_v")  # Tinker's targets within Gated-DeltaNet's in_proj_qkv
PEFT = "base_model.model."  # PEFT's prefix of tensor names (module names in target_modules go without)
DECODER, VL_DECODER = f"{PEFT}model.layers.", f"{PEFT}model.language_model.layers."


class Routing(NamedTuple):
    """The routing vLLM returns for routing replay: which of its decoder layers a record keeps
    (those with routed experts; vLLM returns every decoder layer's), of how many experts a token
    chooses, among how many. ``layers`` empty: vLLM returns none."""

    layers: tuple[int, ...] = ()
    top_k: int = 0
    experts: int = 0


NO_ROUTING = Routing()


@dataclass(frozen=True)
class VllmLayout:
    """How the served model's adapters are laid out for vLLM (PEFT's names on the way in)."""

    routed_experts: bool = False
    linear_attention: bool = False
    vision_language: bool = False  # vLLM loads the checkpoint's ...ForConditionalGeneration
    latent_attention: bool = False  # DeepSeek's MLA (kv_b_proj)
    arch: str = ""
    routing: Routing = NO_ROUTING

    @classmethod
    def of(cls, hf_config: dict, capabilities: Capabilities, record_routing: bool = False) -> VllmLayout:
        """From the checkpoint's ``config.json`` (what vLLM builds its model from) and what the ranks
        found; ``record_routing``: whether vLLM is to return a mixture-of-experts model's routing
        (where the ranks replay it)."""
        text = hf_config.get("text_config") or hf_config
        architectures = hf_config.get("architectures") or [capabilities.arch]
        layers, top_k = capabilities.replay_routing
        replayed = record_routing and layers > 0 and layers == len(capabilities.moe_layers)
        routing = Routing(capabilities.moe_layers, top_k, capabilities.routed_experts)
        return cls(
            routed_experts=capabilities.routed_experts > 0,
            linear_attention=capabilities.linear_attention_layers > 0,
            vision_language=architectures[0].endswith("ForConditionalGeneration"),
            latent_attention=text.get("kv_lora_rank") is not None,
            arch=capabilities.arch,
            routing=routing if replayed else NO_ROUTING,
        )

    def refusal(self, on_gpu: bool) -> str | None:
        """Why vLLM cannot sample this model's adapters as trained, or None."""
        if self.latent_attention:
            return (
                f"{self.arch} has multi-head latent attention: vLLM decodes it with matrices folded from "
                "kv_b_proj's base weight, so the kv_b_proj LoRA Tinker trains would not reach sampled tokens"
            )
        if not on_gpu and (self.routed_experts or self.linear_attention):
            what = "LoRA on routed experts" if self.routed_experts else "Gated-DeltaNet attention"
            return f"{self.arch}'s {what} has no kernels in vLLM's CPU build (vLLM on a GPU has them)"
        return None

    def max_lora_rank(self, rank: int) -> int:
        """vLLM's ``--max-lora-rank`` for adapters up to ``rank``: a fused q/k/v LoRA is 3× as wide."""
        need = 3 * rank if self.linear_attention else rank
        fits = [size for size in sorted(VLLM_LORA_RANKS) if size >= need]
        if not fits:
            raise ValueError(
                f"--max-lora-rank {rank}: {self.arch}'s Gated-DeltaNet LoRA reaches vLLM at 3× the rank ({need}), "
                f"over vLLM's largest ({max(VLLM_LORA_RANKS)})"
            )
        return fits[0]

    def launch_args(self) -> list[str]:
        """Flags vLLM's server needs for these adapters (also those of a server at ``--inference-url``)."""
        shared = ["--enable-moe-shared-loras"] if self.routed_experts else []
        return shared + (["--enable-return-routed-experts"] if self.routing.layers else [])

    def changes_names(self, keys: set[str]) -> bool:
        """Whether ``adapter`` renames or fuses any of these (PEFT-named) tensors."""
        renamed = self.vision_language and any(k.startswith(DECODER) for k in keys)
        return renamed or (self.linear_attention and any(_qkv_part(k) for k in keys))

    def adapter(self, config: dict, weights: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        """``adapter_config.json`` and tensors under PEFT's names -> what vLLM loads."""
        if self.linear_attention:
            config, weights = fuse_qkv(config, weights)
        if self.vision_language:
            weights = {_under(k, DECODER, VL_DECODER): v for k, v in weights.items()}
            modules = config.get("target_modules")
            if isinstance(modules, list):
                renamed = [_under(m, DECODER.removeprefix(PEFT), VL_DECODER.removeprefix(PEFT)) for m in modules]
                config = config | {"target_modules": renamed}
        return config, weights

    def files(self, config: dict, weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
        return peft_adapter_files(*self.adapter(config, weights))


PLAIN = VllmLayout()  # a dense text model's: PEFT's files as they are


def _under(name: str, old: str, new: str) -> str:
    return new + name.removeprefix(old) if name.startswith(old) else name


def _qkv_part(key: str) -> str | None:
    """``in_proj_q`` / ``_k`` / ``_v`` if ``key`` is one of their LoRA tensors."""
    return next((part for part in QKV if f".{part}.lora_" in key), None)


def fuse_qkv(config: dict, weights: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Each Gated-DeltaNet layer's q/k/v LoRA as one LoRA of ``in_proj_qkv`` with the same products:
    ``blockdiag(B_q, B_k, B_v) @ [A_q; A_k; A_v] = [B_q A_q; B_k A_k; B_v A_v]``, at rank 3r and
    alpha 3α so that its scale stays α/r."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        if (part := _qkv_part(key)) is None:
            out[key] = tensor
            continue
        layer, rest = key.split(f".{part}.lora_")
        layers.setdefault(layer, {})[f"{part}.{rest.split('.')[0]}"] = tensor  # e.g. "in_proj_k.A"
    for layer, parts in layers.items():
        missing = [f"{p}.lora_{f}" for p in QKV for f in "AB" if f"{p}.{f}" not in parts]
        if missing:
            raise ValueError(f"{layer}: the Gated-DeltaNet LoRA lacks {missing} (Tinker trains q, k and v together)")
        out[f"{layer}.in_proj_qkv.lora_A.weight"] = torch.cat([parts[f"{p}.A"] for p in QKV])
        out[f"{layer}.in_proj_qkv.lora_B.weight"] = torch.block_diag(*(parts[f"{p}.B"] for p in QKV))
    if not layers:
        return config, out
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    modules = config.get("target_modules")
    if isinstance(modules, list):  # vLLM does not read it; kept true to the file
        modules = list(dict.fromkeys(_fused_module(m) for m in modules))
    fused = config | {
        "target_modules": modules,
        "rank_pattern": (config.get("rank_pattern") or {}) | {"in_proj_qkv": 3 * rank},
        "alpha_pattern": (config.get("alpha_pattern") or {}) | {"in_proj_qkv": 3 * alpha},
    }
    return fused, out


def _fused_module(module: str) -> str:
    stem, _, last = module.rpartition(".")
    return f"{stem}.in_proj_qkv".lstrip(".") if last in QKV else module


def read_hf_config(model_path: str) -> dict:
    """The checkpoint's ``config.json``, what vLLM builds its model from: in its directory, or
    from the hub's cache for a hub id (``OSError`` if neither has it)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path):
        from huggingface_hub import hf_hub_download  # a hub id: as transformers finds its files

        path = hf_hub_download(model_path, "config.json")
    with open(path) as f:
        return json.load(f)
