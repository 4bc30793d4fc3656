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
