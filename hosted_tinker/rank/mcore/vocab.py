"""Per-token log-probs of targets from vocab-parallel logits: each rank holds the logits of its
``V / tp`` vocabulary rows, and no rank ever holds a whole ``[tokens, vocab]`` row.

    log p(t) = z_t - max - log Σ_ranks Σ_local exp(z - max)

The max is a constant (all-reduced, no gradient); the two sums are all-reduced with megatron's
``reduce_from`` region (all-reduce forward, identity backward), so each rank's gradient lands
on its own slice of the logits. ``core.logprobs.target_logprobs`` calls it on one chunk of
positions at a time (``rank.mcore.lora.TpLora.head`` gives that chunk's logits)."""

from __future__ import annotations

from torch import Tensor


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, vocab_start: int) -> Tensor:
    """``logits`` (T, V/tp) this rank's vocabulary slice, starting at token ``vocab_start``;
    ``targets`` (T, K) token ids over the whole vocabulary. Returns (T, K) float32 log-probs."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    peak = logits.detach().max(dim=-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - peak[:, None]
    total = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1))
    local = targets - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1)) * here
    return reduce_from_tensor_model_parallel_region(picked) - total.log()[:, None]
