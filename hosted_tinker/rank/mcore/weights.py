"""Each rank's shards of a Hugging Face checkpoint's weights under megatron-core ``GPTModel``'s
names, read from the safetensors by slice (no rank ever holds a whole tensor it does not keep).
The layouts are ``convert``'s; latent attention's are ``latent``'s, Gated-DeltaNet's ``hybrid``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from hosted_tinker.rank.mcore.convert import HfShape


class HfWeights:
    """Reads this rank's shards of the HF weights, by slice, from every safetensors file."""

    def __init__(self, model_path: str, shape: HfShape, tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0) -> None:
        self.shape, self.tp, self.r = shape, tp, tp_rank
        self.local_experts = range(ep_rank * shape.experts // ep, (ep_rank + 1) * shape.experts // ep)
        self._files: dict[str, Any] = {}
        for path in sorted(Path(model_path).glob("*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            for key in handle.keys():
                self._files[key] = handle
        # where the decoder is: a vision-language checkpoint's (and transformers 5 writes a text
        # model of one, a merged export say, the same way) under model.language_model.
        self.prefix = "model.language_model." if self.has("model.language_model.embed_tokens.weight") else "model."

    def full(self, key: str) -> Tensor:
        return self._files[key].get_tensor(key)

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        return self._files[key].get_slice(key)[start:stop]

    def row_part(self, key: str) -> Tensor:
        """Rank ``r``'s contiguous share of dim 0."""
        n = self._files[key].get_slice(key).get_shape()[0] // self.tp
        return self.rows(key, self.r * n, (self.r + 1) * n)

    def col_part(self, key: str) -> Tensor:
        """Rank ``r``'s contiguous share of dim 1."""
        sliced = self._files[key].get_slice(key)
        n = sliced.get_shape()[1] // self.tp
        return sliced[:, self.r * n : (self.r + 1) * n]

    def has(self, key: str) -> bool:
        return key in self._files

    def qkv(self, layer: int, part: str = "weight") -> Tensor:
        """This rank's ``linear_qkv`` rows (or bias): its query groups, each ``[q; k; v]``, or with
        Qwen3.5's output gate ``[q; gate; k; v]`` (HF's ``q_proj`` rows are per head ``[q; gate]``)."""
        s, p = self.shape, f"{self.prefix}layers.{layer}.self_attn"
        gated = 2 if s.attention_gate else 1
        groups = s.kv_heads // self.tp
        per_group = s.heads // s.kv_heads * s.head_dim
        g0 = self.r * groups
        q = self.rows(f"{p}.q_proj.{part}", g0 * per_group * gated, (g0 + groups) * per_group * gated)
        k = self.rows(f"{p}.k_proj.{part}", g0 * s.head_dim, (g0 + groups) * s.head_dim)
        v = self.rows(f"{p}.v_proj.{part}", g0 * s.head_dim, (g0 + groups) * s.head_dim)
        tail = q.shape[1:]
        if gated == 2:  # (groups, heads of a group, [q; gate], head_dim) -> queries, then gates
            q = q.reshape(groups, -1, 2, s.head_dim, *tail).transpose(1, 2)
        fused = torch.cat(
            [
                q.reshape(groups, gated * per_group, *tail),
                k.reshape(groups, s.head_dim, *tail),
                v.reshape(groups, s.head_dim, *tail),
            ],
            dim=1,
        )
        return fused.reshape(-1, *tail)

    def state_dict(self) -> dict[str, Tensor]:
        """Every megatron parameter this rank holds, under ``GPTModel``'s names."""
        s, model = self.shape, self.prefix
        out = {"embedding.word_embeddings.weight": self.row_part(f"{model}embed_tokens.weight")}
        for i in range(s.layers):
            hf, mc = f"{model}layers.{i}", f"decoder.layers.{i}"
            out[f"{mc}.input_layernorm.weight"] = self.full(f"{hf}.input_layernorm.weight")
            if s.latent is not None:
                out.update(s.latent.weights(self, i))
            elif s.hybrid is not None and s.hybrid.linear[i]:
                out.update(s.hybrid.weights(self, i))
            else:
                out.update(self.attention(i))
            out[f"{mc}.pre_mlp_layernorm.weight"] = self.full(f"{hf}.post_attention_layernorm.weight")
            if s.moe(i) and s.biases:  # gpt-oss: its router, and its experts fused in 3-D tensors
                out[f"{mc}.mlp.router.weight"] = self.full(f"{hf}.mlp.router.weight")
                out[f"{mc}.mlp.router.bias"] = self.full(f"{hf}.mlp.router.bias")
                for j, e in enumerate(self.local_experts):
                    out.update(self.fused_expert(f"{hf}.mlp.experts", e, f"{mc}.mlp.experts.local_experts.{j}"))
            elif s.moe(i):
                out[f"{mc}.mlp.router.weight"] = self.full(f"{hf}.mlp.gate.weight")
                if s.expert_bias:
                    out[f"{mc}.mlp.router.expert_bias"] = self.full(f"{hf}.mlp.gate.e_score_correction_bias")
                for j, e in enumerate(self.local_experts):  # whole: experts are not split over tp
                    local = f"{mc}.mlp.experts.local_experts.{j}"
                    if self.has(f"{hf}.mlp.experts.gate_up_proj"):  # fused in 3-D tensors (Qwen3.5-MoE's release)
                        out.update(self.stacked_expert(f"{hf}.mlp.experts", e, local))
                    else:
                        out.update(self.mlp(f"{hf}.mlp.experts.{e}", local, whole=True))
                if s.shared_ffn:
                    out.update(self.mlp(f"{hf}.mlp.{s.shared_hf}", f"{mc}.mlp.shared_experts"))
                if s.shared_gate:  # Qwen3.5's sigmoid gate on the shared expert's output
                    out[f"{mc}.mlp.shared_experts.gate_weight"] = self.full(f"{hf}.mlp.shared_expert_gate.weight")
            else:
                out.update(self.mlp(f"{hf}.mlp", f"{mc}.mlp"))
        out["decoder.final_layernorm.weight"] = self.full(f"{model}norm.weight")
        if not s.tied:
            out["output_layer.weight"] = self.row_part("lm_head.weight")
        return out

    def attention(self, layer: int) -> dict[str, Tensor]:
        """Layer ``layer``'s grouped-query attention: this rank's query groups and heads."""
        hf, mc = f"{self.prefix}layers.{layer}.self_attn", f"decoder.layers.{layer}.self_attention"
        out = {
            f"{mc}.linear_qkv.weight": self.qkv(layer),
            f"{mc}.linear_proj.weight": self.col_part(f"{hf}.o_proj.weight"),
        }
        if self.shape.qkv_bias:
            out[f"{mc}.linear_qkv.bias"] = self.qkv(layer, "bias")
        if self.shape.qk_norm:
            out[f"{mc}.q_layernorm.weight"] = self.full(f"{hf}.q_norm.weight")
            out[f"{mc}.k_layernorm.weight"] = self.full(f"{hf}.k_norm.weight")
        if self.shape.biases:  # row-parallel: its bias whole, added once after the ranks' sum
            out[f"{mc}.linear_proj.bias"] = self.full(f"{hf}.o_proj.bias")
        if self.shape.sinks:  # each head's, split with the heads
            out[f"{mc}.core_attention.softmax_offset"] = self.row_part(f"{hf}.sinks")
        return out

    def fused_expert(self, hf: str, e: int, mc: str) -> dict[str, Tensor]:
        """gpt-oss's expert ``e`` from its 3-D tensors (``gate_up_proj`` ``(E, H, 2I)``, gate and up
        interleaved by column; ``down_proj`` ``(E, I, H)``; their biases) as megatron's ``MLP``:
        ``linear_fc1`` ``[gate; up]`` rows, ``linear_fc2`` ``(H, I)``."""
        gate_up = self._files[f"{hf}.gate_up_proj"].get_slice(f"{hf}.gate_up_proj")[e]
        bias = self._files[f"{hf}.gate_up_proj_bias"].get_slice(f"{hf}.gate_up_proj_bias")[e]
        down = self._files[f"{hf}.down_proj"].get_slice(f"{hf}.down_proj")[e]
        return {
            f"{mc}.linear_fc1.weight": torch.cat([gate_up[:, 0::2].T, gate_up[:, 1::2].T]).contiguous(),
            f"{mc}.linear_fc1.bias": torch.cat([bias[0::2], bias[1::2]]),
            f"{mc}.linear_fc2.weight": down.T.contiguous(),
            f"{mc}.linear_fc2.bias": self._files[f"{hf}.down_proj_bias"].get_slice(f"{hf}.down_proj_bias")[e],
        }

    def stacked_expert(self, hf: str, e: int, mc: str) -> dict[str, Tensor]:
        """Expert ``e`` of experts kept as transformers 5's modules keep them: ``gate_up_proj``
        ``(E, 2I, H)``, gate rows then up rows (megatron's ``linear_fc1`` as it is), ``down_proj``
        ``(E, H, I)``."""
        return {
            f"{mc}.linear_fc1.weight": self._files[f"{hf}.gate_up_proj"].get_slice(f"{hf}.gate_up_proj")[e],
            f"{mc}.linear_fc2.weight": self._files[f"{hf}.down_proj"].get_slice(f"{hf}.down_proj")[e],
        }

    def mlp(self, hf: str, mc: str, whole: bool = False) -> dict[str, Tensor]:
        """One gated MLP (a dense layer's, or one expert's): ``linear_fc1`` ``[gate; up]``; this
        rank's tensor-parallel part of it, or ``whole``."""
        rows, cols = (self.full, self.full) if whole else (self.row_part, self.col_part)
        return {
            f"{mc}.linear_fc1.weight": torch.cat([rows(f"{hf}.gate_proj.weight"), rows(f"{hf}.up_proj.weight")]),
            f"{mc}.linear_fc2.weight": cols(f"{hf}.down_proj.weight"),
        }
