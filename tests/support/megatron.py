"""The LoRA spec, optimizer and training steps the Megatron and GPU tests share."""

from __future__ import annotations

import numpy as np

from hosted_tinker.core.types import AdamParams, LoraSpec
from tests.support.batches import random_batch

ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=10.0)

LORA = LoraSpec(rank=4, seed=5, train_unembed=True)


def steps(backend, model_id: str, seed: int, n: int) -> list:
    """``n`` accumulate-and-step rounds on a fixed stream of batches: what each returned."""
    rng, out = np.random.default_rng(seed), []
    for loss_fn in ("cross_entropy", "ppo", "importance_sampling")[:n]:
        result = backend.forward_backward(model_id, random_batch(rng, 3, loss_fn))
        out.append((result.logprobs, result.loss_sum, backend.optim_step(model_id, ADAM)["grad_norm"]))
    return out
