"""megatron-core layer specs for a checkpoint's decoder (``convert.HfShape``): which module
builds each part of each layer, on megatron's local (PyTorch) layers or transformer-engine's."""

from __future__ import annotations

from typing import Any

from hosted_tinker.rank.mcore.convert import HfShape
from hosted_tinker.rank.mcore.hybrid import GatedDeltaNet, ZeroCenteredNorm


class FrozenNorm:
    """megatron-core's PyTorch norm (``WrappedTorchNorm``) for sequence-parallel layers. It
    refuses sequence parallelism because nothing would sum its weight's gradient over the ranks
    that each saw part of the sequence; the base model is frozen here, so there is none."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        import copy

        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        unsplit = copy.copy(config)
        unsplit.sequence_parallel = False
        # In the model's dtype, as its other weights: torch's norm in float32 on bfloat16 input
        # falls back from its fused kernel.
        return WrappedTorchNorm(unsplit, hidden_size, eps, **kwargs).to(config.params_dtype)


class LatentNorm:
    """HF's latent attention norms (``q_a_layernorm``, ``kv_a_layernorm``): RMSNorm's default
    epsilon, 1e-6, whatever the config's ``rms_norm_eps`` (megatron would give them that)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-6, **kwargs: Any):
        return FrozenNorm(config, hidden_size, 1e-6, **kwargs)


def block_spec(shape: HfShape, layers: int, te: bool = False):
    """``shape``'s decoder as megatron-core layer specs: its PyTorch layers (the local spec, every
    norm a ``FrozenNorm``), or with ``te`` transformer-engine's linear layers, attention and norms.

    Not megatron's own TE spec: that fuses each norm into the linear layer after it
    (``TELayerNormColumnParallelLinear``), whose input is then the un-normalised activation, while
    the LoRA branch beside ``linear_qkv`` and ``linear_fc1`` must see what the base weight sees
    (PEFT wraps ``q_proj``, whose input is normalised). Here norm and linear stay two modules, so
    the LoRA hooks (``lora``) see the same input on either spec, and the weights load under the
    same names. Both specs are the same module tree; only the classes at its leaves differ."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from hosted_tinker.rank.mcore.attention import PackedDotProductAttention

    if te and not shape.te_layers:
        raise ValueError(
            "layers=te: transformer-engine layers are not built for latent attention (DeepSeek-V3) "
            "nor linear attention (Qwen3.5 / 3.6)"
        )
    norm: Any = ZeroCenteredNorm if shape.hybrid is not None else FrozenNorm

    def kind(i: int) -> tuple[bool, int, bool]:
        return shape.moe(i), shape.window(i), shape.linear(i)

    specs = {}
    for moe, window, linear in {kind(i) for i in range(layers)}:
        layer = get_gpt_layer_local_spec(
            num_experts=shape.experts if moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=shape.qk_norm or shape.latent is not None,  # MLA's q/kv latent norms
            multi_latent_attention=shape.latent is not None,
            normalization="RMSNorm",
        )
        attention = layer.submodules.self_attention.submodules
        # packed sequences (thd) on PyTorch's kernels, with gpt-oss's sliding window where a layer has one
        attention.core_attention = ModuleSpec(module=PackedDotProductAttention, params={"window": window or None})
        if te:  # CUDA only: importing it needs transformer_engine
            from megatron.core.extensions.transformer_engine import (
                TEColumnParallelLinear,
                TEDotProductAttention,
                TENorm,
                TERowParallelLinear,
            )

            norm = TENorm  # frozen too; under sequence parallelism it only marks its weight, which has no gradient
            attention.linear_qkv, attention.linear_proj = TEColumnParallelLinear, TERowParallelLinear
            attention.core_attention = TEDotProductAttention
            if not moe:  # a MoE layer's experts keep megatron's PyTorch linear layers (SequentialMLP)
                mlp = layer.submodules.mlp.submodules
                mlp.linear_fc1, mlp.linear_fc2 = TEColumnParallelLinear, TERowParallelLinear
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
        if shape.latent is not None:
            from megatron.core.post_training.modelopt.layers import Linear

            attention.q_layernorm = attention.kv_layernorm = LatentNorm
            attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear  # whole (``latent``)
        elif shape.qk_norm:
            attention.q_layernorm = attention.k_layernorm = norm
        if linear:  # Qwen3.5's Gated-DeltaNet in the place of attention
            layer.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, params={"hybrid": shape.hybrid})
        specs[moe, window, linear] = layer
    return TransformerBlockSubmodules(layer_specs=[specs[kind(i)] for i in range(layers)], layer_norm=norm)
