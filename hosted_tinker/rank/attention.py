"""Attention over packed sequences: many sequences in one token stream, none seeing another.

A packed micro-batch is one row of ``T = ΣN`` tokens; ``cu_seqlens`` (``(S+1,)`` int32, from 0
to T) marks where each sequence starts, and positions restart at 0 in each. No pad token is
computed, and attention costs ``Σ N²`` rather than ``count × longest²``.

Transformers runs a model's attention through a registry of implementations; this module adds
one, ``packed``, that the training tree of ``rank.model`` uses. It runs PyTorch's
``scaled_dot_product_attention`` (causal) on each sequence's slice, which is exact on any device
and keeps PyTorch's fused kernels (the CPU flash kernel, FlashAttention / memory-efficient on
CUDA). Its mask function builds no mask: a ``T × T`` mask is what packing exists to avoid.
(Its name holds no "sdpa": transformers would then refuse it for models without sdpa support.)

A layer with attention sinks (gpt-oss: a learned per-head logit that joins every softmax and
takes its share of the weight) or a sliding window runs each sequence through the explicit
product instead, as transformers' eager implementation computes it, the window counted within
the sequence.

On CUDA with ``flash_attn`` installed and a 16-bit model without sinks, transformers' own
``flash_attention_2`` is used instead (varlen kernels over the same ``cu_seq_lens`` keyword
arguments: one launch for all sequences). No GPU has run that path here; ``packed`` is its CPU
twin and is what the equality tests pin.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

PACKED = "packed"


def packed_causal_attention(
    query: Tensor, key: Tensor, value: Tensor, bounds: list[int], scale: float | None, dropout: float = 0.0
) -> Tensor:
    """Causal attention within each packed sequence.

    query      ``(1, H, T, D)``; key, value ``(1, H_kv, T, D)`` (H a multiple of H_kv)
    bounds     ``cu_seqlens`` as a list: sequence i is ``[bounds[i], bounds[i+1])``
    returns    ``(1, H, T, D)``
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # expanded rather than enable_gqa: PyTorch's CPU flash kernel has no GQA
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
        )
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    return torch.cat(parts, dim=2)


# Scores one block of queries holds at once. The explicit product is quadratic in a sequence's
# length: a 32K-token sequence on gpt-oss-120b's 64 heads would hold 256 GiB of scores at once, so
# queries go in blocks, each (when there is more than one) recomputed in the backward pass
# rather than kept.
BLOCK_BYTES = 64 << 20


def packed_attention_with_sinks(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bounds: list[int],
    scale: float | None,
    sinks: Tensor | None,
    window: int | None,
) -> Tensor:
    """Causal attention within each packed sequence, a query seeing the last ``window`` positions
    of its sequence at most (None: all before it), each head's softmax joined by its ``sinks``
    logit (None: none), as transformers' eager attention of gpt-oss computes it. Shapes as
    ``packed_causal_attention``. Queries run in blocks of at most ``BLOCK_BYTES`` of scores, each
    against the keys it can see only (under a window of W, ``rows + W`` of them)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    heads, width = query.shape[1], query.element_size()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        n = end - start
        seen = n if window is None else min(n, window)
        rows = max(1, BLOCK_BYTES // (2 * heads * (seen + 1) * width))  # logits and weights
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        blocks = range(0, n, rows)
        for first in blocks:
            last = min(n, first + rows)
            lo = 0 if window is None else max(0, first - window + 1)
            args = (q[:, :, first:last], k[:, :, lo:last], v[:, :, lo:last], sinks, scale, first, lo, window)
            if len(blocks) > 1 and torch.is_grad_enabled():
                parts.append(torch.utils.checkpoint.checkpoint(_sink_block, *args, use_reentrant=False))
            else:
                parts.append(_sink_block(*args))
    return torch.cat(parts, dim=2)


def _sink_block(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, scale: float, q_at: int, k_at: int, window: int | None
) -> Tensor:
    """Queries ``q`` (positions ``q_at``.. of their sequence) over keys ``k`` (positions ``k_at``..)."""
    logits = (q @ k.transpose(2, 3)) * scale  # (1, H, m, n)
    q_pos = torch.arange(q.shape[2], device=q.device) + q_at
    k_pos = torch.arange(k.shape[2], device=q.device) + k_at
    hidden = k_pos[None, :] > q_pos[:, None]  # later keys
    if window is not None:
        hidden |= q_pos[:, None] - k_pos[None, :] >= window  # keys out of the window
    logits = logits.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(1, -1, q.shape[2], 1).to(logits.dtype)
        logits = torch.cat([logits, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values  # as transformers does (16-bit overflow)
    weights = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., : k.shape[2]]  # the sink's share dropped
    return weights.to(v.dtype) @ v


def packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: Tensor | None = None,
    sliding_window: int | None = None,
    s_aux: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: query ``(1, H, T, D)`` -> ``(1, T, H, D)``. Without
    ``cu_seq_lens_q`` the row is one sequence (a caller that did not pack). ``s_aux``: the
    layer's attention sinks (gpt-oss)."""
    if query.shape[0] != 1:
        raise ValueError("packed attention takes one row of packed sequences")
    bounds = [0, query.shape[2]] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    if s_aux is not None or sliding_window is not None:
        if dropout and module.training:
            raise ValueError("packed attention with sinks or a sliding window runs without dropout")
        out = packed_attention_with_sinks(query, key, value, bounds, scaling, s_aux, sliding_window)
    else:
        out = packed_causal_attention(query, key, value, bounds, scaling, dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """Packed attention confines itself to each sequence; no mask is built."""
    return None


def register() -> None:
    """Make ``packed`` an attention implementation transformers models can be set to."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED, packed_attention)
    AttentionMaskInterface.register(PACKED, _no_mask)


def has_sinks(model: nn.Module) -> bool:
    """Whether any attention layer of ``model`` has attention sinks (gpt-oss)."""
    return any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules())


def implementation(device: torch.device, dtype: torch.dtype, sinks: bool = False) -> str:
    """The attention implementation packed training runs on ``device`` for a ``dtype`` model
    (flash-attn's kernels take 16-bit inputs only, and no attention sinks)."""
    if (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and not sinks
        and importlib.util.find_spec("flash_attn") is not None
    ):
        return "flash_attention_2"
    register()
    return PACKED


def packing_kwargs(cu_seqlens: Tensor, max_len: int, implementation: str, device: torch.device) -> dict:
    """The keyword arguments a transformers model forwards to its attention for packed rows
    (the names of transformers' ``FlashAttentionKwargs``). ``packed`` reads the bounds in
    Python, so its ``cu_seqlens`` stay on the host: read from a GPU in every layer they would make
    the host wait for the device each time, leaving it idle while the next kernels are queued.
    flash-attn's varlen kernels read them on the device."""
    if implementation != PACKED:
        cu_seqlens = cu_seqlens.to(device)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len, "max_length_k": max_len}
