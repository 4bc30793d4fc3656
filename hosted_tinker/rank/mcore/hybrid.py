"""Qwen3.5 / 3.6 (dense and MoE) on megatron-core: Gated-DeltaNet linear attention on most
layers, gated full attention on the others, zero-centred norms, a partial rotary embedding.

megatron-core 0.16.1 ships a ``GatedDeltaNet`` (``ssm/gated_delta_net.py``), but it refuses
packed sequences, imports flash-linear-attention's Triton kernels even on a CPU, and fuses q, k,
v, z, b and a into one projection. ``GatedDeltaNet`` here is the HF layer on megatron's parallel
linear layers, split by heads over the tensor-parallel ranks (a head's convolution channels and
recurrence read that head alone, so the split is exact), its convolution and delta rule
restarted at each packed sequence by the HF path's own functions (``rank.linear_attention``):

- ``in_proj_qkv`` (column-parallel): rank ``r``'s rows ``[q heads of r; k heads of r; v heads of
  r]``, and its convolution's channels in that order; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``
  (column-parallel) its value heads' rows; ``A_log``, ``dt_bias`` its value heads'.
- ``out_proj`` (row-parallel), the gated norm whole (one weight per head's channel).
- Under sequence parallelism the layer gathers its input once for the four projections (each of
  megatron's column-parallel layers would gather it again), which then leave their input
  gradients each rank's share, for the gather's backward to sum and split in one reduce-scatter;
  so do their LoRA (``lora.whole_input_delta``).

The full-attention layers are megatron's ``SelfAttention`` with ``attention_output_gate``: HF's
``q_proj`` rows are per head ``[query; gate]``, megatron's ``linear_qkv`` per query group
``[queries; gates; key; value]`` (``weights.HfWeights.qkv``). Every RMSNorm but the gated one scales by
``1 + weight`` in float32 (``ZeroCenteredNorm``, as HF's ``Qwen3_5RMSNorm``). Text positions give
M-RoPE's three sections one position: the rotary embedding is the plain one over the first
``partial_rotary_factor`` of each head.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hosted_tinker.rank.linear_attention import packed_causal_conv, packed_delta_rule, torch_delta_rule


@dataclass(frozen=True)
class Hybrid:
    """What of a Qwen3.5 text config shapes its linear-attention layers."""

    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int
    conv_kernel: int
    linear: tuple[bool, ...]  # per decoder layer: Gated-DeltaNet (else gated full attention)
    rotary_percent: float  # of each head's dimensions, rotated

    @classmethod
    def read(cls, text: dict[str, Any], model_path: str) -> Hybrid:
        rope = text.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the megatron backend does not convert Qwen3.5's rope scaling {rope} ({model_path})")
        if text.get("attention_bias"):
            raise ValueError(f"the megatron backend converts Qwen3.5 without attention biases; {model_path} has them")
        kinds = text["layer_types"]
        if unknown := sorted(set(kinds) - {"linear_attention", "full_attention"}):
            raise ValueError(f"the megatron backend does not convert Qwen3.5 layers of type {', '.join(unknown)}")
        return cls(
            key_heads=text["linear_num_key_heads"],
            value_heads=text["linear_num_value_heads"],
            key_dim=text["linear_key_head_dim"],
            value_dim=text["linear_value_head_dim"],
            conv_kernel=text["linear_conv_kernel_dim"],
            linear=tuple(kind == "linear_attention" for kind in kinds),
            rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
        )

    def check_tp(self, tp: int) -> None:
        for what, n in (("linear_num_key_heads", self.key_heads), ("linear_num_value_heads", self.value_heads)):
            if n % tp:
                raise ValueError(f"--backend-option tp={tp} does not divide the model's {what} ({n})")

    def rows(self, tp: int, r: int) -> list[tuple[int, int]]:
        """Rank ``r``'s rows of HF's fused ``in_proj_qkv`` (and channels of its convolution), in its
        order: its key heads' query rows, key rows, then its value heads' rows."""
        k, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        kr, vr = k // tp, v // tp
        return [(r * kr, (r + 1) * kr), (k + r * kr, k + (r + 1) * kr), (2 * k + r * vr, 2 * k + (r + 1) * vr)]

    def weights(self, hf: Any, layer: int) -> dict[str, Tensor]:
        """Layer ``layer``'s Gated-DeltaNet weights on ``hf``'s rank (``weights.HfWeights``)."""
        p, mc = f"{hf.prefix}layers.{layer}.linear_attn", f"decoder.layers.{layer}.self_attention"
        rows = self.rows(hf.tp, hf.r)
        qkv = torch.cat([hf.rows(f"{p}.in_proj_qkv.weight", s, e) for s, e in rows])
        conv = torch.cat([hf.rows(f"{p}.conv1d.weight", s, e) for s, e in rows])[:, 0]
        return {
            f"{mc}.in_proj_qkv.weight": qkv,
            f"{mc}.in_proj_z.weight": hf.row_part(f"{p}.in_proj_z.weight"),
            f"{mc}.in_proj_b.weight": hf.row_part(f"{p}.in_proj_b.weight"),
            f"{mc}.in_proj_a.weight": hf.row_part(f"{p}.in_proj_a.weight"),
            f"{mc}.conv_weight": conv,
            f"{mc}.A_log": hf.row_part(f"{p}.A_log"),
            f"{mc}.dt_bias": hf.row_part(f"{p}.dt_bias"),
            f"{mc}.norm.weight": hf.full(f"{p}.norm.weight"),
            f"{mc}.out_proj.weight": hf.col_part(f"{p}.out_proj.weight"),
        }


class GatedDeltaNet(nn.Module):
    """A Gated-DeltaNet layer over a packed stream, this rank's heads of it (see the module's
    docstring); built by megatron's ``TransformerLayer`` in the place of its self-attention."""

    def __init__(self, config: Any, layer_number: int = 1, hybrid: Hybrid | None = None, **kwargs: Any) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from transformers.models.qwen3_5 import modeling_qwen3_5

        super().__init__()
        if hybrid is None:
            raise ValueError("GatedDeltaNet needs the model's Hybrid")
        tp = config.tensor_model_parallel_size
        self.config, self.hybrid, self.layer_number = config, hybrid, layer_number
        self.key_heads, self.value_heads = hybrid.key_heads // tp, hybrid.value_heads // tp
        key, value = self.key_heads * hybrid.key_dim, self.value_heads * hybrid.value_dim
        self.split = [key, key, value]  # this rank's q | k | v rows
        h = config.hidden_size
        # sequence parallelism: the input gathered once, here (``forward``), for the projections
        self.whole_input = bool(config.sequence_parallel) and tp > 1
        projections = copy.copy(config)  # the linear layers read sequence_parallel once, as built
        projections.sequence_parallel = False

        def column(out: int) -> nn.Module:  # out: the whole layer's rows
            return ColumnParallelLinear(
                h,
                out,
                config=projections,
                init_method=_unset,
                bias=False,
                gather_output=False,
                skip_bias_add=True,
                disable_grad_reduce=self.whole_input,  # its input's gradient: this rank's share
            )

        whole_key, whole_value = hybrid.key_heads * hybrid.key_dim, hybrid.value_heads * hybrid.value_dim
        self.in_proj_qkv = column(2 * whole_key + whole_value)
        self.in_proj_z = column(whole_value)
        self.in_proj_b = column(hybrid.value_heads)
        self.in_proj_a = column(hybrid.value_heads)
        dtype = config.params_dtype
        self.conv_weight = nn.Parameter(torch.empty(sum(self.split), hybrid.conv_kernel, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(self.value_heads, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads, dtype=dtype))
        self.norm = modeling_qwen3_5.Qwen3_5RMSNormGated(hybrid.value_dim, eps=config.layernorm_epsilon).to(dtype)
        self.out_proj = RowParallelLinear(
            whole_value, h, config=config, init_method=_unset, bias=False, input_is_parallel=True, skip_bias_add=True
        )
        # transformers' PyTorch delta rule (the CPU's; flash-linear-attention's kernel on CUDA), found
        # as the peft path finds it: through the modeling module of a layer of it (the gated norm)
        self._reference = torch_delta_rule(self.norm)

    def forward(self, hidden_states: Tensor, attention_mask: Any = None, packed_seq_params: Any = None, **_: Any):
        """``hidden_states`` ``[s, 1, H]`` (this rank's part of the stream under sequence
        parallelism) -> (``[s, 1, H]``, None), as megatron's attention answers."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("Gated-DeltaNet layers run packed sequences (thd) only")
        bounds = packed_seq_params.cu_seqlens_q
        if self.whole_input:  # backward: the projections' shares of its gradient, summed and split
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True)
        mixed = self.in_proj_qkv(hidden_states)[0][:, 0]  # (T, local q | k | v): the whole stream
        tokens = mixed.shape[0]
        z = self.in_proj_z(hidden_states)[0][:, 0]
        b, a = self.in_proj_b(hidden_states)[0][:, 0], self.in_proj_a(hidden_states)[0][:, 0]
        mixed = packed_causal_conv(mixed, self.conv_weight, None, bounds, "silu")
        query, key, value = torch.split(mixed, self.split, dim=-1)
        query = query.reshape(1, tokens, self.key_heads, self.hybrid.key_dim)
        key = key.reshape(1, tokens, self.key_heads, self.hybrid.key_dim)
        value = value.reshape(1, tokens, self.value_heads, self.hybrid.value_dim)
        beta = b.sigmoid()[None]
        # in float32, as transformers computes it (a 16-bit model's exp(A_log) could overflow)
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias))[None]
        out = packed_delta_rule(self._reference, query, key, value, g, beta, bounds)  # (1, T, heads, dv)
        dv = self.hybrid.value_dim
        out = self.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(tokens, 1, -1)
        return self.out_proj(out)[0], None


def _unset(weight: Tensor) -> None:
    """Every weight is loaded from the checkpoint (``perform_initialization`` is off)."""


class ZeroCenteredNorm(nn.Module):
    """Qwen3.5's RMSNorm: ``x / rms(x) · (1 + weight)`` in float32, then the input's dtype. Built
    by megatron as its norms are (``config``, ``hidden_size``, ``eps``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)
