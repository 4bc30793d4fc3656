"""Gated-DeltaNet linear attention (Qwen3.5 / 3.6) over packed sequences.

A Gated-DeltaNet layer runs a short causal convolution over its q/k/v projections, then a
recurrence (the gated delta rule) whose state carries every earlier token forward. In a packed
row (``rank.attention``) both must restart at each sequence's first token, or one sequence's
tail would flow into the next: another tenant's, in a joint pass. Transformers 5 keeps them
apart only through flash-linear-attention's varlen kernels (Triton, CUDA); its PyTorch fallback
refuses ``cu_seqlens``.

``packed_forward`` is the layer's forward for a packed row, set on each such layer of the
training tree (``install``). It keeps the layer's own projections, norm and output (so LoRA's
hooks on them apply as on any linear layer) and replaces the two sequence-mixing steps:

- the convolution runs once over the row with ``K - 1`` zeros put before each sequence, the
  zeros a per-sequence convolution pads with, so each output reads its own sequence only;
- the delta rule runs per sequence with transformers' own PyTorch reference on the CPU, and in
  one varlen launch of flash-linear-attention's ``chunk_gated_delta_rule`` on CUDA when it is
  installed (the ``linear-attention`` extra). No GPU has run that path here; the per-sequence
  reference is its CPU twin and what the equality tests pin.

Tinker puts LoRA on a Gated-DeltaNet layer's q, k and v projections separately
(``in_proj_q`` / ``_k`` / ``_v``: row slices of the checkpoint's fused ``in_proj_qkv``), on
``in_proj_z`` and ``out_proj``, and none on the per-head gates ``in_proj_a`` / ``in_proj_b``
(the cookbook's LoRA parameter counts for Qwen3.5 4B, 9B, 27B and 35B-A3B give exactly that).
``split_targets`` names those slices for ``rank.adapters``.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SPLIT = ("in_proj_q", "in_proj_k", "in_proj_v")  # Tinker's LoRA targets within in_proj_qkv, in its row order
GATES = ("in_proj_a", "in_proj_b")  # per-head decay and write strength: no LoRA on the service


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` is a Gated-DeltaNet layer of Qwen3.5's layout (fused ``in_proj_qkv``)."""
    return all(
        hasattr(module, name) for name in ("in_proj_qkv", "in_proj_z", *GATES, "conv1d", "A_log", "dt_bias", "norm")
    )


# Words in the class names of layers that mix positions by a recurrence or a convolution (linear
# attention, state-space models): left to transformers, such a layer would run a packed row as one
# sequence, each sequence's state flowing into the next one's (another tenant's, in a joint pass)
SEQUENCE_MIXERS = ("DeltaNet", "Mamba", "LinearAttention", "Rwkv", "ShortConv", "Lightning")


def unpackable_layers(model: nn.Module) -> list[str]:
    """Class names of ``model``'s layers that carry state from position to position and that this
    module cannot restart at packed sequence boundaries (all but Qwen3.5's Gated-DeltaNet): a model
    with any is not served."""
    names = {type(m).__name__ for m in model.modules() if not is_gated_delta_net(m)}
    return sorted(name for name in names if any(word in name for word in SEQUENCE_MIXERS))


def gated_delta_modules(model: nn.Module) -> dict[str, Any]:
    """The Gated-DeltaNet layers of ``model``, by qualified name (of transformers' classes for
    each family, which share no base class: read by the attribute names they share)."""
    return {name: m for name, m in model.named_modules() if is_gated_delta_net(m)}


