"""Sequences packed into one token stream, and a batch cut into packed micro-batches.

A packed micro-batch is the tokens of several sequences laid end to end (no padding), with
positions restarting at 0 in each sequence and ``cu_seqlens`` marking where each starts, as
varlen attention kernels take them. Pure: tensors in, tensors out, on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hosted_tinker.core.types import DatumInput


@dataclass(frozen=True)
class Packed:
    """tokens      int64 ``(T,)``, T = ΣN: every datum's tokens, in datum order
    positions   int64 ``(T,)``: each token's position within its own datum
    cu_seqlens  int32 ``(S+1,)``: datum i is ``tokens[cu_seqlens[i]:cu_seqlens[i+1]]``
    max_len     the longest datum's N"""

    tokens: Tensor
    positions: Tensor
    cu_seqlens: Tensor
    max_len: int


def pack(data: list[DatumInput]) -> Packed:
    lengths = torch.tensor([d.num_tokens for d in data], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(data) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    positions = torch.arange(int(lengths.sum())) - starts
    tokens = torch.cat([d.tokens for d in data]) if data else torch.zeros(0, dtype=torch.long)
    return Packed(tokens, positions, cu_seqlens, int(lengths.max()) if data else 0)


def microbatches(data: list[DatumInput], budget: int) -> list[list[int]]:
    """Datum indices, in order, grouped so that each group's tokens stay within ``budget``
    (a datum longer than the budget is a group of its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, d in enumerate(data):
        if current and tokens + d.num_tokens > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += d.num_tokens
    if current:
        batches.append(current)
    return batches
