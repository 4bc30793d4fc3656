"""Random training batches for the trainer-level tests (plans, DDP): datums of unequal lengths
with the inputs each loss needs."""

from __future__ import annotations

import numpy as np
import torch

from hosted_tinker.core import losses
from hosted_tinker.core.types import DatumInput, ForwardBackwardBatch


def random_batch(
    rng: np.random.Generator,
    size: int,
    loss_fn: str = "cross_entropy",
    lengths: tuple[int, int] = (3, 40),
    vocab: int = 500,
) -> ForwardBackwardBatch:
    """``size`` datums whose lengths are drawn from ``[lengths[0], lengths[1])``, tokens from
    ``[10, vocab)``; cross-entropy weights in [0, 1.5), policy-loss logprobs and advantages."""
    data = []
    for n in rng.integers(*lengths, size):
        n = int(n)
        tokens = torch.from_numpy(rng.integers(10, vocab, n + 1))
        if loss_fn == "cross_entropy":
            inputs = {"weights": torch.from_numpy(rng.uniform(0.0, 1.5, n).astype(np.float32))}
        else:
            inputs = {
                "logprobs": torch.from_numpy(rng.uniform(-8.0, -4.0, n).astype(np.float32)),
                "advantages": torch.from_numpy(rng.normal(0.0, 1.0, n).astype(np.float32)),
            }
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = torch.ones(n)
            if loss_fn == "stable_reinforce":  # what the server resolves from provenance spans
                inputs["sampled_mask"] = torch.from_numpy((rng.uniform(size=n) > 0.3).astype(np.float32))
        data.append(DatumInput(tokens=tokens[:-1], target_tokens=tokens[1:], inputs=inputs))
    config = dict(losses.LOSSES[loss_fn].config_defaults)
    return ForwardBackwardBatch(data=data, loss_fn=loss_fn, loss_config=config, forward_only=False)


def padded_logprobs(model, handle, data: list[DatumInput], **_) -> list[torch.Tensor]:
    """The path packing replaced, for comparison: ``HfLoraModel``'s data right-padded into one
    ``(count, longest)`` batch with an attention mask, through transformers' own sdpa attention,
    logits of every position at once, log-softmax in float64. Takes the place of
    ``HfLoraModel.logprobs``."""
    model.adapters.activate(handle.name)
    for p in handle.params:
        p.requires_grad_(True)
    lm = model.adapters.lm
    longest = max(d.num_tokens for d in data)
    ids = torch.zeros((len(data), longest), dtype=torch.long)
    mask = torch.zeros((len(data), longest), dtype=torch.long)
    for row, d in enumerate(data):
        ids[row, : d.num_tokens] = d.tokens
        mask[row, : d.num_tokens] = 1
    packed_implementation = lm.config._attn_implementation
    lm.set_attn_implementation("sdpa")
    try:
        logits = lm(input_ids=ids, attention_mask=mask).logits.double()
    finally:
        lm.set_attn_implementation(packed_implementation)
    logprobs = logits.log_softmax(-1)
    out = []
    for row, d in enumerate(data):
        targets = d.target_tokens.reshape(d.num_tokens, -1)
        lp = logprobs[row, : d.num_tokens].gather(-1, targets)
        out.append(lp if d.target_tokens.dim() == 2 else lp[:, 0])
    return out