def split_targets(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Tinker's separate q/k/v LoRA targets of each Gated-DeltaNet layer: ``<layer>.in_proj_q``
    -> (``<layer>.in_proj_qkv``, first row, end row) of the fused projection it is part of."""
    out: dict[str, tuple[str, int, int]] = {}
    for name, layer in gated_delta_modules(model).items():
        sizes = (layer.key_dim, layer.key_dim, layer.value_dim)
        start = 0
        for target, size in zip(SPLIT, sizes, strict=True):
            out[f"{name}.{target}"] = (f"{name}.in_proj_qkv", start, start + size)
            start += size
    return out


def install(model: nn.Module) -> int:
    """Give every Gated-DeltaNet layer of ``model`` the packed forward (on the instance: another
    tree over the same weights keeps transformers' own); how many there are."""
    layers = gated_delta_modules(model)
    for layer in layers.values():
        layer.forward = types.MethodType(packed_forward, layer)
    return len(layers)


# ---- the packed forward ---------------------------------------------------------------------------


def packed_forward(
    self: Any,  # a Gated-DeltaNet layer (``gated_delta_modules``)
    hidden_states: Tensor,
    cache=None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """transformers' Gated-DeltaNet forward for one packed row ``(1, T, H)`` whose sequences
    ``cu_seq_lens_q`` marks; a row without bounds, or a pass with a cache (decoding), runs
    transformers' own forward."""
    bounds = kwargs.pop("cu_seq_lens_q", None)
    if bounds is None or cache is not None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if hidden_states.shape[0] != 1:
        raise ValueError("packed linear attention takes one row of packed sequences")
    tokens = hidden_states.shape[1]
    mixed = self.in_proj_qkv(hidden_states)[0]  # (T, 2·key_dim + value_dim)
    z = self.in_proj_z(hidden_states).reshape(tokens, -1, self.head_v_dim)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)

    mixed = packed_causal_conv(mixed, self.conv1d.weight[:, 0], self.conv1d.bias, bounds, self.activation)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(1, tokens, -1, self.head_k_dim)
    key = key.reshape(1, tokens, -1, self.head_k_dim)
    value = value.reshape(1, tokens, -1, self.head_v_dim)
    beta = b.sigmoid()
    # in float32, as transformers computes it (a float16 model's exp(A_log) could overflow)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    out = packed_delta_rule(torch_delta_rule(self), query, key, value, g, beta, bounds)  # (1, T, heads, head_v_dim)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(1, tokens, -1))


def packed_causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, bounds: Tensor, activation: str | None
) -> Tensor:
    """The depthwise causal convolution of each packed sequence of ``x`` ``(T, C)`` (``weight``
    ``(C, K)``), as transformers runs it on one sequence: ``F.conv1d`` with ``K - 1`` zeros of
    left padding, then the activation. One convolution for the row: each sequence is copied
    behind its own ``K - 1`` zeros, so no output reads another sequence, and each reads the same
    products as alone."""
    from transformers.activations import ACT2FN

    tokens, channels = x.shape
    pad = weight.shape[-1] - 1
    bounds = bounds.to(x.device)
    lengths = bounds[1:] - bounds[:-1]
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths, output_size=tokens)
    slots = torch.arange(tokens, device=x.device) + pad * (sequence + 1)  # token t's column in the padded row
    padded = x.new_zeros(channels, tokens + pad * len(lengths)).index_copy(1, slots, x.T.to(weight.dtype))
    out = F.conv1d(padded[None], weight[:, None], bias, groups=channels)[0]  # column j: padded j .. j + K - 1
    out = out.index_select(1, slots - pad).T
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def packed_delta_rule(
    reference: Callable[..., tuple[Tensor, Tensor | None]],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    bounds: Tensor,
) -> Tensor:
    """The gated delta rule (q/k L2-normalised, as Qwen3.5 calls it) restarted at each packed
    sequence: flash-linear-attention's varlen kernel on CUDA where it is installed, else
    ``reference`` (transformers' PyTorch one, ``torch_delta_rule``) one sequence at a time."""
    if query.is_cuda and fla_available():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        groups = value.shape[2] // query.shape[2]  # each q/k head serves this many value heads
        if groups > 1:
            query, key = query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
        out, _ = chunk_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            cu_seqlens=bounds.to(query.device, torch.long),
            use_qk_l2norm_in_kernel=True,
        )
        return out
    cuts = bounds.tolist()
    parts = [
        reference(
            query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], use_qk_l2norm_in_kernel=True
        )[0]
        for s, e in zip(cuts[:-1], cuts[1:], strict=True)
        if e > s
    ]
    return torch.cat(parts, dim=1)


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def torch_delta_rule(layer: nn.Module) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """transformers' PyTorch ``torch_chunk_gated_delta_rule`` of ``layer``'s modeling module,
    unwrapped from the kernel dispatch that binds flash-linear-attention's in its place when it
    is installed (its Triton kernels do not run on a CPU)."""
    module = sys.modules[type(layer).__module__]
    return inspect.unwrap(module.torch_chunk_gated_delta_rule)
