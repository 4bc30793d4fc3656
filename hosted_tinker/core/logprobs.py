"""Target log-probs from hidden states without materialising ``[tokens, vocab]`` logits at once."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hosted_tinker.core.types import DatumInput

Head = Callable[[Tensor], Tensor]  # hidden states (C, H) -> logits (C, V), or a rank's (C, V/tp)
FromLogits = Callable[[Tensor, Tensor], Tensor]  # (logits, targets (C, K)) -> log-probs (C, K)


def full_vocab_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``logits`` (C, V) over the whole vocabulary, ``targets`` (C, K) -> (C, K) float32."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (C, 1)
    return logits.gather(-1, targets) - lse


def _chunk_logprobs(head: Head, hidden: Tensor, targets: Tensor, from_logits: FromLogits) -> Tensor:
    return from_logits(head(hidden), targets)


# One chunk's float32 logits: 2,048 positions of a vocabulary up to 32K; fewer of a larger one
# (441 of Qwen3's 151,936), so that the memory a step holds for its log-probs, about four times
# this (logits, their exponent, the gradient), does not grow with the vocabulary.
LOGITS_CHUNK_BYTES = 256 << 20
MAX_CHUNK_TOKENS = 2048
MIN_CHUNK_TOKENS = 64  # a chunk's matmul stays large enough to keep a GPU busy


def chunk_tokens_for(vocab: int) -> int:
    """Positions per chunk whose float32 logits fit ``LOGITS_CHUNK_BYTES``."""
    return max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, LOGITS_CHUNK_BYTES // (4 * vocab)))


def target_logprobs(
    head: Head,
    hidden: Tensor,
    targets: Tensor,
    chunk_tokens: int = MAX_CHUNK_TOKENS,
    from_logits: FromLogits = full_vocab_logprobs,
) -> Tensor:
    """Log-probabilities of ``targets`` under ``log_softmax(head(hidden))``.

    hidden        ``(T, H)``: final hidden states of the positions to score
    targets       ``(T, K)`` int64: K target ids per position (K=1 for next-token targets)
    chunk_tokens  positions per chunk (``chunk_tokens_for(vocab)``)
    from_logits   a chunk's logits and targets to their log-probs: ``full_vocab_logprobs``, or
                  a tensor-parallel rank's over its slice of the vocabulary (``rank.mcore.vocab``)
    returns       ``(T, K)`` float32

    With autograd on, each chunk is recomputed in the backward pass, so peak memory holds the
    logits of one chunk rather than of all T positions.
    """
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, head, h, t, from_logits, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t, from_logits))
    return torch.cat(parts) if parts else hidden.new_zeros((0, targets.shape[-1]), dtype=torch.float32)


def packed_targets(data: list[DatumInput]) -> Tensor:
    """Every datum's targets one position per row, in datum order: ``(ΣN, K)`` int64, K the
    widest datum's (1 for next-token targets; narrower rows padded with id 0, never read)."""
    k = max(d.target_tokens.shape[1] if d.target_tokens.dim() == 2 else 1 for d in data)
    targets = torch.zeros((sum(d.num_tokens for d in data), k), dtype=torch.long)
    row = 0
    for d in data:
        t = d.target_tokens.reshape(d.num_tokens, -1)
        targets[row : row + d.num_tokens, : t.shape[1]] = t
        row += d.num_tokens
    return targets


def unpacked(logprobs: Tensor, data: list[DatumInput]) -> list[Tensor]:
    """``packed_targets``'s ``(ΣN, K)`` log-probs back per datum: ``(N, K)`` for top-K targets,
    ``(N,)`` for next-token ones."""
    out, row = [], 0
    for d in data:
        piece = logprobs[row : row + d.num_tokens]
        out.append(piece if d.target_tokens.dim() == 2 else piece[:, 0])
        row += d.num_tokens
    return out
