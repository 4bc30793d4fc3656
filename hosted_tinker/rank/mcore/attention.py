"""Packed sequences on megatron-core's local (PyTorch) layers.

megatron-core runs packed sequences in its ``thd`` layout (one token stream, ``PackedSeqParams``
holding ``cu_seqlens``) only through transformer-engine's attention; its own
``DotProductAttention`` refuses them. This subclass takes them, running causal attention within
each sequence (``rank.attention.packed_causal_attention``), and leaves every other call to
megatron's code. Each tensor-parallel rank attends over its own heads, as megatron's does.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from hosted_tinker.rank.attention import packed_attention_with_sinks, packed_causal_attention


class PackedDotProductAttention(DotProductAttention):
    def __init__(
        self,
        *args,
        window: int | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs,
    ) -> None:
        """``window``: the layer's sliding window (gpt-oss), None for none; ``k_channels``,
        ``v_channels``: latent attention's head widths (``MLASelfAttention`` passes them, as to
        transformer-engine's attention), which the packed path reads from the tensors. Attention
        sinks are megatron's learnable softmax offset (``softmax_type="learnable"``), this
        rank's heads' of them."""
        super().__init__(*args, **kwargs)
        self.window = window

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        """``thd``: query ``(T, heads/tp, D)``, key/value ``(T, groups/tp, D)`` -> ``(T, heads/tp · D)``."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # (1, heads, T, D)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        sinks = self.softmax_offset if self.config.softmax_type == "learnable" else None
        if sinks is not None or self.window is not None:
            out = packed_attention_with_sinks(q, k, v, bounds, self.softmax_scale, sinks, self.window)
        else:
            out = packed_causal_attention(q, k, v, bounds, self.softmax_scale)  # (1, heads, T, D)
        return out[0].transpose(0, 1).reshape(query.shape[0], -1)
