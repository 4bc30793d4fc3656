"""The products every LoRA update is made of, as autograd functions that keep less for the
backward pass than autograd would: ``x @ Aᵀ`` (``lora_down``), the update added into the base
layer's output (``add_into``), and the dtypes they run in. Shared by the linear layers'
adapters (``rank.adapters``) and the experts' (``rank.experts``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def products_dtype(compute: str, base: torch.dtype) -> torch.dtype | None:
    """The dtype LoRA's products run in under ``compute`` beside a base layer of dtype ``base``:
    None for the adapters' own (float32)."""
    return base if compute == "base" else None


def in_dtype(weight: Tensor, dtype: torch.dtype | None) -> Tensor:
    """An adapter's float32 ``weight`` as the products use it: itself, or cast to ``dtype`` (its
    gradient comes back through the cast as float32, where the optimizer keeps it)."""
    return weight if dtype is None else weight.to(dtype)


def scaled(update: Tensor, scale: float | Tensor) -> Tensor:
    """``update · scale``, skipped where the scale is 1 (alpha = rank, as at rank 32 under the
    default alpha of 32): the same values, without a float32 pass over ``(tokens, out)`` each way
    (on an H200, Qwen3-8B's shape, the step's scalings took 5 % of the GPU's time)."""
    return update if isinstance(scale, float) and scale == 1.0 else update * scale


class _AddInto(torch.autograd.Function):
    """``(base + update).to(base.dtype)`` as one operation: the sum is taken in the wider dtype
    (float32) and rounded once to the base's, which is what the two-step expression computes,
    bit for bit; without the float32 sum in memory, its separate cast, and, in the backward pass,
    the base's gradient cast to float32 and back (both exact, so left out). For a bfloat16
    base that was a third of the casts a LoRA layer made."""

    @staticmethod
    def forward(ctx, base: Tensor, update: Tensor) -> Tensor:
        ctx.update_dtype = update.dtype
        return torch.add(base, update, out=torch.empty_like(base))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.to(ctx.update_dtype)


def add_into(base: Tensor, update: Tensor) -> Tensor:
    """A layer's output ``base`` ``(..., out)`` plus its LoRA ``update`` (the same shape, float32
    or the base's dtype), in ``base``'s dtype: PEFT's ``(result + lora_out).to(result.dtype)``."""
    return _AddInto.apply(base, update)


class _LoraDown(torch.autograd.Function):
    """``x @ Aᵀ`` in A's dtype (float32), keeping ``x`` for the backward pass as it came: autograd
    would keep the float32 copy that the product reads, which for a bfloat16 model is twice the
    input's bytes, once per LoRA layer (q, k and v each made their own). Recast in the backward
    pass; the same operations, so the same values as ``F.linear(x.to(A.dtype), A)``."""

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, shares_over: dist.ProcessGroup | None) -> Tensor:
        ctx.save_for_backward(x, a)
        ctx.shares_over = shares_over
        return x.to(a.dtype) @ a.transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, a = ctx.saved_tensors
        grad_x = (grad @ a).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_a = None
        if ctx.needs_input_grad[1]:
            if ctx.shares_over is not None:  # this rank's share of the product's gradient: A's is the sum
                grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce needs it dense
                dist.all_reduce(grad, group=ctx.shares_over)
            xs = x.to(a.dtype)
            if a.dim() == 2:  # (r, in): every leading dimension of x is positions
                grad_a = grad.reshape(-1, grad.shape[-1]).T @ xs.reshape(-1, xs.shape[-1])
            else:  # (S, r, in), stacked adapters: x (S, L, in)
                grad_a = grad.transpose(-1, -2) @ xs
        return grad_x, grad_a, None


def lora_down(x: Tensor, a: Tensor, shares_over: dist.ProcessGroup | None = None) -> Tensor:
    """``x`` ``(..., in)`` (the base model's dtype) times ``a`` ``(r, in)``, or stacked ``(S, r, in)``
    with ``x`` ``(S, L, in)``: ``(..., r)`` in ``a``'s dtype (the float32 master weights, or their
    cast to the base's dtype under ``compute="base"``, where the product is the base's own).
    ``shares_over``: ranks on which ``x`` and ``a`` are the same and the product's gradient is each
    rank's share (a tensor-parallel group, each with its own rows of B): ``a``'s gradient is the
    sum over them, ``x``'s left as this rank's share, for what made ``x`` whole to sum."""
    return _LoraDown.apply(x, a, shares_over)
